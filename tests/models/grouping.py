"""Shared by the grouped-forward correctness tests (tests/models/test_*_group*.py): each tenant's
batches, the relative error they compare with, and the grouped == serial checks."""

from __future__ import annotations

from typing import Callable

import torch

from models import BaseModel, TenantSlot, forward_backward
from models.group import encode_grouped
from models.testing import random_batch

BATCH = 2


def batches(slots: list[TenantSlot], step: int) -> list:
    """(slot, batch) per tenant: tenant ``i``'s batch of ``step`` is the same in every run."""
    return [(s, random_batch(s.preprocessor, BATCH, seed=1000 * i + step)) for i, s in enumerate(slots)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def start_adapters_off_zero(slots: list[TenantSlot]) -> list[TenantSlot]:
    """LoRA's B starts at zero (peft's init), which makes an adapter a no-op at step 0: a
    seeded non-zero start tests the adapters from the first step."""
    with torch.no_grad():
        for s in slots:
            for b in (s.adapter.lora_B if s.adapter is not None else ()):
                b.normal_(0, 0.05, generator=torch.Generator().manual_seed(s.seed))
    return slots


def assert_losses_match(grouped: list[float], serial: list[float], tol: float, what: object = "") -> None:
    for a, b in zip(grouped, serial, strict=True):
        assert abs(a - b) <= tol * max(1.0, abs(b)), (what, grouped, serial)


def backward_matches_serial(base: BaseModel, make_slots: Callable[[BaseModel], list[TenantSlot]],
                            tol: float) -> list[TenantSlot]:
    """One grouped and one serial forward_backward from the same seeds: every tenant's loss and
    every trainable tensor's gradient agree (one without a gradient has none in both runs).
    Returns the grouped run's slots, their gradients in place."""
    g_slots, s_slots = make_slots(base), make_slots(base)
    grouped = forward_backward(base, batches(g_slots, 0), grouped=True)
    serial = forward_backward(base, batches(s_slots, 0), grouped=False)
    assert_losses_match([r.loss for r in grouped], [r.loss for r in serial], tol)
    for gs, ss in zip(g_slots, s_slots, strict=True):
        for (name, gp), (_, sp) in zip(gs.named_trainable(), ss.named_trainable(), strict=True):
            if sp.grad is None:
                assert gp.grad is None, (gs.tenant_id, name)
                continue
            assert rel(gp.grad, sp.grad) < tol, (gs.tenant_id, name, rel(gp.grad, sp.grad))
    return g_slots


def assert_params_match(g_slots: list[TenantSlot], s_slots: list[TenantSlot], tol: float, steps: int) -> None:
    """Both runs took ``steps`` steps and every trainable tensor agrees."""
    for gs, ss in zip(g_slots, s_slots, strict=True):
        assert gs.policy_version == ss.policy_version == steps
        for (name, gp), (_, sp) in zip(gs.named_trainable(), ss.named_trainable(), strict=True):
            assert rel(gp.detach(), sp.detach()) < tol, (gs.tenant_id, name, rel(gp.detach(), sp.detach()))


def backward_first_only(base: BaseModel, slots: list[TenantSlot]) -> TenantSlot:
    """One grouped training forward of every slot, and only the first tenant's loss backward:
    no other tenant's tensor and no base weight may see a gradient. Returns the first slot, its
    gradients in place (what reaches it is each test's own check)."""
    items = batches(slots, 3)
    for s in slots:
        s.zero_grad()
    feats = encode_grouped(base, [b.features for _, b in items], slots=slots, train=True)
    first = slots[0]
    first.head.loss(feats[0], items[0][1], first.generator).loss.backward()
    for s in slots[1:]:
        assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for _, p in s.named_trainable()), s.tenant_id
    assert all(p.grad is None for p in base.core.parameters())
    return first
