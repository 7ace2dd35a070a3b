"""64 tenant slots on one trainer (tiny preset), per-slot memory, and the staleness drop."""

from __future__ import annotations

import asyncio

from protocol import ops
from protocol.messages import InfoRequest
from sdk.client import AsyncClient
from tests.support.tq_helpers import CALVIN_SCHEMA, micro_batch, tenant

N_TENANTS = 64


def test_64_tenant_slots_on_one_trainer(roles):
    roles.start("master")
    trainer = roles.start("trainer", NEXUS_TRAINER_GROUP_MAX="8")
    cfgs = [tenant(f"m{i:02d}", schema=CALVIN_SCHEMA if i % 2 else tenant("x").schema,
                   head=("mlp", "flow", "gaussian")[i % 3], seed=i) for i in range(N_TENANTS)]

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            jobs = []
            for cfg in cfgs:
                await c.create_tenant(cfg)
                job = await c.reserve(cfg.name, "sft")
                await c.queue_put(micro_batch(cfg, job.job, 0, b=1, seed=1))
                await c.mark_ready(cfg.name, job.job)
                jobs.append((cfg.name, job.job))
            recs = [await c.wait_job(t, j, timeout_s=300) for t, j in jobs]
            info = await c.bus.call(ops.INFO.of("trainer"), InfoRequest(), instance=trainer.instance, timeout_s=10)
            return recs, info
        finally:
            await c.close()

    recs, info = asyncio.run(go())
    assert [r.state for r in recs] == ["cleared"] * N_TENANTS, [(r.tenant, r.state, r.reason) for r in recs if r.state != "cleared"]
    slots = info.extra["slots"]
    assert len(slots) == N_TENANTS
    for name, report in slots.items():
        assert report["total_bytes"] > 0 and report["params_bytes"] > 0 and report["optimizer_bytes"] > 0, name
        assert report["version"] == 1 and report["device"] == "cpu"


def test_stale_rl_job_is_dropped_counted_and_never_trained(roles):
    roles.start("master")
    roles.start("trainer")
    cfg = tenant("stale", head="gaussian", staleness_bound=1, max_inflight_jobs=4)

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(cfg)
            fresh = await c.reserve(cfg.name, "rl")
            for seq in range(2):
                await c.queue_put(micro_batch(cfg, fresh.job, seq, rl_version=0))
            await c.mark_ready(cfg.name, fresh.job)
            done = await c.wait_job(cfg.name, fresh.job, timeout_s=120)  # version is now 2
            old = await c.reserve(cfg.name, "rl")
            await c.queue_put(micro_batch(cfg, old.job, 0, rl_version=0))  # 2 versions behind, bound 1
            await c.mark_ready(cfg.name, old.job)
            dropped = await c.wait_job(cfg.name, old.job, timeout_s=60)
            info = await c.info("master")
            weights = await c.latest_weights(cfg.name)
            return done, dropped, info, weights
        finally:
            await c.close()

    done, dropped, info, weights = asyncio.run(go())
    assert done.state == "cleared" and done.trained_version == 2
    assert dropped.state == "dropped_stale" and "behind" in dropped.reason
    assert info.extra["dropped_stale"] == {"stale": 1}
    assert weights.version == 2  # the stale job changed nothing
