"""Batched LoRA deltas (models/lora.py `_batched_delta`): segments with equal rows, rank and
scaling run as one bmm pair per module. Grouped == serial within 1e-5 (CPU fp32) for the
adjacent case (one slice of rows), the non-adjacent case (a frozen tenant between them) and
with dropout (each segment's noise from its own generator), losses and gradients."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from models import BaseConfig, BaseModel, TenantSlot, forward_backward
from models.lora import AdapterConfig, _buckets, router_for
from models.testing import libero_schema, random_batch

torch.set_num_threads(1)

TOL = 1e-5
R4 = AdapterConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
R4_DROP = AdapterConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"), dropout=0.2)


@pytest.fixture(scope="module")
def base() -> BaseModel:
    return BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu"))


def make(base: BaseModel, adapters: list) -> list[TenantSlot]:
    slots = [TenantSlot.create(f"t{i}", libero_schema(), base, head_options={"width": 32}, seed=30 + i, adapter=a)
             for i, a in enumerate(adapters)]
    with torch.no_grad():  # B starts at zero (peft's init): a non-zero start tests the deltas
        for s, b in ((s, b) for s in slots if s.adapter is not None for b in s.adapter.lora_B):
            b.normal_(0, 0.05, generator=torch.Generator().manual_seed(s.seed))
    return slots


def check(base: BaseModel, adapters: list) -> None:
    g, s = make(base, adapters), make(base, adapters)
    items = lambda slots: [(x, random_batch(x.preprocessor, 2, seed=7 * i)) for i, x in enumerate(slots)]  # noqa: E731
    gr = forward_backward(base, items(g), grouped=True)
    sr = forward_backward(base, items(s), grouped=False)
    for a, b in zip(gr, sr):
        assert abs(a.loss - b.loss) <= TOL * max(1.0, abs(b.loss)), (a.tenant_id, a.loss, b.loss)
    for gs, ss in zip(g, s):
        for (name, gp), (_, sp) in zip(gs.named_trainable(), ss.named_trainable()):
            if sp.grad is None:
                assert gp.grad is None or not gp.grad.any(), name
                continue
            assert float((gp.grad - sp.grad).norm() / sp.grad.norm().clamp_min(1e-12)) <= TOL, (gs.tenant_id, name)


def test_buckets_group_equal_segments(base: BaseModel) -> None:
    slots = make(base, [R4, R4, AdapterConfig(rank=2, target_modules=("q_proj",)), R4])
    segs = [x.adapter_segment(2 * i, 2 * i + 2, train=False) for i, x in enumerate(slots)]
    path = next(p for p in router_for(base).linears if p.endswith("q_proj"))
    assert [[s.start for s, _ in b] for b in _buckets(path, segs)] == [[0, 2, 6], [4]]


def test_adjacent_segments(base: BaseModel) -> None:
    check(base, [R4, R4, R4])


def test_non_adjacent_segments_and_dropout(base: BaseModel) -> None:
    check(base, [R4_DROP, None, R4_DROP, R4])
