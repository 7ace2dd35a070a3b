"""Exactly-once effect: SIGKILL the trainer at each lifecycle point; every job is trained once.

For each fault point a trainer is killed inside its first job; a fresh trainer takes over
(the master releases the dead trainer's leases on the health manager's role_down event). In
the end every job is cleared, versions are 1..N in job order, and the tenant's weights are
bit-identical to an in-process run of the same micro-batches applied once each, in order: a
lost step or a step applied twice would change them.
"""

from __future__ import annotations

import asyncio

import pytest

from actors.trainer.trainer import FAULT_ENV, FAULT_POINTS
from sdk.client import AsyncClient
from tests.support.tq_helpers import Reference, micro_batch, tenant, tensors_equal

N_JOBS = 3


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_trainer_killed_at_each_lifecycle_point(roles, point):
    roles.start("health")
    roles.start("master")
    doomed = roles.start("trainer", **{FAULT_ENV: point})
    cfg = tenant("once", seed=3, max_inflight_jobs=8)

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            await c.create_tenant(cfg)
            items, jobs = [], []
            for j in range(N_JOBS):
                job = await c.reserve(cfg.name, "sft")
                item = micro_batch(cfg, job.job, 0, seed=j)
                await c.queue_put(item)
                await c.mark_ready(cfg.name, job.job)
                items.append(item)
                jobs.append(job)
            await asyncio.get_running_loop().run_in_executor(None, doomed.wait, 120)
            assert doomed.returncode == -9, f"trainer was not killed at {point}"
            # The replacement, no fault (started from a thread: start() runs its own loop).
            await asyncio.get_running_loop().run_in_executor(None, roles.start, "trainer")
            recs = [await c.wait_job(cfg.name, job.job, timeout_s=120) for job in jobs]
            ref = await c.latest_weights(cfg.name)
            payload, manifest = await c.download_weights(ref)
            return items, recs, ref, payload
        finally:
            await c.close()

    items, recs, ref, payload = asyncio.run(go())
    assert [r.state for r in recs] == ["cleared"] * N_JOBS, [(r.state, r.reason) for r in recs]
    assert [r.trained_version for r in recs] == list(range(1, N_JOBS + 1))
    assert ref.version == N_JOBS
    expected = Reference(cfg)
    expected.train(items)
    assert expected.slot.step_count == N_JOBS
    assert tensors_equal(payload, expected.params()), f"weights after a kill at {point} differ from exactly-once"
