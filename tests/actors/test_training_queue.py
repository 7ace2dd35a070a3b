"""The training queue and the trainer, for real: master + trainer processes on nats-server.

A job goes reserve -> queue_put -> mark_ready -> leased -> trained -> exported -> synced ->
cleared; the trainer's exported params equal an in-process reference that ran the same steps
(so nothing was lost or applied twice), and bad input is refused with named fields.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from protocol import ops
from protocol.messages import CheckpointCommitRequest

from protocol.errors import FailedPrecondition, InvalidField, MissingField, NotFound, PayloadTooLarge
from sdk.client import AsyncClient
from tests.support.tq_helpers import CALVIN_SCHEMA, Reference, micro_batch, tenant, tensors_equal


def run(coro):
    return asyncio.run(coro)


async def _client(roles) -> AsyncClient:
    return await AsyncClient(roles.nats_url, roles.prefix, timeout_s=30).connect()


async def _submit_job(c: AsyncClient, cfg, n_items: int, task: str = "sft", seed: int = 0, rl_version: int = -1):
    job = await c.reserve(cfg.name, task, wait_s=60)
    items = [micro_batch(cfg, job.job, i, seed=seed, rl_version=rl_version) for i in range(n_items)]
    for item in items:
        await c.queue_put(item)
    await c.mark_ready(cfg.name, job.job)
    return job, items


def test_sft_and_rl_jobs_train_through_the_services_like_the_reference(roles):
    roles.start("master")
    roles.start("trainer")
    sft_cfg = tenant("sft-a", head="mlp", seed=1)
    rl_cfg = tenant("rl-b", schema=CALVIN_SCHEMA, head="gaussian", seed=2)

    async def go():
        c = await _client(roles)
        try:
            for cfg in (sft_cfg, rl_cfg):
                created = await c.create_tenant(cfg)
                assert created.signature.startswith("sha256:")
            sft_job, sft_items = await _submit_job(c, sft_cfg, 3, seed=1)
            rl_job, rl_items = await _submit_job(c, rl_cfg, 2, task="rl", seed=2, rl_version=0)
            sft_rec = await c.wait_job(sft_cfg.name, sft_job.job, timeout_s=120)
            rl_rec = await c.wait_job(rl_cfg.name, rl_job.job, timeout_s=120)
            refs = {cfg.name: await c.latest_weights(cfg.name) for cfg in (sft_cfg, rl_cfg)}
            payloads = {name: await c.download_weights(ref) for name, ref in refs.items()}
            # The partition is purged once cleared.
            got = await c.queue_get(sft_cfg.name, sft_job.job, max_items=10)
            return sft_rec, rl_rec, refs, payloads, sft_items, rl_items, got
        finally:
            await c.close()

    sft_rec, rl_rec, refs, payloads, sft_items, rl_items, got = run(go())
    assert sft_rec.state == "cleared", sft_rec
    assert rl_rec.state == "cleared", rl_rec
    assert sft_rec.trained_version == 3 and rl_rec.trained_version == 2
    assert "loss" in sft_rec.metrics and "policy_loss" in rl_rec.metrics  # PPO ran for the RL job
    assert got.items == []
    for cfg, items in ((sft_cfg, sft_items), (rl_cfg, rl_items)):
        ref = Reference(cfg)
        ref.train(items)
        payload, manifest = payloads[cfg.name]
        assert tensors_equal(payload, ref.params()), f"{cfg.name}: trainer result differs from the reference"
        assert manifest["schema_signature"] == ref.slot.schema.signature()
        assert manifest["version"] == refs[cfg.name].version == len(items)
        assert manifest["head"] == cfg.head and manifest["base"] == cfg.base


def test_bad_input_is_refused_with_named_fields(roles):
    roles.start("master")
    cfg = tenant("bad-in")

    async def go():
        c = await _client(roles)
        try:
            await c.create_tenant(cfg)
            job = await c.reserve(cfg.name, "sft")
            good = micro_batch(cfg, job.job, 0)
            bad = micro_batch(cfg, job.job, 1)
            bad.images["agentview"] = bad.images["agentview"][:, :8]
            with pytest.raises(InvalidField, match=r"images\.agentview: shape"):
                await c.queue_put(bad)
            bad = micro_batch(cfg, job.job, 1)
            bad.state = bad.state.astype(np.float64)
            with pytest.raises(InvalidField, match="state: dtype float64"):
                await c.queue_put(bad)
            bad = micro_batch(cfg, job.job, 1)
            del bad.images["wrist"]
            with pytest.raises(MissingField, match=r"images\.wrist"):
                await c.queue_put(bad)
            bad = micro_batch(cfg, job.job, 1)
            bad.actions = bad.actions[:, :, :3]
            with pytest.raises(InvalidField, match="actions: shape"):
                await c.queue_put(bad)
            bad = micro_batch(cfg, job.job, 1, rl_version=0)
            with pytest.raises(InvalidField, match="old_log_prob: only RL jobs"):
                await c.queue_put(bad)
            with pytest.raises(NotFound, match="unknown tenant 'nobody'"):
                await c.reserve("nobody", "sft")
            with pytest.raises(NotFound, match="unknown job 'jnope'"):
                await c.mark_ready(cfg.name, "jnope")
            with pytest.raises(FailedPrecondition, match="put data first"):
                await c.mark_ready(cfg.name, job.job)
            # Over the max payload: the server says to chunk; the SDK chunks for the user.
            big = micro_batch(cfg, job.job, 5, b=2)
            rows = 1500
            big.images = {k: np.zeros((rows, 16, 16, 3), np.uint8) + 7 for k in big.images}
            big.state = np.zeros((rows, 8), np.float32)
            big.actions = np.zeros((rows, 4, 7), np.float32)
            big.instructions = ["x"] * rows
            with pytest.raises(PayloadTooLarge, match="chunks"):
                await c.bus.request(ops.MASTER_QUEUE_PUT.subject(c.names), big, object, timeout_s=10)
            reply = await c.queue_put(big)
            assert reply.items >= 2  # split into several micro-batches
            await c.queue_put(good)
            dup = await c.queue_put(good)  # a retried put is deduplicated
            assert dup.duplicate
            rec = await c.job(cfg.name, job.job)
            assert rec.samples == rows + 2
            rows_back, start = 0, 0
            while start < rec.items:  # a reply fits the max payload; page through the rest
                back = await c.queue_get(cfg.name, job.job, start=start, max_items=100)
                assert back.items and back.total == rec.items
                rows_back += sum(len(i.instructions) for i in back.items)
                start += len(back.items)
            assert rows_back == rows + 2
            return rec
        finally:
            await c.close()

    rec = run(go())
    assert rec.state == "filling"


def test_duplicate_tenant_and_bad_config_are_errors(roles):
    roles.start("master")
    cfg = tenant("dup")

    async def go():
        c = await _client(roles)
        try:
            await c.create_tenant(cfg)
            assert (await c.create_tenant(cfg, exist_ok=True)).name == "dup"
            from protocol.errors import Conflict

            with pytest.raises(Conflict, match="already exists"):
                await c.create_tenant(cfg)
            bad = tenant("bad-schema")
            bad.schema = dict(bad.schema, state_dim=-1)
            with pytest.raises(InvalidField, match="config.schema"):
                await c.create_tenant(bad)
            bad = tenant("bad-head", head="transformer-xl")
            with pytest.raises(InvalidField, match="config.head_params"):
                await c.create_tenant(bad)
            bad = tenant("bad-base")
            bad.base = "/no/such/dir"
            with pytest.raises(InvalidField, match="config.base"):
                await c.create_tenant(bad)
        finally:
            await c.close()

    run(go())


def test_failure_in_one_tenant_fails_only_its_job(roles):
    """A tenant whose checkpoint is corrupt fails its job with a reason; the others train."""
    roles.start("master")
    roles.start("trainer", NEXUS_TRAINER_GROUP_MAX="4")
    cfgs = [tenant(f"iso-{i}", seed=i) for i in range(3)]

    async def go():
        c = await _client(roles)
        try:
            for cfg in cfgs:
                await c.create_tenant(cfg)
            store = await c.bus.js.object_store(c.names.obj_checkpoints)
            await store.put("iso-1/ckpt/corrupt", b"\x00 not a checkpoint")
            # Commit it as iso-1's state, as a trainer would (compare-and-set on "no checkpoint").
            await c.bus.call(ops.MASTER_CHECKPOINT_COMMIT, CheckpointCommitRequest(
      tenant="iso-1", object_name="iso-1/ckpt/corrupt", base_checkpoint="", trainer="test"))
            jobs = [(await _submit_job(c, cfg, 1, seed=i))[0] for i, cfg in enumerate(cfgs)]
            return [await c.wait_job(cfg.name, j.job, timeout_s=120) for cfg, j in zip(cfgs, jobs)]
        finally:
            await c.close()

    recs = run(go())
    assert [r.state for r in recs] == ["cleared", "failed", "cleared"], recs
    assert "checkpoint" in recs[1].reason or "malformed" in recs[1].reason
