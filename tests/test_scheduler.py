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
