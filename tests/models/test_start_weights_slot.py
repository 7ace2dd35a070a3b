"""`TenantSlot.load_start` (a tenant's own starting weights): a LoRA tenant's head and its
adapter in peft's format load exactly; a file whose adapter has another rank names the tensor
and both shapes; a head-only file for a LoRA spec names the adapter tensors it lacks."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as st_load

from models import BaseConfig, BaseModel, CheckpointError, TenantSlot
from models.testing import libero_schema


@pytest.fixture(scope="module")
def base():
    return BaseModel.load(BaseConfig(source="tiny-qwen3-vl-64", device="cpu"))


def test_head_and_peft_adapter_start_exactly_and_misfits_are_named(base) -> None:
    schema = libero_schema(horizon=2)
    src = TenantSlot.create("a", schema, base, head_kind="mlp", seed=1, adapter={"rank": 4})
    with torch.no_grad():  # B starts at zero in peft: make the adapter non-trivial
        for _, p in src.adapter.named_parameters():
            p.add_(0.01)
    exported = st_load(src.export_params())
    dst = TenantSlot.create("b", schema, base, head_kind="mlp", seed=2, adapter={"rank": 4})
    assert any(not torch.equal(v, dst._module_tensors()[k]) for k, v in exported.items())
    dst.load_start(exported)
    mine = dst._module_tensors()
    assert set(mine) == set(exported) and all(torch.equal(mine[k], v) for k, v in exported.items())
    assert dst.policy_version == 0

    other_rank = TenantSlot.create("c", schema, base, head_kind="mlp", seed=2, adapter={"rank": 8})
    with pytest.raises(CheckpointError, match=r"lora_A\.weight': uploaded shape \(4, \d+\), the spec's action "
                                              r"module has \(8, \d+\)"):
        other_rank.load_start(exported)
    head_only = {k: v for k, v in exported.items() if "lora_" not in k}
    with pytest.raises(CheckpointError, match=r"lora_A\.weight' of the spec's action module \(shape \(4, \d+\)\) is "
                                              "missing from the upload"):
        dst.load_start(head_only)
