"""Check a training micro-batch against its tenant's schema before it enters the queue.

Pure numpy, no torch: the master validates every `queue_put` so bad data is refused at the
door with an error naming the field, instead of failing a job on the trainer later.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protocol.errors import InvalidField, MissingField
from protocol.messages import QueuePutRequest

# One micro-batch larger than this is a mistake (the reference micro-batch is 128).
MAX_BATCH = 1024


def _array(field: str, value: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        # torch tensors decode as tensors; take their numpy view without copying.
        try:
            value = value.numpy()
        except (AttributeError, TypeError):  # TypeError: a bfloat16 tensor has no numpy dtype
            raise InvalidField(field, f"must be an array, got {type(value).__name__}") from None
    return value


def _expect(field: str, arr: np.ndarray, shape: tuple[int, ...], dtype: str) -> None:
    if arr.dtype.name != dtype:
        raise InvalidField(field, f"dtype {arr.dtype.name}, the tenant schema needs {dtype}")
    if arr.shape != shape:
        raise InvalidField(field, f"shape {arr.shape}, the tenant schema needs {shape}")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise InvalidField(field, "contains NaN or inf")


def validate_put(req: QueuePutRequest, schema: dict[str, Any], task: str) -> int:
    """Raise a field error if ``req`` does not fit ``schema``; return the batch size B."""
    b = len(req.instructions)
    if not 1 <= b <= MAX_BATCH:
        raise InvalidField("instructions", f"{b} rows; a micro-batch holds 1..{MAX_BATCH}")
    if not all(isinstance(t, str) and t for t in req.instructions):
        raise InvalidField("instructions", "every row needs a non-empty instruction string")
    cameras = {c["name"]: c for c in schema["cameras"]}
    for name in req.images:
        if name not in cameras:
            raise InvalidField(f"images.{name}", f"unknown camera; the tenant schema has {sorted(cameras)}")
    for name, cam in cameras.items():
        if name not in req.images:
            raise MissingField(f"images.{name}", "camera declared by the tenant schema is missing")
        _expect(f"images.{name}", _array(f"images.{name}", req.images[name]),
                (b, cam["height"], cam["width"], 3), "uint8")
    _expect("state", _array("state", req.state), (b, schema["state_dim"]), "float32")
    _expect("actions", _array("actions", req.actions), (b, schema["action_horizon"], schema["action_dim"]), "float32")
    rl_fields = {"old_log_prob": req.old_log_prob, "advantages": req.advantages, "returns": req.returns}
    if task == "rl":
        for name, value in rl_fields.items():
            if value is None:
                raise MissingField(name, "RL jobs need old_log_prob, advantages and returns")
            _expect(name, _array(name, value), (b,), "float32")
        if req.behaviour_version < 0:
            raise InvalidField("behaviour_version", "RL data must say which policy version produced it (>= 0)")
    else:
        for name, value in rl_fields.items():
            if value is not None:
                raise InvalidField(name, "only RL jobs carry this; this is an SFT job")
    return b
