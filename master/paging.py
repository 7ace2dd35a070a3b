"""One page of a list op's records: bounded in count and in bytes, resumed by a cursor.

Every list op of the master (`workloads`, `jobs`, `list`, `tenants`, `usage`) answers through
`page`: a reply that grew with history passed NATS's max payload (1 MB by default) and the
caller got nothing at all. A page holds at most ``limit`` records (0: `LIST_PAGE_DEFAULT`,
capped to `LIST_PAGE_MAX`) and at most `LIST_PAGE_BYTES_FRACTION` of the max payload; its
``next_cursor`` is the sort key of its last record ("" after the last page). A cursor is
opaque to the caller; a record added or removed between two pages moves nothing else.
"""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

from protocol.errors import InvalidField
from protocol.policy import LIST_PAGE_BYTES_FRACTION, LIST_PAGE_DEFAULT, LIST_PAGE_MAX

T = TypeVar("T")
CURSOR_MAX = 512  # characters: a sort key is a timestamp and two names at most


def page_limit(limit: int) -> int:
    if limit < 0:
        raise InvalidField("limit", f"{limit}: must be >= 0 (0 = the default page of {LIST_PAGE_DEFAULT})")
    return LIST_PAGE_DEFAULT if limit == 0 else min(limit, LIST_PAGE_MAX)


def page(items: Iterable[tuple[str, T]], limit: int, cursor: str, max_payload: int,
         size: Callable[[T], int]) -> tuple[list[T], str]:
    """(the records after ``cursor`` in key order, up to the bounds; the next cursor or "")."""
    if not isinstance(cursor, str) or len(cursor) > CURSOR_MAX:
        raise InvalidField("cursor", f"must be a reply's next_cursor (at most {CURSOR_MAX} characters)")
    n = page_limit(limit)
    budget = int(max_payload * LIST_PAGE_BYTES_FRACTION)
    out: list[T] = []
    used, last = 0, ""
    for key, item in sorted((kv for kv in items if kv[0] > cursor), key=lambda kv: kv[0]):
        if len(out) >= n:
            return out, last
        cost = size(item)
        if out and used + cost > budget:
            return out, last
        out.append(item)
        used, last = used + cost, key
    return out, ""


def time_key(at: float, name: str) -> str:
    """A sort key in (time, name) order as a string (fixed width: string order is time order)."""
    return f"{at:020.6f} {name}"


def name_key(*names: str) -> str:
    """A sort key in the order of the names' tuple: ' ' sorts below every name character."""
    return " ".join(names)
