"""Action experts of one shape sample together in a grouped `predict` (models/heads/expert.py
`ExpertHead.predict_many`: stacked weights, one batched matmul per layer for all of them);
actions equal the serial, one-tenant-at-a-time sampling within 1e-5 (CPU fp32), beside an
expert of another shape, an expert with fewer rows and a frozen-base mlp tenant."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from models import BaseConfig, BaseModel, TenantSlot, predict
from models.group import encode_grouped
from models.testing import calvin_schema, libero_schema, random_batch

torch.set_num_threads(1)

TOL = 1e-5
SAME = {"width": 32, "euler_steps": 3}
# (tenant, schema, head, options, rows)
TENANTS = [
    ("e0", libero_schema(), "expert", SAME, 2),
    ("e1", libero_schema(), "expert", SAME, 2),
    ("other", libero_schema(), "expert", {"width": 16, "euler_steps": 2}, 2),
    ("mlp", libero_schema(), "mlp", {"width": 32}, 2),
    ("e2", libero_schema(), "expert", SAME, 2),
    ("e-fewer", libero_schema(), "expert", SAME, 1),
    ("e-calvin", calvin_schema(), "expert", SAME, 2),  # other dims: samples alone
]


@pytest.fixture(scope="module")
def base() -> BaseModel:
    return BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu"))


def run(base: BaseModel, grouped: bool) -> list[torch.Tensor]:
    slots = [TenantSlot.create(t, schema, base, head_kind=head, head_options=opts, seed=40 + i)
             for i, (t, schema, head, opts, _) in enumerate(TENANTS)]
    vlas = [random_batch(s.preprocessor, t[-1], seed=9 * i).features for i, (s, t) in enumerate(zip(slots, TENANTS))]
    return predict(base, list(zip(slots, vlas)), grouped=grouped)


def test_same_shaped_experts_share_a_bucket(base: BaseModel) -> None:
    slots = [TenantSlot.create(t, schema, base, head_kind=head, head_options=opts, seed=1)
             for t, schema, head, opts, _ in TENANTS]
    vlas = [random_batch(s.preprocessor, rows, seed=0).features for s, (*_, rows) in zip(slots, TENANTS)]
    feats = encode_grouped(base, vlas, slots=slots, inference=True)
    keys = [s.head.batch_key(f) for s, f in zip(slots, feats)]
    assert keys[0] == keys[1] == keys[4] is not None
    assert len({keys[0], keys[2], keys[5], keys[6]}) == 4 and keys[3] is None


def test_batched_sampling_equals_serial(base: BaseModel) -> None:
    grouped, serial = run(base, True), run(base, False)
    for (t, schema, *_, rows), a, b in zip(TENANTS, grouped, serial):
        assert a.shape == b.shape == (rows, schema.action_horizon, schema.action_dim)
        assert float((a - b).norm() / b.norm()) < TOL, t
