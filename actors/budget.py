"""A memory budget over resident entries (a trainer's tenant slots, an inferencer's heads).

    victims = lru_victims(entries, budget)   # entries: (key, bytes, last_used, evictable)

Which entries to drop so the rest fit: least recently used first, skipping those that may not
go (in use, or holding state nothing else has); it stops as soon as the total fits. What cannot
be dropped stays, so the total may stay over the budget while everything is in use: a budget
bounds what is idle, never what runs (docs/scale.md).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

MIB = 2**20


def budget_bytes(mb: float) -> int:
    """A ``*_BUDGET_MB`` setting in bytes (0: no budget)."""
    return int(mb * MIB)


def mib(n: int) -> str:
    """Bytes as a person reads them in a log line or an error: ``12.3 MiB``."""
    return f"{n / MIB:.1f} MiB"


def lru_victims(entries: Iterable[tuple[Hashable, int, float, bool]], budget: int) -> list[Hashable]:
    """Keys to drop, oldest first, until the entries left hold at most ``budget`` bytes.

    ``entries``: (key, bytes, last used: any increasing stamp, may it be dropped). A budget of
    0 is none: nothing is dropped."""
    entries = list(entries)
    total = sum(size for _, size, _, _ in entries)
    if budget <= 0 or total <= budget:
        return []
    victims = []
    for key, size, _, evictable in sorted(entries, key=lambda e: e[2]):
        if total <= budget:
            break
        if evictable:
            victims.append(key)
            total -= size
    return victims
