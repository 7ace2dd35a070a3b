"""Weighted fair share by priority: who gets the next scarce grant. Pure logic, no I/O.

Used for trainer slots (`master.scheduler`) and env-session turns (the master's rollout gate).
Stride scheduling: each tenant in line has a *pass*; a grant goes to the smallest pass (ties:
higher priority, then the caller's own order) and adds ``1 / weight(priority)`` to it, so a
tenant of weight 4 is granted four times as often as one of weight 1 while both wait, and a
tenant of the smallest weight still gets its share (docs/scaling.md, "Priority that routes").

A tenant enters at no less than the current clock (the pass of the last grant), so one that
was away does not come back with credit to monopolise the resource; one served a moment ago
keeps its debt when it comes back (its pass ahead of the clock), so leaving the line between
two jobs does not jump it ahead of a tenant that waited.
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
    # Tenants out of line whose pass is still ahead of the clock: they keep that debt when they
    # come back (a tenant served a moment ago does not re-enter level with one that waited).
    out: set[str] = field(default_factory=set)

    def enter(self, tenant: str) -> None:
        """``tenant`` has something waiting or held: in line, at no less than the clock."""
        if tenant in self.passes and tenant not in self.out:
            return
        self.passes[tenant] = max(self.passes.get(tenant, self.clock), self.clock)
        self.out.discard(tenant)

    def leave(self, tenant: str) -> None:
        """``tenant`` has nothing waiting or held. Its pass is kept while it is ahead of the
        clock (its debt), then forgotten: the table holds tenants in line and recent debtors."""
        if tenant in self.passes:
            self.out.add(tenant)
        self._forget_paid()

    def _forget_paid(self) -> None:
        for t in [t for t in self.out if self.passes.get(t, self.clock) <= self.clock]:
            self.passes.pop(t, None)
            self.out.discard(t)

    def pass_of(self, tenant: str) -> float:
        return self.passes.get(tenant, self.clock)

    def key(self, tenant: str, priority: int) -> tuple[float, int]:
        """The order of the next grant (smaller first): pass, then higher priority."""
        return (self.pass_of(tenant), -clamp_priority(priority))

    def charge(self, tenant: str, priority: int, cost: float = 1.0) -> None:
        """``tenant`` was granted one unit at ``priority``."""
        self.enter(tenant)
        now = self.pass_of(tenant)
        self.clock = max(self.clock, now)
        self.passes[tenant] = now + cost / weight(priority, self.policy)
        if len(self.out) > 64:
            self._forget_paid()


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


@dataclass
class GateLine:
    """The rollout gate's line (the master's ``rollout_begin``): who takes a free env-session
    turn when turns are short. A requester refused Busy is remembered as waiting (its priority,
    since when, last retry) for ``gate_waiter_ttl_s`` after its last retry; a free turn goes to
    the requester only if fewer waiters rank before it (fair-share pass, then priority, then
    the longest wait) than there are free turns, so a turn freed by a low-priority tenant is
    not taken by whoever retries first. Bounded: ``gate_max_waiters`` remembered at most."""

    policy: FairSharePolicy = FAIR_SHARE
    fair: FairShare = field(default_factory=FairShare)
    waiting: dict[str, tuple[str, int, float, float]] = field(default_factory=dict)  # key -> (tenant, prio, since, seen)

    def _rank_key(self, key: str, tenant: str, priority: int, since: float) -> tuple:
        return (*self.fair.key(tenant, priority), since, key)

    def ask(self, key: str, tenant: str, priority: int, free: int, now: float,
            blocked: frozenset[str] | set[str] = frozenset()) -> int:
        """``key`` (tenant/workload) asks for a turn with ``free`` turns free now; ``blocked``:
        tenants that could not take a turn anyway (at their own quota). Returns how many
        waiters rank before it; the turn is granted (and charged) when that is below ``free``."""
        self.waiting = {k: w for k, w in self.waiting.items() if now - w[3] <= self.policy.gate_waiter_ttl_s}
        self.fair.enter(tenant)
        since = self.waiting[key][2] if key in self.waiting else now
        mine = self._rank_key(key, tenant, priority, since)
        ahead = sum(1 for k, (t, p, s, _) in self.waiting.items()
                    if k != key and t not in blocked and self._rank_key(k, t, p, s) < mine)
        if free > 0 and ahead < free:
            self.waiting.pop(key, None)
            self.fair.charge(tenant, priority)
            return ahead
        if key in self.waiting or len(self.waiting) < self.policy.gate_max_waiters:
            self.waiting[key] = (tenant, priority, since, now)
        return ahead

    def settle(self, holding: set[str]) -> None:
        """Tenants neither holding a turn nor waiting leave the line (their debt kept a while)."""
        waiting = {t for t, *_ in self.waiting.values()}
        for t in [t for t in self.fair.passes if t not in holding and t not in waiting and t not in self.fair.out]:
            self.fair.leave(t)

    def waiting_by_tenant(self, now: float) -> dict[str, int]:
        """Rollouts waiting for a turn per tenant: those that asked within ``gate_waiter_ttl_s``."""
        out: dict[str, int] = {}
        for t, _, _, seen in self.waiting.values():
            if now - seen <= self.policy.gate_waiter_ttl_s:
                out[t] = out.get(t, 0) + 1
        return out
