"""Continuous (iteration-level) scheduling in the trainer, through real master + trainer
processes: a job leaves the running group, commits and exports as soon as its last micro-batch
is done, and the next ready job joins at the next step.

Exactly-once is checked the strict way (tests/support/tq_helpers.py): each tenant's exported weights
are bit-identical to an in-process run that applies each of its micro-batches once, in order.
One deployment for the module.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from sdk.client import AsyncClient
from tests.conftest import module_roles, run_client
from tests.support.tq_helpers import exactly_once, queue_job, role_info, tenant

# Long enough that a short job submitted once the long one trains is done well before it.
LONG_ITEMS = 60


@pytest.fixture(scope="module")
def deployment(nats_server, tmp_path_factory):
    with module_roles(nats_server, tmp_path_factory, "continuous") as roles:
        roles.start("master")
        trainer = roles.start("trainer", NEXUS_TRAINER_GROUP_MAX="4")
        yield roles, trainer.instance


def run(deployment, body):
    roles, trainer = deployment
    return run_client(roles, lambda c: body(c, trainer))


async def _wait_training(c: AsyncClient, trainer: str, job: str) -> None:
    """Until ``job`` is in the running group with at least one micro-batch trained."""
    deadline = time.monotonic() + 60
    while (await role_info(c, "trainer", trainer)).extra["running"].get(job, 0) < 1:
        assert time.monotonic() < deadline, f"the trainer never trained job {job}"
        await asyncio.sleep(0.02)


async def _long_job_training(c: AsyncClient, trainer: str, long_cfg, other_cfg):
    """Both tenants created, ``long_cfg``'s long job queued and training: the trainer's counters
    from before it, the job and its micro-batches."""
    for cfg in (long_cfg, other_cfg):
        await c.create_tenant(cfg)
    before = (await role_info(c, "trainer", trainer)).extra
    long_job, long_items = await queue_job(c, long_cfg, LONG_ITEMS, seed=long_cfg.seed)
    await _wait_training(c, trainer, long_job.job)
    return before, long_job, long_items


async def _exported(c: AsyncClient, cfgs) -> list[bytes]:
    """Each tenant's latest exported weights."""
    return [(await c.download_weights(await c.latest_weights(cfg.name)))[0] for cfg in cfgs]


def test_a_short_job_beside_a_long_one_clears_first(deployment):
    """In lockstep rounds a 1-item job waits for the longest job of its round (or for the next
    round); here it commits, exports and clears while the long job is still training."""
    long_cfg = tenant("cont-long", seed=11, sft_prefetch_items=256)
    short_cfg = tenant("cont-short", seed=12)

    async def body(c, trainer):
        before, long_job, long_items = await _long_job_training(c, trainer, long_cfg, short_cfg)
        short_job, short_items = await queue_job(c, short_cfg, 1, seed=12)
        short_rec = await c.wait_job(short_cfg.name, short_job.job, timeout_s=120)
        long_rec = await c.wait_job(long_cfg.name, long_job.job, timeout_s=180)
        after = (await role_info(c, "trainer", trainer)).extra
        payloads = await _exported(c, (long_cfg, short_cfg))
        return before, after, short_rec, long_rec, long_items, short_items, payloads

    before, after, short_rec, long_rec, long_items, short_items, payloads = run(deployment, body)
    assert short_rec.state == long_rec.state == "cleared", (short_rec, long_rec)
    assert short_rec.trained_version == 1 and long_rec.trained_version == LONG_ITEMS
    # The short job joined the running group mid-way and cleared before the long one did.
    assert short_rec.updated_at < long_rec.updated_at, (short_rec.updated_at, long_rec.updated_at)
    assert after["joined_running"] > before["joined_running"]
    # Its one step was shared with the long job's: fewer grouped steps than micro-batches.
    assert after["steps"] - before["steps"] == LONG_ITEMS
    assert exactly_once(long_cfg, long_items, payloads[0])
    assert exactly_once(short_cfg, short_items, payloads[1])


def test_jobs_joining_mid_round_train_exactly_once(deployment):
    """Three jobs of one tenant, one after another, each joining the running group beside a
    long job of another tenant: every micro-batch is applied once (bit-identical weights), the
    version goes up by one per step (3, 6, 9), and the long job is untouched by the joins."""
    long_cfg = tenant("join-long", seed=21, sft_prefetch_items=256)
    joiner = tenant("join-b", seed=22, max_inflight_jobs=4)

    async def body(c, trainer):
        before, long_job, long_items = await _long_job_training(c, trainer, long_cfg, joiner)
        recs, items = [], []
        for k in range(3):
            job, its = await queue_job(c, joiner, 3, seed=30 + k)
            recs.append(await c.wait_job(joiner.name, job.job, timeout_s=120))
            items.extend(its)
        long_rec = await c.wait_job(long_cfg.name, long_job.job, timeout_s=180)
        after = (await role_info(c, "trainer", trainer)).extra
        payloads = await _exported(c, (long_cfg, joiner))
        return before, after, recs, items, long_rec, long_items, payloads

    before, after, recs, items, long_rec, long_items, payloads = run(deployment, body)
    assert [r.state for r in recs] == ["cleared"] * 3, [(r.state, r.reason) for r in recs]
    assert [r.trained_version for r in recs] == [3, 6, 9]
    assert [r.attempts for r in recs] == [1, 1, 1] and [r.lease_epoch for r in recs] == [1, 1, 1]
    assert long_rec.state == "cleared" and long_rec.trained_version == LONG_ITEMS
    assert after["joined_running"] - before["joined_running"] >= 1
    assert after["steps"] - before["steps"] < LONG_ITEMS + len(items)  # some steps were shared
    assert after["leases_lost"] == before["leases_lost"]
    assert exactly_once(joiner, items, payloads[1])
    assert exactly_once(long_cfg, long_items, payloads[0])
