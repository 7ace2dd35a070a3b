"""Mixed-adapter grouped forward (segmented LoRA): four tenants in one base forward (two LoRA
ranks, one frozen base, one LoRA tenant of another schema), grouped == serial within 1e-5 on
CPU fp32 for losses, gradients and 20 steps of parameters; gradients reach only each tenant's
own adapter; frozen rows get no delta; an export loads with peft's `PeftModel.from_pretrained`
on a second copy of the base and gives the same hidden states."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from models import BaseConfig, BaseModel, CheckpointError, OptimConfig, SchemaError, TenantSlot, train_step
from models.group import encode_grouped, encode_serial
from models.lora import AdapterConfig, adapter_errors, router_for
from models.testing import calvin_schema, libero_schema, random_batch
from tests.models.grouping import (assert_losses_match, assert_params_match, backward_first_only, backward_matches_serial,
                                   batches, rel, start_adapters_off_zero)

torch.set_num_threads(1)

STEPS = 20
TOL = 1e-5
# (tenant, schema, head, seed, adapter)
TENANTS = [
    ("lora-r4", libero_schema(), "mlp", 21, AdapterConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))),
    ("lora-r8", libero_schema(), "gaussian", 22,
     AdapterConfig(rank=8, target_modules=("q_proj", "k_proj", "o_proj", "down_proj"), dropout=0.1)),
    ("frozen", libero_schema(), "flow", 23, None),
    ("mixed-schema", calvin_schema(), "flow", 24, AdapterConfig(rank=2, alpha=4.0, target_modules=("up_proj",))),
]
# LoRA tenants use heads without attention key biases: a key bias has an exactly zero gradient
# (softmax ignores a constant shift), so AdamW turns its rounding noise (1e-9, present once the
# features carry adapter deltas summed in another order) into full-size steps, grouped or not.
HEAD_OPTIONS = {"mlp": {"width": 32}, "flow": {"width": 32, "depth": 1}, "gaussian": {"width": 32}}


def make_slots(base: BaseModel) -> list[TenantSlot]:
    optim = OptimConfig(lr=3e-3, warmup_steps=2, total_steps=STEPS)
    return start_adapters_off_zero([
        TenantSlot.create(t, schema, base, head_kind=head, head_options=HEAD_OPTIONS[head], optim=optim, seed=seed,
                          adapter=adapter) for t, schema, head, seed, adapter in TENANTS])


def test_all_four_share_one_key(base: BaseModel) -> None:
    slots = make_slots(base)
    assert len({s.key for s in slots}) == 1
    assert [s.adapter is not None for s in slots] == [True, True, False, True]


def test_grouped_equals_serial_losses_and_gradients(base: BaseModel) -> None:
    g = backward_matches_serial(base, make_slots, TOL)
    for gs in g:
        if gs.adapter is not None:
            assert all(a.grad is not None and float(a.grad.abs().sum()) > 0 for a in gs.adapter.lora_A), gs.tenant_id


def test_grouped_equals_serial_for_20_steps(base: BaseModel) -> None:
    runs = []
    start = [[p.detach().clone() for _, p in s.named_trainable()] for s in make_slots(base)]
    for grouped in (True, False):
        slots = make_slots(base)
        losses = [[] for _ in slots]
        for step in range(STEPS):
            for i, r in enumerate(train_step(base, batches(slots, step), grouped=grouped)):
                losses[i].append(r.loss)
        runs.append((slots, losses))
    (g_slots, g_losses), (s_slots, s_losses) = runs
    assert_params_match(g_slots, s_slots, TOL, STEPS)
    for gs, gl, sl, p0s in zip(g_slots, g_losses, s_losses, start):
        assert_losses_match(gl, sl, TOL, gs.tenant_id)
        for (name, p), p0 in zip(gs.named_trainable(), p0s):
            if name.startswith("adapter."):  # the adapters did train
                assert not torch.equal(p.detach(), p0), (gs.tenant_id, name)


def test_gradient_reaches_only_own_adapter_and_never_the_base(base: BaseModel) -> None:
    # Only lora-r4's loss goes backward: no other adapter or head may see a gradient.
    first = backward_first_only(base, make_slots(base))
    assert all(p.grad is not None for name, p in first.named_trainable() if p.requires_grad and "adapter" in name)


def test_frozen_rows_get_no_delta_and_the_frozen_path_is_unchanged(base: BaseModel) -> None:
    slots = make_slots(base)
    router = router_for(base)
    vlas = [b.features for _, b in batches(slots, 5)]
    before = router.calls
    plain = encode_serial(base, [vlas[2]])[0]
    with_frozen_only = encode_grouped(base, [vlas[2]], slots=[slots[2]])[0]
    assert router.calls == before  # a group with no adapter computes no delta
    torch.testing.assert_close(with_frozen_only.hidden_B_L_D, plain.hidden_B_L_D, rtol=0, atol=0)
    mixed = encode_grouped(base, vlas, slots=slots, inference=True)
    torch.testing.assert_close(mixed[2].hidden_B_L_D, plain.hidden_B_L_D, rtol=TOL, atol=TOL)
    # two layers x (2 + 4 + 1) adapted modules: one delta per adapted module per LoRA segment
    assert router.calls - before == 2 * (2 + 4 + 1)
    # and the adapters do change their own rows
    assert rel(mixed[0].hidden_B_L_D, encode_serial(base, [vlas[0]])[0].hidden_B_L_D) > 1e-4


def test_checkpoint_and_export_carry_the_adapter(base: BaseModel) -> None:
    slots = make_slots(base)
    for step in range(2):
        train_step(base, batches(slots, step), grouped=True)
    src = slots[1]
    fresh = make_slots(base)[1]
    fresh.restore(src.checkpoint())
    for (n, a), (_, b) in zip(src.named_trainable(), fresh.named_trainable()):
        assert torch.equal(a, b), n
    # same moments: one more identical step keeps them identical
    items = batches([src], 9)
    train_step(base, items, grouped=False)
    train_step(base, [(fresh, items[0][1])], grouped=False)
    for (n, a), (_, b) in zip(src.named_trainable(), fresh.named_trainable()):
        assert torch.equal(a, b), n
    other = make_slots(base)[1]
    other.load_params(src.export_params())
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(src.named_trainable(), other.named_trainable()))
    with pytest.raises(CheckpointError, match="base_adapter"):
        make_slots(base)[0].load_params(src.export_params(), strict_schema=False)


def test_export_loads_with_peft_from_pretrained(base: BaseModel, tmp_path) -> None:
    from peft import PeftModel

    slots = make_slots(base)
    for step in range(2):
        train_step(base, batches(slots, step), grouped=True)
    slot = slots[1]
    slot.export_peft(tmp_path / "adapter")
    vla = batches(slots, 7)[1][1].features
    ours = encode_grouped(base, [vla], slots=[slot], inference=True)[0].hidden_B_L_D
    # "Outside the service": a second copy of the same base (same preset and seed), plain peft.
    copy = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu"))
    peft_model = PeftModel.from_pretrained(copy.core, str(tmp_path / "adapter"))
    adapted = sorted(n.removesuffix(".base_layer") for n, m in peft_model.named_modules() if n.endswith(".base_layer"))
    assert [n.removeprefix("base_model.model.") for n in adapted] == sorted(slot.adapter.paths)
    peft_model.eval()
    inputs = copy.build_inputs(vla)
    with torch.no_grad():
        theirs = copy.family.forward(peft_model, inputs)
        plain = base.encode(vla).hidden_B_L_D
    assert rel(ours, theirs) < TOL
    assert rel(ours, plain) > 1e-4
    # An adapter exported for another base is refused, naming both bases.
    other = BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=64, device="cpu", seed=5))
    target = TenantSlot.create("x", libero_schema(), other, head_kind="flow", head_options=HEAD_OPTIONS["flow"],
                               adapter=TENANTS[1][4])
    with pytest.raises(CheckpointError, match=r"exported for base .*seed0.*this slot's base is .*seed5"):
        target.load_peft(tmp_path / "adapter")
    with pytest.raises(CheckpointError, match=r"exported for base .*seed0.*this slot's base is .*seed5"):
        target.load_params(slot.export_params())


def test_bad_adapter_configs_name_the_field_and_what_the_base_allows(base: BaseModel) -> None:
    shapes = router_for(base).shapes
    errs = adapter_errors(shapes, {"kind": "lora", "rank": 4, "target_modules": ["q_proj", "qkv"]})
    assert errs and errs[0][0] == "base_adapter.target_modules[1]" and "down_proj" in errs[0][1]
    errs = adapter_errors(shapes, {"kind": "lora", "rank": 0, "target_modules": ["k_proj"]})
    assert errs[0][0] == "base_adapter.rank" and "1..32" in errs[0][1]  # k_proj: 64 -> 32
    errs = adapter_errors(shapes, {"kind": "lora", "rank": 65, "target_modules": ["q_proj"]})
    assert errs[0][0] == "base_adapter.rank" and "1..64" in errs[0][1]
    assert adapter_errors(shapes, {"kind": "lora", "rank": 64, "target_modules": ["q_proj"]}) == []
    with pytest.raises(SchemaError, match="base_adapter.target_modules"):
        TenantSlot.create("x", libero_schema(), base, adapter=AdapterConfig(rank=2, target_modules=("fc9",)))


@pytest.mark.parametrize("preset", ["tiny-paligemma", "tiny-smolvlm"])
def test_other_families_group_and_load_with_peft(preset: str, tmp_path) -> None:
    """PaliGemma (OpenPI's base) and SmolVLM: the same hooks on their decoders (language_model,
    text_model), grouped == serial, and peft reproduces the export."""
    from peft import PeftModel

    fam_base = BaseModel.load(BaseConfig(preset, device="cpu"))
    lora = TenantSlot.create("l", libero_schema(), fam_base, head_kind="mlp", seed=1,
                             adapter=AdapterConfig(rank=4, alpha=8.0, target_modules=("q_proj", "gate_proj")))
    frozen = TenantSlot.create("f", libero_schema(), fam_base, head_kind="mlp", seed=2)
    with torch.no_grad():
        for b in lora.adapter.lora_B:
            b.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    vlas = [random_batch(s.preprocessor, 1, seed=i).features for i, s in enumerate((lora, frozen))]
    grouped = encode_grouped(fam_base, vlas, slots=[lora, frozen], inference=True)
    serial = encode_serial(fam_base, vlas, slots=[lora, frozen], inference=True)
    for g, s in zip(grouped, serial):
        assert rel(g.hidden_B_L_D, s.hidden_B_L_D) < TOL
    lora.export_peft(tmp_path / "a")
    copy = BaseModel.load(BaseConfig(preset, device="cpu"))
    peft_model = PeftModel.from_pretrained(copy.core, str(tmp_path / "a")).eval()
    with torch.no_grad():
        theirs = copy.family.forward(peft_model, copy.build_inputs(vlas[0]))
    assert rel(grouped[0].hidden_B_L_D, theirs) < TOL
    assert rel(grouped[0].hidden_B_L_D, fam_base.encode(vlas[0]).hidden_B_L_D) > 1e-4
