"""The trainer's lease cohort (actors/trainer/train_loop.py, bounded by NEXUS_TRAINER_COHORT_WAIT_S,
COHORT_JOIN_WAIT_S in protocol/policy.py by default): jobs leased together in one lease reply share the group's first step, and
so every step, even when one of them takes longer to prepare.

Real master and trainer processes. Both jobs are ready before the trainer starts, so its first
lease takes them in one reply. Their tenants are on two bases: the trainer loads bases one at a
time, so one job is ready a base load (tens of ms) after the other, while a step takes about as
long. Without the wait the first one ready would take a step or more alone, and the trainer
would count more steps than a job has micro-batches.
"""

from __future__ import annotations

from tests.conftest import run_client
from tests.support.tq_helpers import BASE, queue_job, role_info, tenant

ITEMS = 3
OTHER_BASE = "tiny-qwen3-vl-64"  # another preset: another base object, loaded after BASE or before it


def test_jobs_leased_together_share_the_first_step(roles):
    roles.start("master")
    cfgs = [tenant("cohort-a", seed=41), tenant("cohort-b", seed=42, base=OTHER_BASE)]

    async def queue(c):
        for cfg in cfgs:
            await c.create_tenant(cfg)
        return [await queue_job(c, cfg, ITEMS, seed=cfg.seed) for cfg in cfgs]

    queued = run_client(roles, queue)
    trainer = roles.start("trainer", NEXUS_TRAINER_GROUP_MAX="4")

    async def finish(c):
        recs = [await c.wait_job(cfg.name, job.job, timeout_s=120) for cfg, (job, _) in zip(cfgs, queued)]
        return recs, (await role_info(c, "trainer", trainer.instance)).extra

    recs, info = run_client(roles, finish)
    assert [r.state for r in recs] == ["cleared"] * 2, [(r.state, r.reason) for r in recs]
    assert [r.trained_version for r in recs] == [ITEMS] * 2
    assert [r.lease_epoch for r in recs] == [1, 1]  # each leased once, by this trainer's first lease
    assert info["bases"] == sorted([BASE, OTHER_BASE])  # each job waited for a base load of its own
    # Both trained from the first step on: every step held both jobs.
    assert info["steps"] == ITEMS, info
