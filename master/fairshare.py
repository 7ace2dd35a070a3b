"""Weighted fair share by priority: who gets the next scarce grant. Pure logic, no I/O.

Used for trainer slots (`master.scheduler`) and env-session turns (the master's rollout gate).
Stride scheduling: each tenant in line has a *pass*; a grant goes to the smallest pass (ties:
higher priority, then the caller's own order) and adds ``1 / weight(priority)`` to it, so a
tenant of weight 4 is granted four times as often as one of weight 1 while both wait, and a
tenant of the smallest weight still gets its share (docs/scaling.md, "Priority that routes").

A tenant enters at the current clock (the pass of the last grant), so one that was away does
not come back with credit to monopolise the resource, and leaves when it has nothing waiting or
held: the table holds only tenants in line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.policy import FAIR_SHARE, PRIORITY_MAX, PRIORITY_MIN, FairSharePolicy


def clamp_priority(priority: int, ceiling: int | None = None) -> int:
    """The priority that routes: within PRIORITY_MIN..PRIORITY_MAX and the operator's ceiling
    (the tenant's ``max_priority`` quota), even if the ceiling was lowered after the job was made."""
    top = PRIORITY_MAX if ceiling is None else min(PRIORITY_MAX, ceiling)
    return max(PRIORITY_MIN, min(int(priority), top))


def weight(priority: int, policy: FairSharePolicy = FAIR_SHARE) -> float:
    return policy.base ** (clamp_priority(priority) / policy.step)


def floor_share(priority: int, others: list[int], policy: FairSharePolicy = FAIR_SHARE) -> float:
    """The least fraction of grants a backlogged tenant at ``priority`` receives against
    backlogged tenants at ``others``."""
    mine = weight(priority, policy)
    return mine / (mine + sum(weight(p, policy) for p in others))


@dataclass
class FairShare:
    policy: FairSharePolicy = FAIR_SHARE
    passes: dict[str, float] = field(default_factory=dict)
    clock: float = 0.0

    def enter(self, tenant: str) -> None:
        self.passes.setdefault(tenant, self.clock)

    def leave(self, tenant: str) -> None:
        self.passes.pop(tenant, None)

    def pass_of(self, tenant: str) -> float:
        return self.passes.get(tenant, self.clock)

    def key(self, tenant: str, priority: int) -> tuple[float, int]:
        """The order of the next grant (smaller first): pass, then higher priority."""
        return (self.pass_of(tenant), -clamp_priority(priority))

    def charge(self, tenant: str, priority: int, cost: float = 1.0) -> None:
        """``tenant`` was granted one unit at ``priority``."""
        now = self.pass_of(tenant)
        self.clock = max(self.clock, now)
        self.passes[tenant] = now + cost / weight(priority, self.policy)


def order(fair: FairShare, waiting: list[tuple[str, int]]) -> list[str]:
    """The tenants in ``waiting`` ((tenant, priority), one each) in grant order, if each took one
    grant in turn: what a test reads the policy through."""
    return [t for t, _ in sorted(waiting, key=lambda tp: (*fair.key(*tp), tp[0]))]


def simulate(fair: FairShare, waiting: dict[str, int], grants: int) -> list[str]:
    """``grants`` grants among always-backlogged tenants ``waiting`` (tenant -> priority)."""
    out = []
    for t in waiting:
        fair.enter(t)
    for _ in range(grants):
        t = order(fair, list(waiting.items()))[0]
        fair.charge(t, waiting[t])
        out.append(t)
    return out
