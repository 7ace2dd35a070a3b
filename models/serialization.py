"""Bytes formats for tenant weights and checkpoints: safetensors + JSON metadata, never pickle.

Exported params (`FORMAT_PARAMS`) hold the tenant module's tensors only; a checkpoint
(`FORMAT_CHECKPOINT`) adds optimizer moments, step counters and the slot's RNG state.
safetensors metadata is str -> str, so structured fields are stored as canonical JSON.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from models.errors import CheckpointError

FORMAT_PARAMS = "vla-nexus/tenant-params/1"
FORMAT_CHECKPOINT = "vla-nexus/tenant-checkpoint/1"


def dump(tensors: dict[str, torch.Tensor], meta: dict[str, Any], fmt: str) -> bytes:
    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    header = {"format": fmt, "meta": json.dumps(meta, sort_keys=True, separators=(",", ":"))}
    return st_save(flat, metadata=header)


def load(data: bytes, fmt: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CheckpointError(f"expected bytes, got {type(data).__name__}")
    try:
        # Each tensor safetensors loads is a torch.frombuffer view of a Python bytearray it
        # allocated (a storage torch does not own: freed through Python refcounting, under the
        # GIL, by whichever thread drops it last). Cloned so every tensor owns torch memory:
        # `TenantSlot.restore` hands the AdamW moments and step to the optimizer as they are
        # (on CPU ``.to(device)`` and ``load_state_dict`` copy nothing), and every later step
        # then wrote in place into those Python buffers from the training thread (issue 24,
        # a hazard removed while hunting heap corruption). One copy of a checkpoint per
        # restore; the params are copied again into the slot's own tensors.
        tensors = {k: v.clone() for k, v in st_load(bytes(data)).items()}
        header = _read_header(bytes(data))
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt input
        raise CheckpointError(f"not a safetensors payload: {e}") from None
    got = header.get("format")
    if got != fmt:
        raise CheckpointError(f"payload format {got!r}, expected {fmt!r}")
    return tensors, json.loads(header.get("meta", "{}"))


def _read_header(data: bytes) -> dict[str, str]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]).get("__metadata__", {}) or {}
