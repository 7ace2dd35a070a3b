"""Metered device time and tenant quotas, on one real deployment (master, inferencer, trainer).

Three tenants share grouped forwards (concurrent predicts) and grouped training steps; the sum
of their charges must equal the role's own measured busy time, and each tenant's share must
follow its rows. Then the quotas: in-flight jobs, active rollouts, the predict rate, and the
priority bound, each refused with an error naming the quota and its value.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from actors.metering import Meter, split_by_rows
from protocol import ops
from protocol.errors import Busy, InvalidField, QuotaExceeded
from protocol.messages import (
    ErrorReply,
    JobRef,
    Ok,
    PredictReply,
    PredictRequest,
    TenantQuotas,
    UsageCounters,
    UsageEntry,
    UsageReport,
)
from protocol.wire import decode, encode
from sdk.client import AsyncClient
from tests.conftest import RoleProcs, module_roles, nexus_cmd, python_env, run_client
from tests.support.tq_helpers import BASE, CALVIN_SCHEMA, micro_batch, role_info, tenant

FLUSH_ENV = {"NEXUS_USAGE_FLUSH_EVERY_S": "0.2"}
ROWS = {"a": 1, "b": 2, "c": 3}  # rows per tenant in every shared forward / step
TRAIN_TENANTS = {k: tenant(f"ut{k}", seed=i) for i, k in enumerate(ROWS)}


def spawn(procs: RoleProcs, role: str, **env: str):
    """`RoleProcs.start` without the wait: roles boot side by side (the wait comes later)."""
    procs._n += 1
    instance = f"{role}-{procs._n}"
    log = open(procs.data_dir / f"{instance}.log", "ab")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "actors.run", role, "--nats-url", procs.nats_url,
         "--prefix", procs.prefix, "--data-dir", str(procs.data_dir), "--instance", instance],
        env=python_env(NEXUS_HEARTBEAT_INTERVAL_S="0.3", NEXUS_HEALTH_TIMEOUT_S="1.2", **env),
        stdout=log, stderr=subprocess.STDOUT)
    proc.instance = instance
    procs.procs.append((role, instance, proc))
    return proc


async def prepare_training(c: AsyncClient) -> dict[str, str]:
    """Three tenants' SFT jobs, 3 micro-batches each of 1, 2 and 3 rows, all ready."""
    jobs = {}
    for k, cfg in TRAIN_TENANTS.items():
        await c.create_tenant(cfg)
        job = await c.reserve(cfg.name, "sft")
        for seq in range(3):
            await c.queue_put(micro_batch(cfg, job.job, seq, b=ROWS[k], seed=seq))
        jobs[cfg.name] = job.job
    for name, job in jobs.items():
        await c.mark_ready(name, job)
    return jobs


@pytest.fixture(scope="module")
def deploy(nats_server, tmp_path_factory):
    with module_roles(nats_server, tmp_path_factory, "usage") as procs:
        master = spawn(procs, "master", **FLUSH_ENV)
        # A long wait window: one wave of concurrent predicts certainly meets in one group.
        procs.infer = spawn(procs, "inferencer", NEXUS_INFER_BASE=BASE, NEXUS_INFER_BATCH_WAIT_TIMEOUT_S="0.3",
                            NEXUS_INFER_MAX_BATCH_SIZE="64", **FLUSH_ENV)
        procs.wait_ready("master", master.instance, master)
        procs.train_jobs = run_client(procs, prepare_training)
        # The trainer boots with all three jobs ready: its first lease takes them into one
        # round, so every step is one grouped step of the three tenants. It boots while the
        # inference test runs: on a loaded host preparing a fresh trainer's first three slots
        # can outlast the default cohort wait, and a job that joins after the first step
        # changes the shares; the long wait keeps the cohort whole.
        procs.trainer = spawn(procs, "trainer", NEXUS_TRAINER_GROUP_MAX="4", NEXUS_TRAINER_COHORT_WAIT_S="120",
                              **FLUSH_ENV)
        procs.wait_ready("inferencer", procs.infer.instance, procs.infer)
        yield procs


async def flushed(c: AsyncClient, role: str, instance: str, timeout_s: float = 20) -> dict:
    """The role's meter once everything it measured was acknowledged by the master."""
    deadline = time.monotonic() + timeout_s
    while True:
        u = (await role_info(c, role, instance)).extra["usage"]
        if u["unsent_entries"] == 0 and u["pending_seq"] == 0:
            return u
        assert time.monotonic() < deadline, u
        await asyncio.sleep(0.1)


async def totals(c: AsyncClient, tenants: list[str]) -> dict[str, UsageCounters]:
    out = {t: UsageCounters() for t in tenants}
    for r in (await c.usage()).records:
        if r.tenant in out:
            out[r.tenant].add(r.usage)
    return out


def obs(schema: dict, seed: int) -> tuple[dict, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = {c["name"]: rng.integers(0, 256, (c["height"], c["width"], 3), dtype=np.uint8) for c in schema["cameras"]}
    return images, rng.standard_normal(schema["state_dim"]).astype(np.float32)


# -- the attribution rule, in-process ---------------------------------------------------------
def test_split_by_rows_adds_up_exactly_and_follows_rows():
    shares = split_by_rows(0.1, [1, 2, 3])
    assert sum(shares) == 0.1 and shares == pytest.approx([0.1 / 6, 0.2 / 6, 0.3 / 6])
    with pytest.raises(ValueError):
        split_by_rows(1.0, [0, 0])
    # A fitted fixed cost per tenant (row-equivalents): rows 1 and 3 with 1 each weigh 2 : 4.
    assert split_by_rows(0.6, [1, 3], overhead_rows=1.0) == pytest.approx([0.2, 0.4])
    m = Meter()
    m.charge("train", 0.3, {("x", "w"): 1, ("y", ""): 2})
    first = m.take_report("trainer", "t-1")
    m.charge("train", 0.6, {("x", "w"): 3})
    assert m.take_report("trainer", "t-1") is first  # unacknowledged: resent unchanged
    m.acked(first)
    second = m.take_report("trainer", "t-1")
    assert second.seq == first.seq + 1 and second.entries[0].usage.train_device_s == pytest.approx(0.6)
    m.acked(second)
    assert m.info()["reported_s"] == pytest.approx(0.9) == m.info()["busy_s"]["train"]


# -- inference: three tenants' concurrent predicts in shared forwards --------------------------
def test_inference_charges_add_up_to_busy_time_and_follow_rows(deploy):
    cfgs = {k: tenant(f"ui{k}", schema=CALVIN_SCHEMA if k == "b" else tenant("x").schema,
                      head="gaussian" if k == "c" else "mlp", seed=i) for i, k in enumerate(ROWS)}
    names = [cfg.name for cfg in cfgs.values()]
    inst = deploy.infer.instance

    async def wave(c: AsyncClient, w: int) -> list[PredictReply]:
        calls = []
        for k, cfg in cfgs.items():
            for j in range(ROWS[k]):
                images, state = obs(cfg.schema, 100 * w + j)
                # Tenant c names its workload; a and b leave it to the master (none active: "_").
                calls.append(c.predict(cfg.name, images, state, "pick", workload="wmeter" if k == "c" else ""))
        return await asyncio.gather(*calls)

    async def go(c: AsyncClient):
        for cfg in cfgs.values():
            await c.create_tenant(cfg)
        await wave(c, 0)  # warm-up: loads every tenant's slot
        before_role = await flushed(c, "inferencer", inst)
        before = await totals(c, names)
        replies = [await wave(c, w) for w in range(1, 6)]
        after_role = await flushed(c, "inferencer", inst)
        after = await totals(c, names)
        records = (await c.usage(tenant=cfgs["c"].name)).records
        return replies, before_role, after_role, before, after, records

    replies, r0, r1, before, after, records = run_client(deploy, go)
    assert all(r.batch_size == sum(ROWS.values()) for w in replies for r in w), "a wave split over groups"
    busy = r1["busy_s"]["infer"] - r0["busy_s"]["infer"]
    charged = {t: after[t].infer_device_s - before[t].infer_device_s for t in names}
    print(f"inference: measured busy {busy:.4f} s, charged {sum(charged.values()):.4f} s, "
          f"shares {[round(charged[t] / busy, 4) for t in names]}")
    assert busy > 0
    assert sum(charged.values()) == pytest.approx(busy, rel=0.05)
    for k, t in zip(ROWS, names):
        assert after[t].requests - before[t].requests == 5 * ROWS[k]
        assert after[t].infer_rows - before[t].infer_rows == 5 * ROWS[k]
        assert charged[t] / busy == pytest.approx(ROWS[k] / sum(ROWS.values()), rel=0.05)
    assert [r.workload for r in records] == ["wmeter"]  # the named workload, not "_"


# -- training: three tenants' jobs in grouped steps ---------------------------------------------
def test_training_charges_add_up_to_busy_time_and_follow_rows(deploy):
    names = [cfg.name for cfg in TRAIN_TENANTS.values()]
    jobs, trainer = deploy.train_jobs, deploy.trainer
    deploy.wait_ready("trainer", trainer.instance, trainer)

    async def go(c: AsyncClient):
        recs = [await c.wait_job(t, j, timeout_s=120) for t, j in jobs.items()]
        role = await flushed(c, "trainer", trainer.instance)
        steps = (await role_info(c, "trainer", trainer.instance)).extra["steps"]
        return recs, role, await totals(c, names), steps

    recs, role, usage, steps = run_client(deploy, go)
    assert [r.state for r in recs] == ["cleared"] * 3, [(r.state, r.reason) for r in recs]
    assert steps == 3, steps  # every step held all three jobs (one cohort): the shares below follow rows
    busy = role["busy_s"]["train"]
    print(f"training: measured busy {busy:.4f} s, charged {sum(u.train_device_s for u in usage.values()):.4f} s, "
          f"shares {[round(usage[t].train_device_s / busy, 4) for t in names]}")
    assert busy > 0
    assert sum(u.train_device_s for u in usage.values()) == pytest.approx(busy, rel=0.05)
    for k, t in zip(ROWS, names):
        u = usage[t]
        assert (u.train_steps, u.train_rows) == (3, 3 * ROWS[k])
        assert u.train_device_s / busy == pytest.approx(ROWS[k] / sum(ROWS.values()), rel=0.05)
        assert u.stored_bytes > 0  # its export

    # The CLI reads the same figures.
    out = subprocess.run(nexus_cmd("usage", "--tenant", names[2], "--json", "--nats-url", deploy.nats_url,
                                   "--prefix", deploy.prefix), capture_output=True, text=True, env=python_env(),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["tenant"] for r in rows] == [names[2]] and rows[0]["train_rows"] == 9
    assert rows[0]["train_device_s"] == pytest.approx(usage[names[2]].train_device_s)
    assert rows[0]["stored_now"] > 0  # its checkpoint and export in the object store


def test_a_resent_usage_report_is_counted_once(deploy):
    report = UsageReport(role="trainer", instance="fake-1", seq=1, entries=[
        UsageEntry(tenant="urep", workload="w1", usage=UsageCounters(train_device_s=1.5, train_rows=4))])

    async def go(c: AsyncClient):
        for _ in range(2):  # a retry after a lost reply
            await c.bus.call(ops.MASTER_USAGE_REPORT, report, timeout_s=10)
        once = (await c.usage(tenant="urep")).records
        # The same instance id in a new process (its own boot id) numbers from 1 again: counted.
        report.boot = "b2"
        await c.bus.call(ops.MASTER_USAGE_REPORT, report, timeout_s=10)
        return once, (await c.usage(tenant="urep")).records

    (rec,), (again,) = run_client(deploy, go)
    assert (rec.workload, rec.usage.train_device_s, rec.usage.train_rows) == ("w1", 1.5, 4)
    assert (again.usage.train_device_s, again.usage.train_rows) == (3.0, 8)


# -- quotas --------------------------------------------------------------------------------------
def test_inflight_jobs_quota_names_the_quota_and_clears(deploy):
    cfg = tenant("uq-jobs")

    async def go(c: AsyncClient):
        await c.create_tenant(cfg)
        await c.set_quotas(cfg.name, TenantQuotas(max_inflight_jobs=2))
        a = await c.reserve(cfg.name, "sft")
        await c.reserve(cfg.name, "rl")  # another task: its own per-task cap, the same quota
        with pytest.raises(QuotaExceeded) as err:
            await c.reserve(cfg.name, "sft")
        await c.queue_clear(cfg.name, a.job)  # one job less in flight: room again
        await c.reserve(cfg.name, "sft")
        return err.value

    exc = run_client(deploy, go)
    assert isinstance(exc, Busy)  # workflows wait it out as back-pressure, not a failure
    assert (exc.quota, exc.limit) == ("max_inflight_jobs", 2) and "max_inflight_jobs=2" in str(exc)
    assert exc.details["retry_after_s"] > 0


def test_rollout_quota_and_priority_bound(deploy):
    cfg = tenant("uq-roll")

    async def go(c: AsyncClient):
        await c.create_tenant(cfg)
        begin = ops.MASTER_ROLLOUT_BEGIN.subject(c.names)
        await c.bus.request(begin, JobRef(tenant=cfg.name, job="w1"), Ok, timeout_s=10)
        with pytest.raises(QuotaExceeded) as roll:
            await c.bus.request(begin, JobRef(tenant=cfg.name, job="w2"), Ok, timeout_s=10)
        await c.set_quotas(cfg.name, TenantQuotas(max_active_rollouts=2, max_priority=3))
        await c.bus.request(begin, JobRef(tenant=cfg.name, job="w2"), Ok, timeout_s=10)
        for name in ("w1", "w2"):
            await c.bus.call(ops.MASTER_ROLLOUT_END, JobRef(tenant=cfg.name, job=name), timeout_s=10)
        with pytest.raises(InvalidField) as prio:
            await c.reserve(cfg.name, "sft", priority=5)
        job = await c.reserve(cfg.name, "sft", priority=3)
        with pytest.raises(InvalidField) as create:
            await c.create_tenant(tenant("uq-prio", priority=11))
        return roll.value, prio.value, job, create.value

    roll, prio, job, create = run_client(deploy, go)
    assert (roll.quota, roll.limit) == ("max_active_rollouts", 1)
    assert prio.field == "priority" and "max_priority=3" in str(prio)
    assert job.priority == 3
    assert create.field == "config.priority" and "-10..10" in str(create)



def test_a_freed_rollout_turn_goes_to_the_higher_priority_waiter(deploy):
    """The deployment's 3 turns are held; a priority-0 and a priority-10 tenant wait. A turn
    frees and the low one retries first: it hears Busy (one waiter ranks before it) and the
    high one takes the turn (docs/scaling.md, "Priority that routes")."""
    holders = [tenant(f"ug-hold{i}") for i in range(3)]
    lo, hi = tenant("ug-lo", priority=0), tenant("ug-hi", priority=10)

    async def go(c: AsyncClient):
        begin, end = ops.MASTER_ROLLOUT_BEGIN.subject(c.names), ops.MASTER_ROLLOUT_END.subject(c.names)
        for cfg in (*holders, lo, hi):
            await c.create_tenant(cfg)
        for cfg in holders:
            await c.bus.request(begin, JobRef(tenant=cfg.name, job="w"), Ok, timeout_s=10)
        for cfg in (lo, hi):  # both wait: the gate is full
            with pytest.raises(Busy):
                await c.bus.request(begin, JobRef(tenant=cfg.name, job="w"), Ok, timeout_s=10)
        await c.bus.request(end, JobRef(tenant=holders[0].name, job="w"), Ok, timeout_s=10)
        with pytest.raises(Busy) as low:
            await c.bus.request(begin, JobRef(tenant=lo.name, job="w"), Ok, timeout_s=10)
        granted = await c.bus.request(begin, JobRef(tenant=hi.name, job="w"), Ok, timeout_s=10)
        for cfg in (*holders[1:], hi):
            await c.bus.request(end, JobRef(tenant=cfg.name, job="w"), Ok, timeout_s=10)
        after = await c.bus.request(begin, JobRef(tenant=lo.name, job="w"), Ok, timeout_s=10)  # its turn now
        await c.bus.request(end, JobRef(tenant=lo.name, job="w"), Ok, timeout_s=10)
        return low.value, granted, after

    low, granted, after = run_client(deploy, go)
    assert low.details["waiting_ahead"] == 1 and "fair share by priority" in str(low)
    assert granted.detail == "granted" and after.detail == "granted"

def test_predict_rate_quota(deploy):
    cfg = tenant("uq-rate", quotas=TenantQuotas(predict_rate_per_s=1.0, predict_burst=2))

    async def go(c: AsyncClient):
        await c.create_tenant(cfg)
        images, state = obs(cfg.schema, 0)
        subject = c.names.infer((await c.info("inferencer")).extra["pool"])
        out = []
        for i in range(3):  # raw requests: no SDK retry in between
            raw = await c.bus.nc.request(subject, encode(PredictRequest(
                tenant=cfg.name, images=images, state=state, instruction="pick", request_id=f"r{i}")), timeout=30)
            out.append(decode(raw.data))
        # The SDK waits a rate refusal out (Busy): a fourth call succeeds, a moment later.
        t0 = time.monotonic()
        reply = await c.predict(cfg.name, images, state, "pick")
        waited_s = time.monotonic() - t0
        # A raised quota reaches the inferencer (tenants.updated): a burst of 5 goes through.
        await c.set_quotas(cfg.name, TenantQuotas(predict_rate_per_s=1000.0, predict_burst=50))
        deadline = time.monotonic() + 10
        while True:
            burst = [decode((await c.bus.nc.request(subject, encode(PredictRequest(
                tenant=cfg.name, images=images, state=state, instruction="pick")), timeout=30)).data)
                for _ in range(5)]
            if all(isinstance(r, PredictReply) for r in burst) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        return out, reply, waited_s, burst

    (first, second, third), reply, waited_s, burst = run_client(deploy, go)
    assert all(isinstance(r, PredictReply) for r in burst), burst
    assert isinstance(first, PredictReply) and isinstance(second, PredictReply)  # the burst
    assert isinstance(third, ErrorReply) and third.code == "quota_exceeded"
    assert third.details["quota"] == "predict_rate_per_s" and third.details["limit"] == 1.0
    assert "predict_rate_per_s=1" in third.message and third.details["retry_after_s"] > 0
    assert isinstance(reply, PredictReply) and waited_s > 0.1
