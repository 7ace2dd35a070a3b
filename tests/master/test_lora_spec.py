"""`base_adapter` in the workload spec: parsed, compiled into the TenantConfig, and checked
against the base's own layers (unknown target module, rank 0 or above the layer width) with
errors naming the field and what the base allows. No NATS, no weights."""

from __future__ import annotations

import pytest

from master.spec import SpecError, compile_tenant, load_document, parse_spec
from protocol.messages import TenantConfig

EXAMPLE = "examples/sft_reach.yaml"


def spec_with(adapter: dict | None) -> dict:
    doc = load_document(open(EXAMPLE).read())
    if adapter is not None:
        doc["base_adapter"] = adapter
    return doc


def test_compiles_with_alpha_resolved_and_defaults() -> None:
    cfg = compile_tenant(parse_spec(spec_with({"kind": "lora", "rank": 4})))
    assert cfg.base_adapter == {"kind": "lora", "rank": 4, "alpha": 4.0, "target_modules": ["q_proj", "v_proj"],
                                "dropout": 0.0}
    assert compile_tenant(parse_spec(spec_with(None))).base_adapter == {}


@pytest.mark.parametrize("adapter, field", [
    ({"kind": "lora", "rank": 0}, "base_adapter.rank"),
    ({"kind": "lora", "rank": 4, "target_modules": []}, "base_adapter.target_modules"),
    ({"kind": "dora", "rank": 4}, "base_adapter.kind"),
    ({"kind": "lora", "rank": 4, "dropout": 1.0}, "base_adapter.dropout"),
    ({"kind": "lora", "rank": 4, "scale": 2}, "base_adapter.scale"),
])
def test_bad_fields_are_named(adapter: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec_with(adapter))
    assert field in [e["field"] for e in err.value.errors], err.value.errors


def test_checked_against_the_base_layers() -> None:
    from master.tenant_checks import adapter_errors

    def cfg(adapter: dict) -> TenantConfig:
        return TenantConfig(name="t", base="tiny-qwen3-vl-64", schema={}, base_adapter=adapter)

    assert adapter_errors(cfg({"kind": "lora", "rank": 8, "target_modules": ["q_proj", "down_proj"]})) == []
    (field, message, value), = adapter_errors(cfg({"kind": "lora", "rank": 4, "target_modules": ["q_proj", "qkv"]}))
    assert field == "base_adapter.target_modules[1]" and value == "qkv"
    assert "allowed: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in message
    (field, message, _), = adapter_errors(cfg({"kind": "lora", "rank": 33, "target_modules": ["k_proj"]}))
    assert field == "base_adapter.rank" and "allowed for this base: 1..32" in message
