"""The scheduler's policy, as pure logic: FIFO, priority, fairness, caps, staleness, leases."""

from __future__ import annotations

import pytest

from master.scheduler import MAX_ATTEMPTS, Scheduler
from protocol.errors import Busy
from protocol.messages import JobRecord, TenantConfig


def cfg(name: str, **kw) -> TenantConfig:
    return TenantConfig(name=name, base="tiny-qwen3-vl", schema={}, **kw)


def job(tenant: str, n: int, task: str = "sft", state: str = "ready", items: int = 1, behaviour: int = -1,
        priority: int = 0) -> JobRecord:
    return JobRecord(tenant=tenant, job=f"j{n:04d}", task=task, state=state, created_at=n, updated_at=n,
                     ready_at=float(n), items=items, behaviour_version=behaviour, priority=priority)


def sched(*tenants: TenantConfig) -> Scheduler:
    s = Scheduler()
    for t in tenants:
        s.tenants[t.name] = t
    return s


def finish(s: Scheduler, leased: list[JobRecord]) -> None:
    for j in leased:
        j.state, j.lease_owner = "cleared", ""


def test_fifo_within_a_tenant_and_one_job_per_tenant_at_a_time():
    s = sched(cfg("a"))
    for n in (3, 1, 2):
        s.put(job("a", n))
    order = []
    for _ in range(3):
        leased, _ = s.pick("t1", 4, 60, now=100)
        assert len(leased) == 1  # the next job of the tenant waits for this one
        assert s.pick("t2", 4, 60, now=100) == ([], [])
        order.append(leased[0].job)
        finish(s, leased)
    assert order == ["j0001", "j0002", "j0003"]


def test_sixteen_tenants_no_starvation_round_robin():
    tenants = [cfg(f"t{i:02d}") for i in range(16)]
    s = sched(*tenants)
    n = 0
    for rnd in range(5):  # every tenant always has work: a greedy scheduler would starve some
        for t in tenants:
            n += 1
            s.put(job(t.name, n))
    served: dict[str, int] = {t.name: 0 for t in tenants}
    first_round: list[str] = []
    for step in range(40):  # 40 leases of 2 jobs = 80 jobs = 5 per tenant
        leased, _ = s.pick("trainer", 2, 60, now=1000 + step)
        for j in leased:
            served[j.tenant] += 1
            if len(first_round) < 16:
                first_round.append(j.tenant)
        finish(s, leased)
    assert sorted(first_round) == sorted(t.name for t in tenants)  # everyone once before anyone twice
    assert set(served.values()) == {5}


def test_priority_first_then_fairness():
    s = sched(cfg("low"), cfg("high"))
    s.put(job("low", 1))
    s.put(job("high", 2, priority=5))
    leased, _ = s.pick("t", 1, 60, now=10)
    assert leased[0].tenant == "high"


def test_scarce_trainer_slots_go_by_priority_and_the_low_tenant_still_progresses():
    """One trainer slot, both tenants always backlogged: the priority-10 tenant gets four
    leases for every one of the priority-0 tenant (weights 4 and 1), and goes first; the
    priority-0 one is never starved (its floor share, 1 in 5)."""
    s = sched(cfg("low"), cfg("high"))
    n = 0
    for _ in range(60):
        for t, p in (("low", 0), ("high", 10)):
            n += 1
            s.put(job(t, n, priority=p))
    got = []
    for step in range(50):
        (leased,), _ = s.pick("t", 1, 60, now=100 + step)
        got.append(leased.tenant)
        finish(s, [leased])
        s.touch(leased)
    assert got[0] == "high"
    assert got.count("high") == 40 and got.count("low") == 10
    assert max(len(run) for run in "".join("h" if t == "high" else "l" for t in got).split("l")) <= 4


def test_the_operator_s_ceiling_bounds_the_priority_that_routes():
    """A job made at priority 10 when the tenant's ceiling was 10 routes at its current
    ceiling (the operator lowered it to 0): no edge over a priority-0 tenant."""
    from protocol.messages import TenantQuotas

    s = sched(cfg("capped", quotas=TenantQuotas(max_priority=0)), cfg("plain"))
    n = 0
    for _ in range(20):
        for t, p in (("capped", 10), ("plain", 0)):
            n += 1
            s.put(job(t, n, priority=p))
    got = []
    for step in range(20):
        (leased,), _ = s.pick("t", 1, 60, now=100 + step)
        got.append(leased.tenant)
        finish(s, [leased])
        s.touch(leased)
    assert got.count("capped") == 10


def test_inflight_cap_per_tenant_task():
    t = cfg("a", max_inflight_jobs=2)
    s = sched(t)
    s.put(job("a", 1, state="reserved"))
    s.put(job("a", 2, state="leased"))
    with pytest.raises(Busy, match="2 sft jobs in flight, the cap is 2") as e:
        s.check_reserve(t, "sft")
    assert e.value.details["retry_after_s"] > 0
    s.check_reserve(t, "rl")  # another task of the same tenant has its own cap


def test_sft_prefetch_cap_keeps_room_for_rl():
    t = cfg("a", max_inflight_jobs=10, sft_prefetch_items=16)
    s = sched(t)
    s.put(job("a", 1, state="ready", items=10))
    s.put(job("a", 2, state="filling", items=6))
    s.check_reserve(t, "sft")  # a job being filled does not count: only ready / leased ones
    s.put(job("a", 3, state="leased", items=6))
    with pytest.raises(Busy, match="16 SFT micro-batches queued, the prefetch cap is 16"):
        s.check_reserve(t, "sft")
    with pytest.raises(Busy):
        s.check_sft_prefetch(t, adding=1)
    s.check_reserve(t, "rl")


def test_stale_rl_jobs_are_dropped_and_counted_never_leased():
    t = cfg("a", staleness_bound=128)
    s = sched(t)
    s.observe_version("a", 300)
    s.put(job("a", 1, task="rl", behaviour=100))  # 200 behind: stale
    s.put(job("a", 2, task="rl", behaviour=171))  # 129 behind: stale
    s.put(job("a", 3, task="rl", behaviour=172))  # 128 behind: at the bound, fresh
    leased, stale = s.pick("t", 4, 60, now=10)
    assert [j.job for j in stale] == ["j0001", "j0002"]
    assert all(j.state == "dropped_stale" and "behind" in j.reason for j in stale)
    assert [j.job for j in leased] == ["j0003"]
    assert s.dropped_stale["a"] == 2


def test_expired_leases_return_then_fail_after_max_attempts():
    s = sched(cfg("a"))
    s.put(job("a", 1))
    for attempt in range(1, MAX_ATTEMPTS + 1):
        (leased,), _ = s.pick("t", 1, lease_s=5, now=100 * attempt)
        assert leased.attempts == attempt
        expired = s.expire_leases(now=100 * attempt + 6)
        assert expired == [leased]
    assert leased.state == "failed" and "gave up" in leased.reason


def test_post_commit_work_of_a_dead_trainer_is_handed_out_first():
    s = sched(cfg("a"), cfg("b"))
    half = job("a", 1, state="exported")
    s.put(half)
    s.put(job("b", 2))
    leased, _ = s.pick("t", 1, 60, now=10)
    assert leased == [half] and half.lease_owner == "t"


def _reference_pick(s: Scheduler, max_jobs: int) -> list[str]:
    """The lease order written the plain way (a scan and a sort of every unfinished job), as
    the scheduler computed it before its heap: what `pick` must still choose."""
    from master.scheduler import FINISHED, POST_COMMIT

    live = [j for j in s.jobs.values() if j.state not in FINISHED]
    busy = {j.tenant for j in live if j.lease_owner}
    out: list[JobRecord] = []
    for j in sorted((j for j in live if j.state in POST_COMMIT and not j.lease_owner), key=lambda j: j.updated_at):
        if len(out) < max_jobs and j.tenant not in busy:
            out.append(j)
            busy.add(j.tenant)
    heads: dict[str, JobRecord] = {}
    for j in live:
        if j.state == "ready" and j.auto and j.tenant not in busy:
            if j.tenant not in heads or (j.ready_at, j.job) < (heads[j.tenant].ready_at, heads[j.tenant].job):
                heads[j.tenant] = j
    order = sorted(heads.values(), key=lambda j: (s.fair.pass_of(j.tenant), -s.priority(j), s._served.get(j.tenant, 0),
                                                  j.ready_at, j.job))
    out += order[: max(0, max_jobs - len(out))]
    return [j.job for j in out]


def test_the_heap_leases_what_a_full_scan_and_sort_would():
    """Random traffic (new jobs, some with priority, leases of 1-4, jobs finished, released or
    left half-finished by a trainer, each saved as the master does): every decision equals the
    plain scan-and-sort order."""
    import random

    rng = random.Random(7)
    tenants = [cfg(f"t{i:02d}") for i in range(12)]
    s = sched(*tenants)
    held: list[JobRecord] = []
    n = 0
    for step in range(400):
        for _ in range(rng.randint(0, 3)):
            n += 1
            s.put(job(rng.choice(tenants).name, n, priority=rng.choice((0, 0, 0, 1, 10, -10))))
        if held and rng.random() < 0.6:
            j = held.pop(rng.randrange(len(held)))
            how = rng.random()
            if how < 0.6:
                j.state, j.lease_owner = "cleared", ""
            elif how < 0.8:
                s.release(j, float(step), reason="test")
            else:
                j.state, j.lease_owner = "trained", ""  # its trainer died after the commit
            s.touch(j)
        k = rng.randint(1, 4)
        want = _reference_pick(s, k)
        leased, _ = s.pick("trainer", k, 60, now=float(step))
        assert [j.job for j in leased] == want, step
        held += leased


def test_a_decision_recomputes_only_what_changed(monkeypatch):
    import master.scheduler

    monkeypatch.setattr(master.scheduler, "REBUILD_S", 3600.0)  # no periodic rebuild in between
    tenants = [cfg(f"t{i:04d}") for i in range(1000)]
    s = sched(*tenants)
    for i, t in enumerate(tenants):
        s.put(job(t.name, i + 1))
    leased, _ = s.pick("trainer", 4, 60, now=10.0)  # the first decision builds the heap
    assert len(leased) == 4
    before = s.refreshes
    finish(s, leased[:2])
    leased2, _ = s.pick("trainer", 4, 60, now=11.0)
    # The 4 tenants leased last time (2 still busy, 2 finished): not the 1,000 ready ones.
    assert len(leased2) == 4 and s.refreshes - before <= 4, s.refreshes - before
    assert {j.tenant for j in leased2}.isdisjoint({j.tenant for j in leased})
