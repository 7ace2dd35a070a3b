"""pi0-style action experts on the shared per-layer prefix KV cache (models/heads/expert.py), on
both OpenPI's base (PaliGemma) and Qwen3-VL: five tenants share one base forward (an expert
with the base's depth, a shallower expert of another schema with more query heads per KV head,
an expert with a LoRA adapter on the base, a LoRA tenant with an mlp head and a frozen-base
flow tenant); grouped == serial within 1e-5 (CPU fp32) for losses, gradients, several steps
of parameters and Euler-sampled actions; the cache is computed once for all rows; gradients
reach only each tenant's own modules; options that cannot read the base's cache are refused
naming the field and what the base allows."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from models import BaseConfig, BaseModel, CheckpointError, OptimConfig, SchemaError, TenantSlot, predict, train_step
from models.errors import InputError
from models.group import encode_grouped
from models.heads.expert import base_expert_errors, expert_errors
from models.lora import AdapterConfig
from models.testing import calvin_schema, libero_schema, random_batch
from tests.models.grouping import (BATCH, assert_losses_match, assert_params_match, backward_first_only,
                                   backward_matches_serial, batches, rel, start_adapters_off_zero)

torch.set_num_threads(1)

STEPS = 8
TOL = 1e-5
PRESETS = ("tiny-paligemma", "tiny-qwen3-vl")
LORA = AdapterConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


def tenants(base: BaseModel) -> list[tuple]:
    att = base.attention_shape()
    return [  # (tenant, schema, head, options, seed, adapter)
        ("expert", libero_schema(), "expert", {"width": 32, "euler_steps": 3}, 31, None),
        ("expert-shallow", calvin_schema(), "expert",
         {"width": 24, "depth": 1, "num_heads": 2 * att.kv_heads, "mlp_width": 48, "euler_steps": 2}, 32, None),
        ("expert-lora", libero_schema(), "expert", {"width": 16, "euler_steps": 2}, 33, LORA),
        ("lora-mlp", libero_schema(), "mlp", {"width": 32}, 34, LORA),
        ("frozen", libero_schema(), "flow", {"width": 32, "depth": 1}, 35, None),
    ]


@pytest.fixture(scope="module", params=PRESETS)
def base(request) -> BaseModel:
    return BaseModel.load(BaseConfig(request.param, image_size=64, device="cpu"))


def make_slots(base: BaseModel) -> list[TenantSlot]:
    optim = OptimConfig(lr=3e-3, warmup_steps=2, total_steps=STEPS)
    return start_adapters_off_zero([
        TenantSlot.create(t, schema, base, head_kind=head, head_options=opts, optim=optim, seed=seed, adapter=adapter)
        for t, schema, head, opts, seed, adapter in tenants(base)])


def test_the_cache_is_computed_once_for_all_rows(base: BaseModel) -> None:
    slots = make_slots(base)
    calls = []
    handle = base.core.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        feats = encode_grouped(base, [b.features for _, b in batches(slots, 0)], slots=slots, inference=True)
    finally:
        handle.remove()
    assert len(calls) == 1
    att = base.attention_shape()
    for f in feats:
        assert f.prefix is not None and len(f.prefix.keys) == att.layers
        assert tuple(f.prefix.keys[0].shape) == (BATCH, att.kv_heads, f.mask_B_L.shape[1], att.head_dim)
    # A group without experts asks for no cache.
    plain = encode_grouped(base, [b.features for _, b in batches(slots[3:], 0)], slots=slots[3:])
    assert all(f.prefix is None for f in plain)
    assert [s.head.layer_map for s in slots[:3]] == [list(range(att.layers)), [att.layers - 1],
                                                      list(range(att.layers))]


def test_grouped_equals_serial_losses_and_gradients(base: BaseModel) -> None:
    g = backward_matches_serial(base, make_slots, TOL)
    # Every expert layer's attention weights learn from the cache they read.
    for gs in g[:3]:
        for layer in gs.head.layers:
            assert float(layer.q.weight.grad.abs().max()) > 0, gs.tenant_id
    # The expert with a LoRA adapter trains its adapter through the cache of its own rows.
    assert all(float(a.grad.abs().max()) > 0 for a in g[2].adapter.lora_A)
    assert all(p.grad is None for p in base.core.parameters())


def test_grouped_equals_serial_for_several_steps_and_sampling(base: BaseModel) -> None:
    runs = []
    for grouped in (True, False):
        slots = make_slots(base)
        losses = [[r.loss for r in train_step(base, batches(slots, step), grouped=grouped)] for step in range(STEPS)]
        actions = predict(base, [(s, b.features) for s, b in batches(slots, 99)], grouped=grouped)
        runs.append((slots, losses, actions))
    (g_slots, g_losses, g_actions), (s_slots, s_losses, s_actions) = runs
    for step, (gl, sl) in enumerate(zip(g_losses, s_losses)):
        assert_losses_match(gl, sl, TOL, step)
    assert_params_match(g_slots, s_slots, TOL, STEPS)
    for gs, a, b in zip(g_slots, g_actions, s_actions):
        assert a.shape == (BATCH, gs.schema.action_horizon, gs.schema.action_dim)
        assert rel(a, b) < TOL, (gs.tenant_id, rel(a, b))


def test_only_own_expert_gets_gradients(base: BaseModel) -> None:
    first = backward_first_only(base, make_slots(base))
    assert all(float(layer.k.weight.grad.abs().max()) > 0 for layer in first.head.layers)


def test_the_expert_reads_the_prefix_and_not_its_padding(base: BaseModel) -> None:
    slot = make_slots(base)[0]
    full = random_batch(slot.preprocessor, 1, seed=7).features
    vla = type(full)(**{**vars(full), "prompt_len_B": torch.full_like(full.prompt_len_B, 10)})  # a 10-token prompt

    def act(v) -> torch.Tensor:
        slot.generator.manual_seed(0)
        return predict(base, [(slot, v)])[0]

    ref = act(vla)
    n = int(vla.prompt_len_B[0])
    padded, changed = vla.prompt_ids_B_T.clone(), vla.prompt_ids_B_T.clone()
    padded[0, n:] = 7  # masked prompt padding: the cache holds it, the mask hides it
    changed[0, 0] = int(changed[0, 0]) % 200 + 5  # a real prompt token
    assert n < vla.prompt_ids_B_T.shape[1]
    same = act(type(vla)(**{**vars(vla), "prompt_ids_B_T": padded}))
    other = act(type(vla)(**{**vars(vla), "prompt_ids_B_T": changed}))
    torch.testing.assert_close(same, ref, rtol=1e-6, atol=1e-6)
    assert rel(other, ref) > 1e-4


def test_rope_continues_the_prefix_positions(base: BaseModel) -> None:
    slot = make_slots(base)[0]
    vla = random_batch(slot.preprocessor, 2, seed=3).features
    inputs = base.build_inputs(vla)
    pos = inputs.kwargs["position_ids"]
    prefix = encode_grouped(base, [vla], slots=[slot])[0].prefix
    # The last token is an action-query token (never masked, text): the next position follows it.
    last = pos[..., -1].reshape(-1, 2)
    assert torch.equal(prefix.next_pos_B, last[0] + 1) and bool((last == last[0]).all())
    # The expert's rotary table at a text position is the base's own, M-RoPE axes included.
    rotary = getattr(base.core, base.family.text_decoder).rotary_emb
    cos_b, sin_b = rotary(torch.empty(0), pos)
    cos_e, sin_e = prefix.rope(pos.reshape(-1, 2, pos.shape[-1])[0][:, -1:])
    torch.testing.assert_close(cos_e, cos_b[:, -1:].float(), rtol=0, atol=1e-7)
    torch.testing.assert_close(sin_e, sin_b[:, -1:].float(), rtol=0, atol=1e-7)


def test_export_and_checkpoint_carry_the_expert(base: BaseModel) -> None:
    slots = make_slots(base)
    train_step(base, batches(slots, 0))
    src = slots[0]
    other = TenantSlot.create("expert", src.schema, base, head_kind="expert", head_options={"width": 32, "euler_steps": 3},
                              seed=99)
    other.load_params(src.export_params())
    vla = random_batch(src.preprocessor, 2, seed=5).features
    src.generator.manual_seed(1)
    other.generator.manual_seed(1)
    torch.testing.assert_close(predict(base, [(other, vla)])[0], predict(base, [(src, vla)])[0], rtol=0, atol=0)
    assert any(k.startswith("layers.0.q.") for k in src.head.state_dict())
    restored = TenantSlot.create("expert", src.schema, base, head_kind="expert",
                                 head_options={"width": 32, "euler_steps": 3}, seed=5)
    restored.restore(src.checkpoint())
    assert restored.step_count == 1 and restored.optimizer.state
    # The same shapes on another base (another preset's weights) read another cache: refused.
    name = "tiny-qwen3-vl-64" if base.family.name == "qwen3_vl" else "tiny-paligemma"
    elsewhere = BaseModel.load(BaseConfig(name, image_size=64, device="cpu", seed=1))
    stranger = TenantSlot.create("expert", src.schema, elsewhere, head_kind="expert",
                                 head_options={"width": 32, "euler_steps": 3})
    with pytest.raises(CheckpointError, match="expert payload was exported for base 'preset:"):
        stranger.load_params(src.export_params())


def test_features_without_the_cache_are_refused(base: BaseModel) -> None:
    slot = make_slots(base)[0]
    vla = random_batch(slot.preprocessor, 1, seed=1).features
    with pytest.raises(InputError, match="prefix KV"):
        slot.head.predict(base.encode(vla), vla, slot.generator)


def test_options_that_cannot_read_the_cache_name_the_field_and_what_the_base_allows() -> None:
    errs = dict((f, m) for f, m, _ in base_expert_errors("qwen3-vl-4b", {"depth": 5, "head_dim": 64, "num_heads": 12}))
    assert errs["action_module.params.depth"].startswith("5 expert layers cannot map onto this base's 36 text layers; "
                                                         "allowed: 1, 2, 3, 4, 6, 9, 12, 18, 36")
    assert errs["action_module.params.head_dim"] == "64 cannot read this base's KV cache; allowed: 128 (the base's head_dim)"
    assert errs["action_module.params.num_heads"].startswith("12 query heads cannot share this base's 8 KV heads; "
                                                             "allowed: a multiple of 8")
    assert base_expert_errors("qwen3-vl-4b", {"depth": 9, "num_heads": 16, "width": 512}) == []
    (field, msg, _), = base_expert_errors("tiny-paligemma", {"width": 0})
    assert field == "action_module.params.width" and "> 0" in msg
    (field, msg, _), = base_expert_errors("tiny-smolvlm", {})
    assert field == "action_module.kind" and "paligemma, qwen3_vl" in msg
    (field, _, _), = expert_errors(BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu")).attention_shape(),
                                   {"depth": 2, "wdith": 3})
    assert field == "action_module.params.wdith"
    base = BaseModel.load(BaseConfig("tiny-paligemma", image_size=64, device="cpu"))
    with pytest.raises(SchemaError, match=r"expert.depth: 3 expert layers cannot map onto this base's 2 text layers"):
        TenantSlot.create("x", libero_schema(), base, head_kind="expert", head_options={"depth": 3})
