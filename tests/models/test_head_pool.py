"""Plain `mlp` heads inside the fast engine's forward (models/heads/pool.py, issue 27 item 4):
a serving group of tenants of two schemas (two head shapes), with and without the state, gets
from the one forward what each tenant's own head gives on the same features (CPU fp32, 1e-5);
a weight change (a weight sync's load) reaches the next group; heads that are not plain `mlp`
and a full bucket leave the heads to run after the forward."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from models import BaseConfig, BaseModel, TenantSlot
from models.features import VLABatch
from models.heads.pool import HeadPool
from models.testing import calvin_schema, libero_schema, random_batch

torch.set_num_threads(1)
TOL = 1e-5


@pytest.fixture(scope="module")
def fast() -> BaseModel:
    return BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu", fast=True))


def make(base: BaseModel, specs: list) -> list[TenantSlot]:
    return [TenantSlot.create(f"h{i}", schema, base, head_kind=kind, head_options=opts, seed=10 + i)
            for i, (schema, kind, opts) in enumerate(specs)]


SPECS = [(libero_schema(), "mlp", {"width": 32}), (calvin_schema(), "mlp", {"width": 32, "depth": 3}),
         (libero_schema(), "mlp", {"width": 32}), (libero_schema(), "mlp", {"width": 32, "use_state": False})]


def group(slots: list[TenantSlot], rows: list[int], seed: int = 0) -> tuple[VLABatch, list]:
    vlas = [random_batch(s.preprocessor, n, seed=seed + 7 * i).features for i, (s, n) in enumerate(zip(slots, rows))]
    runs, start = [], 0
    for s, n in zip(slots, rows):
        runs.append((start, start + n, s.head))
        start += n
    return VLABatch.cat(vlas), runs


def check(base: BaseModel, slots: list[TenantSlot], rows: list[int], seed: int = 0) -> None:
    packed, runs = group(slots, rows, seed)
    plan = base.head_plan(runs, len(packed))
    assert plan is not None
    with torch.inference_mode():
        out = base.encode(packed, inference=True, heads=plan)
        assert out.head_actions is not None
        plain = base.encode(packed, inference=True)
        for k, ((start, end, head), slot) in enumerate(zip(runs, slots)):
            got = out.head_actions[plan.bucket_of_run[k]][start:end]
            f = plain.split([start, end - start, len(packed) - end])[1]
            want = head.predict(f, packed.index(slice(start, end)), slot.generator)
            assert got.shape == want.shape
            assert float((got - want).abs().max()) <= TOL, (k, float((got - want).abs().max()))
    assert torch.equal(out.hidden_B_L_D, plain.hidden_B_L_D)  # the base part is the same forward


def test_a_mixed_group_gets_each_heads_own_actions_from_the_forward(fast: BaseModel) -> None:
    slots = make(fast, SPECS)
    check(fast, slots, [2, 3, 1, 2])
    pool = fast._fast.head_pool
    assert len(pool.buckets) == 3  # (libero, width 32), (calvin, depth 3), (libero, no state)
    check(fast, slots[:2], [1, 1], seed=5)  # a group of fewer tenants: the same buckets, other rows


def test_a_weight_change_reaches_the_next_group(fast: BaseModel) -> None:
    slots = make(fast, SPECS[:2])
    check(fast, slots, [2, 2])
    bucket = next(iter(fast._fast.head_pool.buckets.values()))
    copies = bucket.copies
    check(fast, slots, [2, 2], seed=3)
    assert bucket.copies == copies  # unchanged weights are not copied again
    other = make(fast, SPECS[:1])[0]
    with torch.no_grad():
        other.head.trunk[0].weight.add_(0.5)
    slots[0].load_params(other.export_params(), strict_schema=False)  # the inferencer's weight sync
    check(fast, slots, [2, 2], seed=4)


def test_other_heads_and_a_full_bucket_run_after_the_forward(fast: BaseModel) -> None:
    flow = make(fast, [(libero_schema(), "flow", {"width": 32})])[0]
    enc = make(fast, [(libero_schema(), "mlp", {"width": 32, "image_channels": 4})])[0]
    for odd in (flow, enc):
        packed, runs = group([odd], [2])
        assert fast.head_plan(runs, len(packed)) is None
    small = HeadPool(torch.device("cpu"), capacity=1)
    slots = make(fast, SPECS[:1] * 2)
    packed, runs = group(slots, [1, 1])
    assert small.plan(runs, len(packed)) is None and small.fallbacks == 1
    assert small.plan(runs[:1], 1) is not None
    # Tenants choose their head shapes: past max_shapes a new one is refused, not allocated.
    one_shape = HeadPool(torch.device("cpu"), max_shapes=1)
    two = make(fast, [SPECS[0], SPECS[1]])
    packed, runs = group(two, [1, 1])
    assert one_shape.plan(runs[:1], 1) is not None and one_shape.plan(runs, 2) is None
    assert len(one_shape.buckets) == 1 and one_shape.fallbacks == 1
    plain = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu"))
    assert plain.head_plan(runs, len(packed)) is None  # no fast engine: nothing to hold the heads
