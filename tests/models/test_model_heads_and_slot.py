"""Heads (shapes, math, registry) and tenant slots (export/load, checkpoint, placement)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from models import (
    CheckpointError,
    OptimConfig,
    SchemaError,
    TenantSlot,
    UnknownNameError,
    head_config,
    predict,
    train_step,
)
import numpy as np

from models.testing import calvin_schema, libero_schema, random_batch, random_observations

torch.set_num_threads(1)
SMALL = {"mlp": {"width": 32}, "flow": {"width": 32, "depth": 1, "euler_steps": 3}, "gaussian": {"width": 32}}


def slot(base, kind: str, seed: int = 0, schema=None) -> TenantSlot:
    return TenantSlot.create(f"t-{kind}", schema or libero_schema(), base, head_kind=kind, head_options=SMALL[kind],
                             optim=OptimConfig(lr=1e-3), seed=seed)


@pytest.mark.parametrize("kind", ["mlp", "flow", "gaussian"])
def test_head_loss_and_predict_shapes(base, kind: str) -> None:
    s = slot(base, kind)
    batch = random_batch(s.preprocessor, 3, seed=1)
    feats = base.encode(batch.features)
    out = s.head.loss(feats, batch, s.generator)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss) and out.metrics
    actions = s.head.predict(feats, batch.features, s.generator)
    assert actions.shape == (3, 8, 7) and torch.isfinite(actions).all()
    [acts] = predict(base, [(s, batch.features)])
    assert acts.shape == (3, 8, 7)


def test_gaussian_log_prob_and_entropy_match_torch_normal(base) -> None:
    s = slot(base, "gaussian")
    batch = random_batch(s.preprocessor, 4, seed=2)
    feats = base.encode(batch.features)
    lp, ent, value = s.head.evaluate_actions(feats, batch.features, batch.actions_B_H_A)
    mean = s.head.mean(s.head.trunk(feats, batch.features))
    dist = torch.distributions.Normal(mean, s.head.log_std.exp())
    assert torch.allclose(lp, dist.log_prob(batch.actions_B_H_A.flatten(1)).sum(-1), atol=1e-4)
    assert torch.allclose(ent, dist.entropy().sum(-1), atol=1e-5)
    assert value.shape == (4,)
    # PPO loss path: at ratio 1 the policy gradient is the advantage-weighted log-prob gradient.
    batch.old_log_prob_B = lp.detach()
    batch.advantages_B = torch.randn(4)
    batch.returns_B = torch.randn(4)
    out = s.head.loss(feats, batch, s.generator)
    assert abs(out.metrics["approx_kl"]) < 1e-6 and out.metrics["clip_frac"] == 0.0
    batch.returns_B = None
    with pytest.raises(ValueError, match="must all be set"):
        s.head.loss(feats, batch, s.generator)


def test_flow_uses_k_euler_steps(base, monkeypatch) -> None:
    s = slot(base, "flow")
    vla = random_batch(s.preprocessor, 2, seed=3).features
    calls = []
    orig = s.head.velocity
    monkeypatch.setattr(s.head, "velocity", lambda *a: calls.append(1) or orig(*a))
    s.head.predict(base.encode(vla), vla, s.generator)
    assert len(calls) == 3
    t = s.head.sample_time(10000, torch.Generator().manual_seed(0))
    assert 0 <= float(t.min()) and float(t.max()) <= 1
    # Beta(1.5, 1) on s, t = 1 - s: mean of s is 0.6, so the mean of t is 0.4.
    assert abs(float(t.mean()) - 0.4) < 0.02


def test_registry_errors() -> None:
    with pytest.raises(UnknownNameError, match="registered"):
        head_config("transformer-xl")
    with pytest.raises(SchemaError, match="unknown options"):
        head_config("mlp", {"widht": 3})
    with pytest.raises(SchemaError, match="flow.num_heads"):
        head_config("flow", {"width": 30, "num_heads": 4})


@pytest.mark.parametrize("kind", ["mlp", "flow", "gaussian"])
def test_export_contains_only_the_head_and_loads_bit_exact(base, kind: str) -> None:
    from safetensors.torch import load as st_load

    a = slot(base, kind, seed=1)
    train_step(base, [(a, random_batch(a.preprocessor, 2, seed=4))])
    blob = a.export_params()
    tensors = st_load(blob)
    assert set(tensors) == set(a.head.state_dict())
    base_names = {n for n, _ in base.core.named_parameters()}
    assert not set(tensors) & base_names
    assert not any(k.startswith(("visual", "language_model", "model.")) for k in tensors)
    head_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert len(blob) < head_bytes + 64 * 1024  # header only on top: no base weights hiding
    assert head_bytes < sum(p.numel() * 4 for p in base.core.parameters())
    b = slot(base, kind, seed=2)
    assert not all(torch.equal(x, y) for x, y in zip(a.head.state_dict().values(), b.head.state_dict().values()))
    meta = b.load_params(blob)
    assert meta["policy_version"] == 1 and b.policy_version == 1
    for (k, x), y in zip(a.head.state_dict().items(), b.head.state_dict().values()):
        assert torch.equal(x, y), k


def test_load_params_refuses_mismatches(base) -> None:
    blob = slot(base, "mlp").export_params()
    with pytest.raises(CheckpointError, match="head_kind"):
        slot(base, "flow").load_params(blob)
    with pytest.raises(CheckpointError, match="schema_signature"):
        slot(base, "mlp", schema=calvin_schema()).load_params(blob)
    with pytest.raises(CheckpointError):
        slot(base, "mlp").load_params(b"not safetensors")
    with pytest.raises(CheckpointError, match="format"):
        slot(base, "mlp").load_params(slot(base, "mlp").checkpoint())


@pytest.mark.parametrize("kind", ["flow", "gaussian"])
def test_checkpoint_restore_continues_identically(base, kind: str) -> None:
    ref = slot(base, kind, seed=5)
    batches = [random_batch(ref.preprocessor, 2, seed=10 + i) for i in range(4)]
    for b in batches[:2]:
        train_step(base, [(ref, b)])
    ckpt = ref.checkpoint()
    assert b"pickle" not in ckpt[:200]
    resumed = slot(base, kind, seed=99)
    resumed.restore(ckpt)
    assert resumed.step_count == 2 and resumed.policy_version == 2
    ra = [train_step(base, [(ref, b)])[0].loss for b in batches[2:]]
    rb = [train_step(base, [(resumed, b)])[0].loss for b in batches[2:]]
    assert ra == rb
    for x, y in zip(ref.head.state_dict().values(), resumed.head.state_dict().values()):
        assert torch.equal(x, y)


def test_offload_and_memory_report(base) -> None:
    s = slot(base, "flow")
    train_step(base, [(s, random_batch(s.preprocessor, 2, seed=6))])
    mem = s.memory_bytes()
    assert mem["params"] > 0 and mem["optimizer"] >= 2 * mem["params"] and mem["total"] == sum(
        v for k, v in mem.items() if k != "total")
    s.offload()
    assert s.device.type == "cpu"
    s.to("cpu")  # on a GPU host: s.to("cuda") before the next step; the step must not mind
    train_step(base, [(s, random_batch(s.preprocessor, 2, seed=7))])
    assert s.step_count == 2


def test_lr_schedule() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [cfg.lr_at(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert abs(cfg.lr_at(9) - 0.55) < 1e-9 and abs(cfg.lr_at(14) - 0.1) < 1e-9 and cfg.lr_at(100) == cfg.lr_at(14)
    with pytest.raises(SchemaError, match="optim.lr"):
        OptimConfig(lr=0)


@pytest.mark.parametrize("kind,options", [
    ("mlp", {"width": 32, "image_channels": 8}),
    ("mlp", {"width": 32, "image_channels": 4, "image_pool": "keypoints", "instruction_encoder": True}),
    ("gaussian", {"width": 32, "image_channels": 4, "image_pool": "keypoints", "instruction_encoder": True}),
])
def test_head_image_and_instruction_encoders_train_and_export(base, kind, options) -> None:
    s = TenantSlot.create("t-cnn", libero_schema(), base, head_kind=kind, head_options=options,
                          optim=OptimConfig(lr=1e-3), seed=0)
    assert any(k.startswith("image_encoder.") for k in s.head.state_dict())
    batch = random_batch(s.preprocessor, 3, seed=1)
    watched = {k: v.detach().clone() for k, v in s.head.named_parameters()
               if k.startswith(("image_encoder.convs.0.", "instruction_encoder.", "image_encoder.film."))}
    train_step(base, [(s, batch)])
    params = dict(s.head.named_parameters())
    for k, before in watched.items():
        # The frames, and the instruction (directly and through FiLM), reach the loss.
        assert not torch.equal(before, params[k]), k
    if options.get("instruction_encoder"):
        assert any(k.startswith("image_encoder.film.") for k in watched)
        # Same frames and state, another instruction: another action.
        obs = random_observations(s.schema, 1, np.random.default_rng(3))[0]
        a = predict(base, [(s, s.preprocessor([obs]))])[0]
        obs.instruction = "zzz" if obs.instruction != "zzz" else "yyy"
        b = predict(base, [(s, s.preprocessor([obs]))])[0]
        assert not torch.allclose(a, b)
    other = TenantSlot.create("t-cnn", libero_schema(), base, head_kind=kind, head_options=options, seed=5)
    other.load_params(s.export_params())
    for k, v in s.head.state_dict().items():
        assert torch.equal(v, other.head.state_dict()[k])
    with pytest.raises(ValueError, match="image_channels"):
        TenantSlot.create("t-bad", libero_schema(), base, head_kind=kind, head_options={"image_channels": -1})
    with pytest.raises(ValueError, match="image_pool"):
        TenantSlot.create("t-bad", libero_schema(), base, head_kind=kind, head_options={"image_pool": "max"})


def test_mlp_use_state_false_ignores_the_state(base) -> None:
    s = TenantSlot.create("t-nostate", libero_schema(), base, head_kind="mlp",
                          head_options={"width": 32, "use_state": False}, seed=0)
    batch = random_batch(s.preprocessor, 2, seed=1)
    feats = base.encode(batch.features)
    a = s.head.predict(feats, batch.features, s.generator)
    batch.features.state_B_D.add_(5.0)
    assert torch.equal(a, s.head.predict(feats, batch.features, s.generator))


def test_lr_schedule_starts_at_schedule_start():
    """A tenant's next workload gets its own warmup and cosine: the schedule counts from
    ``schedule_start`` (the tenant's version when the workload was accepted)."""
    from models.slot import OptimConfig

    first = OptimConfig(lr=1e-3, warmup_steps=2, total_steps=10)
    again = OptimConfig(lr=1e-3, warmup_steps=2, total_steps=10, schedule_start=10)
    assert [again.lr_at(10 + s) for s in range(12)] == [first.lr_at(s) for s in range(12)]
    assert first.lr_at(15) == pytest.approx(1e-4) and again.lr_at(11) == pytest.approx(1e-3)
    with pytest.raises(Exception, match="schedule_start"):
        OptimConfig(schedule_start=-1)
