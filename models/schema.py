"""Tenant schema, canonical feature layout, schema signature and compatibility key.

A tenant declares what its robot produces (`TenantSchema`); the base declares what its forward
consumes (`FeatureLayout`). Both are frozen, validated at construction, and hash to the same
digest in any process: the digest is sha256 over canonical JSON (sorted keys, no whitespace,
ints and strings only), never Python's salted `hash()`.

    schema = TenantSchema(cameras=(CameraSpec("agentview", 128, 128),), state_dim=8,
                          action_dim=7, action_horizon=8,
                          instruction_template="What action should the robot take to {instruction}?")
    schema.signature()  # 'sha256:…', stable across processes and machines

Only batches whose `CompatibilityKey`s are equal may share one base forward (`models.group`).
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from dataclasses import dataclass
from typing import Any

from models.errors import SchemaError

# Bumped when the canonical JSON of a schema changes meaning; part of every signature.
SCHEMA_VERSION = 1
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
# Camera sizes beyond this are almost certainly a units bug (bytes, not pixels).
_MAX_SIDE_PX = 4096
_MAX_DIM = 1024
_MAX_HORIZON = 256
# Cameras per tenant: each is a camera slot of every row the tenant sends through the shared
# base (and of the inferencer's warm-up at every capture size); robot datasets use 1-4.
MAX_CAMERAS = 8


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: the same bytes for equal values everywhere."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def sha256_digest(obj: Any) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(obj).encode("ascii")).hexdigest()


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    # bool is an int subclass; True as a state_dim is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise SchemaError(f"{name}={value!r}: must be an int in [{lo}, {hi}]")


@dataclass(frozen=True)
class CameraSpec:
    """One camera of a tenant: its name and the raw frame size (pixels) it sends."""

    name: str
    height: int
    width: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise SchemaError(
                f"cameras[].name={self.name!r}: must match {_NAME_RE.pattern} (letters, digits, _ . -)"
            )
        _check_int(f"cameras[{self.name}].height", self.height, 1, _MAX_SIDE_PX)
        _check_int(f"cameras[{self.name}].width", self.width, 1, _MAX_SIDE_PX)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "height": self.height, "width": self.width}


@dataclass(frozen=True)
class TenantSchema:
    """What one tenant's observations and actions look like.

    `cameras` is ordered: camera i fills canonical camera slot i.
    `instruction_template` must contain `{instruction}` exactly once and no other field.
    """

    cameras: tuple[CameraSpec, ...]
    state_dim: int
    action_dim: int
    action_horizon: int
    instruction_template: str = "{instruction}"

    def __post_init__(self) -> None:
        cams = self.cameras
        if isinstance(cams, list):
            cams = tuple(cams)
        if not isinstance(cams, tuple) or not cams:
            raise SchemaError(f"cameras={self.cameras!r}: must be a non-empty list of (name, height, width)")
        if len(cams) > MAX_CAMERAS:
            raise SchemaError(f"cameras: {len(cams)} declared; allowed: at most {MAX_CAMERAS}")
        cams = tuple(c if isinstance(c, CameraSpec) else _camera_from_any(c) for c in cams)
        names = [c.name for c in cams]
        if len(set(names)) != len(names):
            raise SchemaError(f"cameras: names must be unique, got {names}")
        object.__setattr__(self, "cameras", cams)
        _check_int("state_dim", self.state_dim, 0, _MAX_DIM)
        _check_int("action_dim", self.action_dim, 1, _MAX_DIM)
        _check_int("action_horizon", self.action_horizon, 1, _MAX_HORIZON)
        _check_template(self.instruction_template)

    @property
    def camera_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.cameras)

    def to_dict(self) -> dict[str, Any]:
        """Canonical dict: the only input of `signature()`."""
        return {
            "schema_version": SCHEMA_VERSION,
            "cameras": [c.to_dict() for c in self.cameras],
            "state_dim": self.state_dim,
            "action_dim": self.action_dim,
            "action_horizon": self.action_horizon,
            "instruction_template": self.instruction_template,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TenantSchema":
        known = {"schema_version", "cameras", "state_dim", "action_dim", "action_horizon", "instruction_template"}
        unknown = set(d) - known
        if unknown:
            raise SchemaError(f"unknown schema fields {sorted(unknown)}; allowed: {sorted(known)}")
        version = d.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise SchemaError(f"schema_version={version!r}: this code reads version {SCHEMA_VERSION}")
        missing = {"cameras", "state_dim", "action_dim", "action_horizon"} - set(d)
        if missing:
            raise SchemaError(f"missing schema fields {sorted(missing)}")
        return cls(
            cameras=tuple(_camera_from_any(c) for c in d["cameras"]),
            state_dim=d["state_dim"],
            action_dim=d["action_dim"],
            action_horizon=d["action_horizon"],
            instruction_template=d.get("instruction_template", "{instruction}"),
        )

    def signature(self) -> str:
        """sha256 of the canonical JSON: equal schemas give equal signatures in any process."""
        return sha256_digest(self.to_dict())


def _camera_from_any(c: Any) -> CameraSpec:
    if isinstance(c, CameraSpec):
        return c
    if isinstance(c, dict):
        try:
            return CameraSpec(c["name"], c["height"], c["width"])
        except KeyError as e:
            raise SchemaError(f"cameras[]: missing key {e.args[0]!r}; need name, height, width") from None
    if isinstance(c, (tuple, list)) and len(c) == 3:
        return CameraSpec(*c)
    raise SchemaError(f"cameras[]={c!r}: must be (name, height, width) or a dict with those keys")


def _check_template(template: Any) -> None:
    if not isinstance(template, str) or len(template) > 2048:
        raise SchemaError("instruction_template: must be a string of at most 2048 characters")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise SchemaError(f"instruction_template={template!r}: not a valid format string ({e})") from None
    if fields != ["instruction"]:
        raise SchemaError(
            f"instruction_template={template!r}: must contain '{{instruction}}' exactly once and no other "
            f"field, found fields {fields}"
        )


@dataclass(frozen=True)
class FeatureLayout:
    """The canonical, model-facing shape of one sample. Everything here fixes tensor shapes.

    image_size: (H, W) every camera slot is resized to (the base's resolution).
    camera_slots: number of ordered camera slots; absent ones are masked.
    max_prompt_tokens: prompt ids are truncated/padded to this many (fixed length = no ragged batch).
    num_query_tokens: action-query tokens appended after the prompt (OFT-style readout positions).
    max_state_dim: proprio state is zero-padded to this with a mask.
    """

    image_size: tuple[int, int]
    camera_slots: int = 2
    max_prompt_tokens: int = 48
    num_query_tokens: int = 8
    max_state_dim: int = 32

    def __post_init__(self) -> None:
        size = tuple(self.image_size)
        if len(size) != 2:
            raise SchemaError(f"layout.image_size={self.image_size!r}: must be (height, width)")
        object.__setattr__(self, "image_size", size)
        _check_int("layout.image_size[0]", size[0], 8, _MAX_SIDE_PX)
        _check_int("layout.image_size[1]", size[1], 8, _MAX_SIDE_PX)
        _check_int("layout.camera_slots", self.camera_slots, 1, 16)
        _check_int("layout.max_prompt_tokens", self.max_prompt_tokens, 1, 4096)
        _check_int("layout.num_query_tokens", self.num_query_tokens, 1, 256)
        _check_int("layout.max_state_dim", self.max_state_dim, 1, _MAX_DIM)

    def to_dict(self) -> dict[str, Any]:
        return {
            "image_size": list(self.image_size),
            "camera_slots": self.camera_slots,
            "max_prompt_tokens": self.max_prompt_tokens,
            "num_query_tokens": self.num_query_tokens,
            "max_state_dim": self.max_state_dim,
        }


@dataclass(frozen=True)
class CompatibilityKey:
    """Requests share one base forward only when their keys are equal.

    base_id names the exact resident weights (preset name or directory + config digest) and the
    compute dtype; layout fixes every tensor shape of the base input. Tenant-level choices that do
    not change the base input's shape or the base weights (template text, action head, action
    dims) are deliberately not part of the key, so different tenants can share.
    """

    base_id: str
    dtype: str
    layout: FeatureLayout

    def to_dict(self) -> dict[str, Any]:
        return {"base_id": self.base_id, "dtype": self.dtype, "layout": self.layout.to_dict()}

    @property
    def digest(self) -> str:
        return sha256_digest(self.to_dict())

    def __str__(self) -> str:
        return f"{self.base_id}/{self.dtype}/{self.digest[7:19]}"
