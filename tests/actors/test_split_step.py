"""A micro-batch the SDK splits to fit the max payload trains as ONE optimizer step.

Unit level (no broker): the trainer's `join_parts` rebuilds the very micro-batch the workflow
put from its parts (any order, unequal sizes), and its loss and gradients are those of the
whole micro-batch, the mean over all its rows, not a mean of the part means. End to end (real
nats-server, master, trainer, env worker): an SFT workload whose every micro-batch is split in
parts trains exactly its budget of steps, and a queued job of split and whole items trains one
step per put item, bit-identical to training the unsplit items in-process."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from actors.tq_read import join_parts
from protocol import ops
from protocol.messages import (
    chunk_parts,
    chunk_seq,
    is_chunk_seq,
    starts_step,
    workload_steps,
)
from protocol.wire import encode
from sdk.client import AsyncClient
from sdk.queue_chunks import _slice_item, split_item
from tests.support.tq_helpers import exactly_once, micro_batch, tenant


def _split(item, parts_wanted: int):
    """Split ``item`` by the SDK's own rule, with a max size that forces ``parts_wanted`` parts."""
    b = len(item.instructions)
    rows = -(-b // parts_wanted)
    biggest = max(len(encode(_slice_item(item, lo, min(lo + rows, b), chunk_seq(item.seq, 0, 0))))
                  for lo in range(0, b, rows))
    parts = split_item(item, biggest)
    assert len(parts) == parts_wanted and all(is_chunk_seq(p.seq) for p in parts)
    return parts


def test_chunk_parts_inverts_chunk_seq():
    for seq, log2, k in [(0, 1, 0), (7, 2, 3), (2**31 - 1, 16, 2**16 - 1), (5, 0, 0)]:
        assert chunk_parts(chunk_seq(seq, log2, k)) == (seq, log2, k)
    assert chunk_parts(42) is None and starts_step(42)
    assert starts_step(chunk_seq(3, 2, 0)) and not starts_step(chunk_seq(3, 2, 1))


def test_join_parts_rebuilds_the_micro_batch_in_place():
    cfg = tenant("split-unit")
    whole = micro_batch(cfg, "j1", 1, b=10, rl_version=3)
    whole.kl_coef, whole.anchor_version = 0.2, 3  # a PPO item with a KL term: every part keeps it
    parts = _split(whole, 4)  # 3 + 3 + 3 + 1 rows: unequal parts
    assert all((p.kl_coef, p.anchor_version) == (0.2, 3) for p in parts)
    assert sorted(len(p.instructions) for p in parts) == [1, 3, 3, 3]
    before, after = micro_batch(cfg, "j1", 0, b=2), micro_batch(cfg, "j1", 2, b=2)
    shuffled = parts[:]
    random.Random(0).shuffle(shuffled)
    joined = join_parts([before, *shuffled, after])
    assert [j.seq for j in joined] == [0, 1, 2]  # one micro-batch per put item, in put order
    got = joined[1]
    for name in ("state", "actions", "old_log_prob", "advantages", "returns"):
        assert np.array_equal(getattr(got, name), getattr(whole, name)), name
    assert got.images.keys() == whole.images.keys()
    assert all(np.array_equal(got.images[c], whole.images[c]) for c in whole.images)
    assert got.instructions == whole.instructions and got.behaviour_version == whole.behaviour_version
    assert (got.kl_coef, got.anchor_version) == (0.2, 3)
    assert joined[0] is before and joined[2] is after
    # Two splits of two items never merge with each other.
    other = _split(micro_batch(cfg, "j1", 3, b=4), 2)
    assert [len(j.instructions) for j in join_parts([*parts, *other])] == [10, 4]


def test_a_joined_item_has_the_loss_and_gradients_of_the_whole_micro_batch():
    """fp32 on CPU: the joined item's loss and gradients equal the whole micro-batch's
    exactly, and they are the row-weighted mean of the parts', not the mean of the part means
    (which a per-part step or an unweighted accumulation would give)."""
    import torch

    from actors.trainer.step import item_to_batch
    from models import BaseConfig, BaseModel, OptimConfig, TenantSchema, TenantSlot
    from models.group import forward_backward

    torch.manual_seed(0)
    cfg = tenant("split-grad")
    base = BaseModel.load(BaseConfig(source=cfg.base))
    slot = TenantSlot.create(cfg.name, TenantSchema.from_dict(cfg.schema), base, head_kind=cfg.head,
                             optim=OptimConfig(**cfg.optim), seed=cfg.seed)
    whole = micro_batch(cfg, "j", 0, b=10)
    whole.instructions = ["pick up the block"] * 10  # one token length: no padding differs by part
    parts = _split(whole, 4)
    (joined,) = join_parts(parts[::-1])

    def loss_and_grads(item):
        (r,) = forward_backward(base, [(slot, item_to_batch(slot, item))])
        return r.loss, {n: p.grad.detach().clone() for n, p in slot.named_trainable() if p.grad is not None}

    loss_w, grads_w = loss_and_grads(whole)
    loss_j, grads_j = loss_and_grads(joined)
    assert grads_w and loss_j == loss_w
    assert grads_j.keys() == grads_w.keys() and all(torch.equal(grads_j[n], grads_w[n]) for n in grads_w)

    rows = [len(p.instructions) for p in parts]
    per_part = [loss_and_grads(p) for p in parts]
    weighted = sum(n * lp for n, (lp, _) in zip(rows, per_part)) / sum(rows)
    assert abs(weighted - loss_w) < 1e-5 * max(1.0, abs(loss_w))
    assert abs(np.mean([lp for lp, _ in per_part]) - loss_w) > 1e-4  # the wrong answer is distinguishable
    for n in grads_w:
        acc = sum(k * g[n] for k, (_, g) in zip(rows, per_part)) / sum(rows)
        assert torch.allclose(acc, grads_w[n], rtol=1e-4, atol=1e-6), n


BIG = {"cameras": [{"name": n, "height": 128, "width": 128} for n in ("agentview", "wrist")],
       "state_dim": 8, "action_dim": 7, "action_horizon": 4, "instruction_template": "{instruction}"}


@pytest.fixture
def cluster(roles):
    for role in ("health", "master", "trainer", "env"):
        roles.start(role)
    return roles


def test_split_items_train_one_step_each_exactly_once(cluster):
    """A job of 3 items, the middle one over the max payload (split by the SDK, its put retried
    whole): the trainer takes 3 steps (version 3), bit-identical to the 3 unsplit items trained
    in-process; the job record counts 3 steps in more than 3 stored items."""
    cfg = tenant("split-q", schema=BIG)

    async def go():
        c = await AsyncClient(cluster.nats_url, cluster.prefix, timeout_s=60).connect()
        try:
            await c.create_tenant(cfg)
            job = (await c.reserve(cfg.name, "sft")).job
            items = [micro_batch(cfg, job, 0, b=2), micro_batch(cfg, job, 1, b=24), micro_batch(cfg, job, 2, b=2)]
            assert len(encode(items[1])) > c.bus.max_payload
            for item in items:
                await c.queue_put(item)
            assert (await c.queue_put(items[1])).duplicate  # a retried split put stores nothing
            queued = await c.job(cfg.name, job)
            await c.mark_ready(cfg.name, job)
            done = await c.wait_job(cfg.name, job, timeout_s=240)
            ref = await c.latest_weights(cfg.name)
            payload, _ = await c.download_weights(ref)
            return items, queued, done, ref, payload
        finally:
            await c.close()

    items, queued, done, ref, payload = asyncio.run(go())
    assert queued.items >= 4 and queued.steps == 3, (queued.items, queued.steps)
    assert done.state == "cleared", done.reason
    assert done.trained_version == 3 and ref.version == 3
    assert exactly_once(cfg, items, payload)


def test_an_sft_workload_of_split_micro_batches_trains_exactly_its_budget(cluster):
    """``micro_batch``/``batch_size`` 64 rows of two 64x64 cameras is over the 1 MiB max
    payload: every micro-batch goes as 2 parts. A 3-step budget trains 3 steps (version 0 -> 3),
    not 6."""
    from tests.master.test_workloads import sft_spec

    spec = sft_spec("split-sft", steps=3)
    spec["algorithm"]["batch_size"] = 64

    async def go():
        c = await AsyncClient(cluster.nats_url, cluster.prefix, timeout_s=60).connect()
        try:
            wl = await c.submit(spec)
            done = await wl.wait(timeout_s=280)
            jobs = [j for j in await c.jobs("split-sft") if j.workload == wl.id]
            return done, await c.latest_weights("split-sft"), jobs
        finally:
            await c.close()

    done, ref, jobs = asyncio.run(go())
    assert done.state == "completed", done.message
    assert sum(j.items for j in jobs) > sum(j.steps for j in jobs) == 3, [(j.items, j.steps) for j in jobs]
    assert ref.version == 3 and done.step == 3 and workload_steps(done) == 3, (ref.version, done.message)
    assert "trained 3/3 steps" in done.message, done.message


def test_join_parts_refuses_a_step_past_the_row_bound():
    """Parts a tenant puts by hand (its own queue_put, not the SDK's split) may add up to more
    rows than any spec allows in one step: refused before anything is copied."""
    import msgspec

    from protocol.messages import MAX_STEP_ROWS

    cfg = tenant("split-bound")
    parts = [msgspec.structs.replace(micro_batch(cfg, "j", 0, b=40), seq=chunk_seq(0, 5, k)) for k in range(32)]
    assert sum(len(p.instructions) for p in parts) > MAX_STEP_ROWS
    with pytest.raises(ValueError, match=f"at most {MAX_STEP_ROWS}"):
        join_parts(parts)
    fits = [msgspec.structs.replace(micro_batch(cfg, "j", 0, b=32), seq=chunk_seq(0, 5, k)) for k in range(32)]
    assert [len(j.instructions) for j in join_parts(fits)] == [MAX_STEP_ROWS]  # the bound itself trains


def test_hand_made_parts_past_the_row_bound_fail_their_job_and_nothing_else(cluster):
    """A tenant's queue_put of 32 hand-numbered parts of one item (1,280 rows in all): its job
    fails naming the bound, its policy stays at version 0, and its next job trains (the trainer
    and its group go on)."""
    import msgspec

    cfg = tenant("split-hostile")

    async def go():
        c = await AsyncClient(cluster.nats_url, cluster.prefix, timeout_s=60).connect()
        try:
            await c.create_tenant(cfg)
            job = (await c.reserve(cfg.name, "sft")).job
            for k in range(32):
                part = msgspec.structs.replace(micro_batch(cfg, job, 0, b=40), seq=chunk_seq(0, 5, k))
                await c._call(ops.MASTER_QUEUE_PUT, part)
            await c.mark_ready(cfg.name, job)
            failed = await c.wait_job(cfg.name, job, timeout_s=240)
            ok_job = (await c.reserve(cfg.name, "sft", key="after")).job
            await c.queue_put(micro_batch(cfg, ok_job, 0, b=2))
            await c.mark_ready(cfg.name, ok_job)
            done = await c.wait_job(cfg.name, ok_job, timeout_s=240)
            return failed, done
        finally:
            await c.close()

    failed, done = asyncio.run(go())
    assert failed.state == "failed" and "at most 1024" in failed.reason, failed
    assert failed.trained_version == -1, failed
    assert done.state == "cleared" and done.trained_version == 1, done  # version 1: nothing trained before
