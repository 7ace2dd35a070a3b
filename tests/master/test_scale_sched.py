"""The scheduler at scale, as pure logic: decisions scan unfinished jobs only, so finished
records (kept until compaction) cost nothing per lease; a removed record leaves no trace."""

from __future__ import annotations

from master.scheduler import Scheduler
from tests.master.test_scheduler import cfg, job, sched


def test_finished_jobs_leave_the_decision_set_and_picks_stay_right():
    tenants = [cfg(f"t{i:03d}") for i in range(50)]
    s = sched(*tenants)
    n = 0
    for t in tenants:  # 40 finished records per tenant, then one ready job each
        for _ in range(40):
            n += 1
            s.put(job(t.name, n, state="cleared"))
        n += 1
        s.put(job(t.name, n))
    assert len(s.jobs) == 50 * 41
    assert len(s.live_jobs()) == 50  # only the ready ones
    leased, _ = s.pick("tr", 8, 60, now=10_000)
    assert len(leased) == 8 and len({j.tenant for j in leased}) == 8
    for j in leased:  # trained and cleared in place, as the master does
        j.state, j.lease_owner = "cleared", ""
    assert len(s.live_jobs()) == 42
    assert s.tenant_jobs(leased[0].tenant) == []
    again, _ = s.pick("tr", 64, 60, now=10_001)
    assert len(again) == 42 and not {j.tenant for j in again} & {j.tenant for j in leased}


def test_a_scheduler_built_from_records_and_remove():
    s = Scheduler(jobs={("a", "j0001"): job("a", 1), ("a", "j0002"): job("a", 2, state="failed")})
    assert [j.job for j in s.live_jobs()] == ["j0001"]
    s.remove("a", "j0001")
    assert s.live_jobs() == [] and ("a", "j0001") not in s.jobs
    assert s.pick("tr", 4, 60, now=1) == ([], [])


def test_the_scale_bench_scheduler_part_runs_and_reports():
    from bench.scale import sched_decisions

    row = sched_decisions(Scheduler, n_tenants=8, finished_per_tenant=5, picks=10)
    assert row["tenants"] == 8 and row["job_records"] == 8 * 6 + 10 * 4
    # The decisions were timed: thread CPU time has ns resolution, and a pick over 88 records
    # costs tens of microseconds (a timer read in the wrong place would give 0).
    assert row["p50_ms"] > 0, row


def test_the_scale_bench_reports_throughput_per_tenant_unit(tmp_path):
    """`bench.scale.throughput` from two `info` replies of each role, and the report with it."""
    from bench.scale import throughput, write_report

    before = {"trainer": {"micro_batches": 10, "steps": 5, "usage": {"busy_s": {"train": 1.0}}},
              "inferencer": {"served": 4, "groups": 4, "usage": {"busy_s": {"infer": 0.5}}}}
    after = {"trainer": {"micro_batches": 50, "steps": 15, "usage": {"busy_s": {"train": 3.0}},
                         "slot_budget": {"evictions": 7}},
             "inferencer": {"served": 24, "groups": 8, "usage": {"busy_s": {"infer": 1.5}}}}
    tp = throughput(before, after, wall_s=8.0)
    assert tp["trainer"]["micro_batches_per_device_s"] == 20.0 and tp["trainer"]["micro_batches_per_wall_s"] == 5.0
    assert tp["trainer"]["tenants_per_step"] == 4.0 and tp["trainer"]["slot_budget"] == {"evictions": 7}
    assert tp["inferencer"]["predicts_per_device_s"] == 20.0 and tp["inferencer"]["rows_per_forward"] == 5.0
    snap = {"rss_bytes": {"trainer": 2**30}, "nats": {"mem_bytes": 0, "streams": 1, "consumers": 0, "subscriptions": 0}}
    row = {"tenants": 16, "active": 4, "workloads": {"completed": 4}, "register_ms": {}, "submit_to_running_ms": {},
           "predict_ms": {}, "master_scale": {}, "idle": snap, "active_peak": snap, "budgets_mb": {"slot": 32.0},
           "throughput": tp}
    write_report({"deployments": [row]}, tmp_path / "scale.json")
    assert (tmp_path / "scale.png").stat().st_size > 0
