"""Priority that routes, on real roles (issue 29 item 3): one trainer slot, three tenants with
a backlog, two at priority 10 and one at 0. A high tenant's job is leased first and the two
have most of the slot (fair share, weights 4:4:1), and the low tenant still progresses: its
first job is trained before the high tenants' last (strict priority, as before, would train
all eight of theirs first: one of the two is always free while the other's job is on the
trainer). Every job is cleared exactly once. The pure policy is in tests/master/test_fairshare.py."""

from __future__ import annotations

import asyncio

import pytest

from sdk.client import AsyncClient
from tests.support.tq_helpers import micro_batch, tenant

N_JOBS = 4


@pytest.mark.slow  # ~25-40 s: two roles and twelve trained jobs
def test_scarce_trainer_slot_goes_by_priority_and_the_low_tenant_progresses(roles):
    roles.start("master")
    hi = tenant("prio-hi", seed=1, priority=10, max_inflight_jobs=N_JOBS)
    hi2 = tenant("prio-hi2", seed=3, priority=10, max_inflight_jobs=N_JOBS)
    lo = tenant("prio-lo", seed=2, priority=0, max_inflight_jobs=N_JOBS)

    async def prepare():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            jobs = []
            for cfg in (lo, hi, hi2):  # the low tenant's backlog is older: it still waits its turn
                await c.create_tenant(cfg)
                for j in range(N_JOBS):
                    job = await c.reserve(cfg.name, "sft")
                    await c.queue_put(micro_batch(cfg, job.job, 0, seed=j))
                    await c.mark_ready(cfg.name, job.job)
                    jobs.append((cfg.name, job.job))
            return jobs
        finally:
            await c.close()

    jobs = asyncio.run(prepare())
    roles.start("trainer", NEXUS_TRAINER_GROUP_MAX="1")  # one slot: scarce

    async def finish():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()
        try:
            return [await c.wait_job(t, j, timeout_s=120) for t, j in jobs]
        finally:
            await c.close()

    recs = asyncio.run(finish())
    assert [r.state for r in recs] == ["cleared"] * 3 * N_JOBS, [(r.tenant, r.state, r.reason) for r in recs]
    for name in (hi.name, hi2.name, lo.name):  # each job trained once, in the tenant's order
        assert [r.trained_version for r in recs if r.tenant == name] == list(range(1, N_JOBS + 1))
    order = ["lo" if r.tenant == lo.name else "hi" for r in sorted(recs, key=lambda r: r.updated_at)]
    assert order[0] == "hi", order
    assert order.index("lo") < len(order) - 1 - order[::-1].index("hi"), order  # not starved
    assert order[:6].count("hi") >= 4, order  # but the high tenants have most of the slot
