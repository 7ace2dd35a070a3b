"""What the inferencer holds between a request's arrival and its reply (`Pending`, one queue per
compatibility key), and the pure helpers a group's forward uses: capture sizes, side streams,
LoRA segments and slot runs. Used by `inferencer.py` and `forward.py`."""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from protocol.errors import NexusError
from protocol.messages import PredictRequest


@dataclass
class Pending:
    """One logical request: the first message and any retries of it (same request id) that
    arrived while it was held. One forward, one reply, sent to all of them."""

    req: PredictRequest
    msg: Any
    slot: Any = None
    version: int = 0
    arrived: float = 0.0  # monotonic
    # Monotonic: past it no caller waits any more (a retry that joins extends it).
    expires: float | None = None
    key: tuple[str, str] | None = None  # (tenant, request_id); None: no dedup
    reply: Any = None
    joined: list[Any] = field(default_factory=list)  # retries' messages
    # Tracing: the request's `inferencer.predict` span, wall-clock stamps of its own stages
    # and the stamps its group shares (`_stage_spans` turns them into the stage spans).
    span: Any = None
    arrived_ns: int = 0
    enqueued_ns: int = 0
    stamps: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if self.expires is None:
            self.expires = self.arrived + self.req.timeout_s


@dataclass
class KeyQueue:
    items: deque = field(default_factory=deque)

# Steps of 1.5x above 8: a group of 17-24 rows (common at 8 tenants x 8 clients) no longer pays
# for the 32-row graph.
CAPTURE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
# Throwaway heads the warm-up builds to learn the registered tenants' head shapes (one per
# distinct head config): tenants may register many configs; the rest warm at their first group.
WARM_HEAD_BUILDS = 64


def fast_engine_for(source: str) -> bool:
    """Whether the fast engine exists for this base (models.fast: Qwen3-VL): a preset's family,
    or a directory's config.json model_type."""
    from models.presets import PRESETS

    if source in PRESETS:
        return PRESETS[source].family == "qwen3_vl"
    try:
        import json

        return str(json.loads((Path(source) / "config.json").read_text()).get("model_type", "")).startswith("qwen3_vl")
    except (OSError, ValueError):
        return False


def warmup_row(pre: Any, schema: Any, device: Any) -> Any:
    """One canonical row of a tenant's layout (its preprocessor and schema) from a blank
    observation: black frames, zero state."""
    from models import Observation

    obs = Observation(images={c.name: np.zeros((c.height, c.width, 3), np.uint8) for c in schema.cameras},
                      state=np.zeros(schema.state_dim, np.float32), instruction="warm up")
    return pre([obs], device=device)


def pad_to_capture_size(packed: Any) -> Any:
    """Repeat the last row up to the next capture size; the extra rows' outputs are ignored."""
    from models import VLABatch

    n = len(packed)
    target = next(c for c in CAPTURE_SIZES if c >= n)
    if target == n:
        return packed
    last = packed.index(slice(n - 1, n))
    return VLABatch.cat([packed] + [last] * (target - n))


@functools.lru_cache(maxsize=None)
def side_stream(device: Any) -> Any:
    """The canonicalise stage's CUDA stream for ``device`` (None off CUDA)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return torch.cuda.Stream(device)


def on_stream(stream: Any) -> Any:
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


def lora_segments(group: list[Pending], live: list[int]) -> list[Any]:
    """Row segments of the packed group whose slot has a LoRA adapter (rows of one slot are
    contiguous; padding rows past ``live`` get none): LoRA and frozen-base tenants share the
    forward, each adapter adds its delta to its own rows only (models/lora.py)."""
    segments = (slot.adapter_segment(start, end, train=False) for start, end, slot in slot_runs(group, live))
    return [seg for seg in segments if seg is not None]


def slot_runs(group: list[Pending], live: list[int]) -> list[tuple[int, int, Any]]:
    """(start, end, slot) of each run of packed rows ``live[start:end]`` served by one slot:
    a group is packed slot by slot, so each slot's rows are contiguous."""
    runs: list[tuple[int, int, Any]] = []
    start = 0
    while start < len(live):
        slot = group[live[start]].slot
        end = start
        while end < len(live) and group[live[end]].slot is slot:
            end += 1
        runs.append((start, end, slot))
        start = end
    return runs


def input_error(exc: Exception) -> NexusError:
    from protocol.errors import InvalidField

    text = str(exc)
    field, _, rest = text.partition(": ")
    return InvalidField(field if rest else "observation", rest or text)
