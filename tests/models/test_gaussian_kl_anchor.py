"""The gaussian head's KL term to an anchor policy (PPO's ``kl_coef``): the closed form, its
gradient, kl_coef 0 leaving the loss as it was, and the anchor surviving checkpoint / restore."""

from __future__ import annotations

import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import torch.nn.functional as F

from models import InputError, OptimConfig, TenantSlot, train_step
from models.testing import libero_schema, random_batch

torch.set_num_threads(1)
# The instruction encoder and an image encoder: the anchor must cover every policy submodule.
OPTIONS = {"width": 32, "init_log_std": -1.0, "instruction_encoder": True, "image_channels": 4}


def gaussian(base, seed: int = 0) -> TenantSlot:
    return TenantSlot.create("t-kl", libero_schema(horizon=2), base, head_kind="gaussian", head_options=OPTIONS,
                             optim=OptimConfig(lr=1e-3), seed=seed)


def ppo_batch(slot: TenantSlot, base, seed: int, kl_coef: float = 0.0):
    batch = random_batch(slot.preprocessor, 4, seed=seed)
    with torch.no_grad():
        lp, _, _ = slot.head.evaluate_actions(base.encode(batch.features), batch.features, batch.actions_B_H_A)
    g = torch.Generator().manual_seed(seed)
    batch.old_log_prob_B = lp + 0.05 * torch.randn(4, generator=g)
    batch.advantages_B = torch.randn(4, generator=g)
    batch.returns_B = torch.randn(4, generator=g)
    batch.kl_coef = kl_coef
    return batch


def test_kl_is_zero_at_the_anchor_grows_as_the_mean_moves_and_pulls_it_back(base) -> None:
    s = gaussian(base)
    head = s.head
    s.use_anchor(0)
    assert s.anchor_version == 0
    # The policy part only: the value net is not the policy; everything else is.
    names = set(head.anchor_tensors())
    assert names and not any(n.startswith("value.") for n in names)
    assert {"log_std", "in_proj.weight", "instruction_encoder.embed.weight"} <= names
    assert any(n.startswith("image_encoder.") for n in names) and any(n.startswith("mean.") for n in names)
    batch = random_batch(s.preprocessor, 3, seed=1)
    feats = base.encode(batch.features)

    def kl() -> torch.Tensor:
        return head.kl_to_anchor(head(feats, batch.features), feats, batch.features)

    assert float(kl().detach()) == 0.0
    n = head.log_std.numel()
    sigma2 = math.exp(2 * OPTIONS["init_log_std"])
    last = head.mean[-1]
    shifts = []
    for delta in (0.05, 0.1, 0.2):
        with torch.no_grad():
            last.bias.copy_(s.head.anchor_tensors()[f"mean.{len(head.mean) - 1}.bias"] + delta)
        value = float(kl().detach())
        # A mean shifted by delta in every dim, std unchanged: n * delta^2 / (2 sigma^2).
        assert value == pytest.approx(n * delta ** 2 / (2 * sigma2), rel=1e-4)
        shifts.append(value)
    assert shifts == sorted(shifts)
    # The gradient points along the shift: a descent step moves the mean back to the anchor's.
    head.zero_grad()
    kl().backward()
    assert torch.allclose(last.bias.grad, torch.full_like(last.bias, 0.2 / sigma2), rtol=1e-4)
    with torch.no_grad():
        last.bias.sub_(0.1 * sigma2 * last.bias.grad)  # half-way back
    assert float(kl().detach()) < shifts[-1]
    # A wider std than the anchor's costs too, and its gradient shrinks it.
    with torch.no_grad():
        last.bias.copy_(s.head.anchor_tensors()[f"mean.{len(head.mean) - 1}.bias"])
        head.log_std.add_(0.3)
    head.zero_grad()
    value = kl()
    assert float(value.detach()) == pytest.approx(n * (-0.3 + 0.5 * (math.exp(0.6) - 1)), rel=1e-4)
    value.backward()
    assert (head.log_std.grad > 0).all()


def test_kl_in_the_loss_and_kl_coef_zero_is_the_plain_ppo_loss(base) -> None:
    s = gaussian(base)
    batch = ppo_batch(s, base, seed=2)
    feats = base.encode(batch.features)
    # The PPO objective written out from evaluate_actions (the loss before the KL term existed).
    lp, ent, value = s.head.evaluate_actions(feats, batch.features, batch.actions_B_H_A)
    ratio = torch.exp(lp - batch.old_log_prob_B)
    adv = batch.advantages_B
    plain = (-torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean() + 0.5 * F.mse_loss(value, batch.returns_B)
             - 0.0 * ent.mean())
    out = s.head.loss(feats, batch, s.generator)
    assert torch.equal(out.loss, plain) and "kl_ref" not in out.metrics
    assert s.head.anchor_tensors() == {}  # nothing taken
    # Holding an anchor changes nothing while kl_coef is 0.
    s.use_anchor(0)
    assert torch.equal(s.head.loss(feats, batch, s.generator).loss, plain)
    # kl_coef > 0 at the anchor: KL 0, the same loss; after a move the term adds kl_coef * KL.
    batch.kl_coef = 0.5
    at = s.head.loss(feats, batch, s.generator)
    assert at.metrics["kl_ref"] == 0.0 and torch.allclose(at.loss, plain)
    with torch.no_grad():
        s.head.mean[-1].bias.add_(0.1)
    moved = s.head.loss(feats, batch, s.generator)
    batch.kl_coef = 0.0
    without = s.head.loss(feats, batch, s.generator)
    assert moved.metrics["kl_ref"] > 0
    assert float(moved.loss) == pytest.approx(float(without.loss) + 0.5 * moved.metrics["kl_ref"], rel=1e-5)


def test_an_anchor_is_taken_only_at_its_version(base) -> None:
    s = gaussian(base)
    batch = ppo_batch(s, base, seed=3, kl_coef=0.1)
    with pytest.raises(InputError, match="no anchor"):
        train_step(base, [(s, batch)])
    s.use_anchor(0)
    train_step(base, [(s, batch)])
    s.use_anchor(0)  # held: kept, though the slot moved on
    assert s.policy_version == 1 and s.anchor_version == 0
    with pytest.raises(InputError, match="anchored at version 5, but the slot is at version 1"):
        s.use_anchor(5)
    s.use_anchor(1)  # the version the slot is at: taken anew
    assert s.anchor_version == 1


def test_checkpoint_restore_keeps_the_anchor_and_the_next_loss(base) -> None:
    a = gaussian(base, seed=4)
    a.use_anchor(0)
    for seed in (5, 6):
        train_step(base, [(a, ppo_batch(a, base, seed, kl_coef=0.2))])
    blob = a.checkpoint()
    assert a.memory_bytes()["buffers"] == a.head.anchor_bytes() > 0
    b = gaussian(base, seed=4)
    b.restore(blob)
    assert b.anchor_version == 0
    assert set(b.head.anchor_tensors()) == set(a.head.anchor_tensors())
    assert all(torch.equal(b.head.anchor_tensors()[k], v) for k, v in a.head.anchor_tensors().items())
    # The exported params never carry it (an inferencer has no use for it).
    assert not any("anchor" in k for k in a._module_tensors())
    nxt = ppo_batch(a, base, seed=7, kl_coef=0.2)
    [ra], [rb] = train_step(base, [(a, nxt)]), train_step(base, [(b, nxt)])
    assert ra.metrics["kl_ref"] > 0 and ra.loss == rb.loss and ra.metrics == rb.metrics
    # A checkpoint from before the anchor restores to no anchor, whatever the slot held.
    c = gaussian(base, seed=4)
    early = c.checkpoint()
    b.restore(early)
    assert b.anchor_version == -1 and b.head.anchor_tensors() == {}
    # Loading params (another version's policy) drops it: it was this slot's own history.
    a.load_params(c.export_params())
    assert a.anchor_version == -1 and a.head.anchor_tensors() == {}


def test_heads_without_a_kl_term_refuse_an_anchor(base) -> None:
    s = TenantSlot.create("t-mlp", libero_schema(horizon=2), base, head_kind="mlp", head_options={"width": 32})
    with pytest.raises(InputError, match="no KL term"):
        s.use_anchor(0)
    assert s.head.anchor_bytes() == 0 and s.anchor_version == -1
