"""Tenant schema validation, signature stability (also across processes), compatibility keys."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from models import CameraSpec, FeatureLayout, SchemaError, TenantSchema
from models.schema import CompatibilityKey
from models.testing import calvin_schema, libero_schema



def test_equal_schemas_equal_signatures() -> None:
    a = libero_schema()
    b = TenantSchema.from_dict(a.to_dict())
    assert a == b and a.signature() == b.signature()
    assert a.signature().startswith("sha256:") and len(a.signature()) == 7 + 64
    assert a.signature() != calvin_schema().signature()
    # Lists and dicts are accepted for cameras and canonicalized.
    c = TenantSchema(cameras=[{"name": "agentview", "height": 128, "width": 128}, ("wrist", 128, 128)],
                     state_dim=8, action_dim=7, action_horizon=8,
                     instruction_template="What action should the robot take to {instruction}?")
    assert c.signature() == a.signature()


@pytest.mark.parametrize("field,value", [
    ("state_dim", 9), ("action_dim", 6), ("action_horizon", 4), ("instruction_template", "do {instruction}"),
])
def test_every_field_changes_the_signature(field: str, value) -> None:
    d = libero_schema().to_dict() | {field: value}
    assert TenantSchema.from_dict(d).signature() != libero_schema().signature()


def test_camera_order_changes_the_signature() -> None:
    a = libero_schema()
    b = TenantSchema(cameras=tuple(reversed(a.cameras)), state_dim=8, action_dim=7, action_horizon=8,
                     instruction_template=a.instruction_template)
    assert a.signature() != b.signature()


def test_signature_same_in_a_fresh_process() -> None:
    code = "from models.testing import libero_schema; print(libero_schema().signature())"
    env = dict(os.environ, PYTHONHASHSEED="12345", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == libero_schema().signature()


@pytest.mark.parametrize("kwargs,needle", [
    (dict(cameras=()), "cameras"),
    (dict(cameras=(("bad name!", 64, 64),)), "cameras[].name"),
    (dict(cameras=(("a", 0, 64),)), "cameras[a].height"),
    (dict(cameras=(("a", 64, 64), ("a", 32, 32))), "unique"),
    (dict(state_dim=-1), "state_dim"),
    (dict(state_dim=True), "state_dim"),
    (dict(action_dim=0), "action_dim"),
    (dict(action_horizon=1000), "action_horizon"),
    (dict(instruction_template="no field"), "instruction_template"),
    (dict(instruction_template="{instruction} {other}"), "instruction_template"),
    (dict(instruction_template="{instruction} {instruction}"), "instruction_template"),
    (dict(instruction_template="{instruction"), "instruction_template"),
])
def test_validation_errors_name_the_field(kwargs, needle: str) -> None:
    base = dict(cameras=(("a", 64, 64),), state_dim=8, action_dim=7, action_horizon=8,
                instruction_template="{instruction}")
    with pytest.raises(SchemaError) as e:
        TenantSchema(**(base | kwargs))
    assert needle in str(e.value)
    assert isinstance(e.value, ValueError)


def test_from_dict_rejects_unknown_and_missing_fields() -> None:
    d = libero_schema().to_dict()
    with pytest.raises(SchemaError, match="unknown schema fields"):
        TenantSchema.from_dict(d | {"fps": 10})
    d.pop("state_dim")
    with pytest.raises(SchemaError, match="missing schema fields"):
        TenantSchema.from_dict(d)
    with pytest.raises(SchemaError, match="schema_version"):
        TenantSchema.from_dict(libero_schema().to_dict() | {"schema_version": 99})


def test_compatibility_key_equality_and_digest() -> None:
    lay = FeatureLayout(image_size=(224, 224))
    a = CompatibilityKey("preset:x", "bfloat16", lay)
    b = CompatibilityKey("preset:x", "bfloat16", FeatureLayout(image_size=(224, 224)))
    assert a == b and hash(a) == hash(b) and a.digest == b.digest
    for other in [CompatibilityKey("preset:y", "bfloat16", lay), CompatibilityKey("preset:x", "float32", lay),
                  CompatibilityKey("preset:x", "bfloat16", FeatureLayout(image_size=(224, 224), camera_slots=3))]:
        assert other != a and other.digest != a.digest
    with pytest.raises(SchemaError, match="layout.camera_slots"):
        FeatureLayout(image_size=(224, 224), camera_slots=0)


def test_camera_spec_direct() -> None:
    assert CameraSpec("wrist", 84, 84).to_dict() == {"name": "wrist", "height": 84, "width": 84}
