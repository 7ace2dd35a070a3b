"""Replies already sent, by request id: a retried request is answered again, not worked again.

    cache = ReplyCache(max_entries=4096, ttl_s=120.0)
    cache.put(("acme", "9f2c..."), encoded_reply, now=time.monotonic())
    cache.get(("acme", "9f2c..."), now=time.monotonic())   # the same bytes, or None

Bounded both ways: least-recently-stored entries go first past ``max_entries``, and an entry
older than ``ttl_s`` is never returned (the TTL should cover the callers' retry horizon: a
retry later than that is worked again). Keys are (tenant, request id), so one tenant's ids
can never replay another tenant's replies.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


class ReplyCache:
    def __init__(self, max_entries: int, ttl_s: float) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries}: must be >= 1")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s={ttl_s}: must be > 0")
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self._entries: OrderedDict[Hashable, tuple[float, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, now: float) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        stored_at, data = entry
        if now - stored_at > self.ttl_s:
            del self._entries[key]
            return None
        return data

    def put(self, key: Hashable, data: bytes, now: float) -> None:
        self._entries[key] = (now, data)
        self._entries.move_to_end(key)
        # Oldest first: entries are stored in time order, so expired ones sit at the front.
        while self._entries:
            oldest_key, (stored_at, _) = next(iter(self._entries.items()))
            if len(self._entries) > self.max_entries or now - stored_at > self.ttl_s:
                del self._entries[oldest_key]
            else:
                break
