"""Many tenants' plain `mlp` heads as one computation a CUDA graph can hold (issue 27 item 4).

A group's heads differ per tenant (weights, and shapes between schemas), so a graph that
contains them cannot bake any one in. As `models.lora.AdapterPool` does for LoRA, every
resident head of one shape (`HeadShape`) sits stacked in a `HeadBucket` at fixed addresses
(index 0 zeros, refreshed in place when a head's weights change: a weight sync's load, by the
parameters' version counters), and each row of the group carries its head's index into each
bucket (0 where the row's head is of another shape). `pooled_mlp` is `MLPHead.forward` with
every weight gathered per row and applied as batched matmuls: one more static input and one
more output of the fast engine's graph (models/fast.py), so a group's base forward and its
heads replay as one graph. A row's actions come from its own bucket's output; what the other
buckets compute for it (zeros weights) is discarded.

Only heads whose forward is the plain path qualify (`poolable`): `mlp` without its own image
encoder or instruction encoder (those read frames and prompts through modules of their own).
Any other head in a group, or action-expert rows (the prefix cache), keep the per-tenant heads.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from models.errors import SchemaError

# Heads resident per shape: a group has at most 32 rows by default (NEXUS_INFER_MAX_BATCH_SIZE),
# so at most 32 heads; a group with more of one shape keeps the per-tenant path. Each place
# costs the head's parameters once more in float32 (~5 MB for a width-256 head on qwen3-vl-4b).
HEAD_POOL = 32
# Shapes (buckets) per engine: tenants choose their heads' widths, depths and action shapes, so
# without a bound their variety alone would allocate bucket after bucket; past it a group with
# a new shape runs its heads after the forward.
HEAD_SHAPES_MAX = 8


@dataclass(frozen=True)
class HeadShape:
    hidden: int
    queries: int
    width: int
    depth: int
    state_dim: int  # 0: the head does not read the state
    horizon: int
    action_dim: int


def poolable(head: Any) -> bool:
    from models.heads.mlp import MLPHead

    return (type(head) is MLPHead and head.image_encoder is None and head.instruction_encoder is None)


def shape_of(head: Any) -> HeadShape:
    d, c = head.dims, head.config
    return HeadShape(d.hidden_size, d.num_queries, c.width, c.depth,
                     d.state_dim if (d.state_dim and c.use_state) else 0, d.action_horizon, d.action_dim)


def _signature(head: Any) -> tuple:
    return tuple((p._version, p.data_ptr()) for p in head.parameters())


class HeadBucket:
    """Stacked parameters of the resident heads of one shape, (capacity + 1) each, float32."""

    def __init__(self, shape: HeadShape, capacity: int, device: torch.device) -> None:
        s, n = shape, capacity + 1
        z = lambda *dims: torch.zeros(n, *dims, device=device)  # noqa: E731
        self.shape = shape
        self.capacity = capacity
        self.norm_w, self.norm_b = z(s.hidden), z(s.hidden)
        self.q_w, self.q_b = z(s.width, s.hidden), z(s.width)
        wq = s.width * s.queries
        self.s_w, self.s_b = (z(wq, s.state_dim), z(wq)) if s.state_dim else (None, None)
        sizes = [wq] + [s.width] * s.depth + [s.horizon * s.action_dim]
        self.trunk = [(z(o, i), z(o)) for i, o in zip(sizes, sizes[1:])]
        self._entries: dict[int, list] = {}  # id(head) -> [weakref, index, signature], least recent first
        self.copies = 0

    def tensors(self) -> tuple:
        return (self.norm_w, self.norm_b, self.q_w, self.q_b, self.s_w, self.s_b, tuple(self.trunk))

    def assign(self, heads: Sequence[Any]) -> dict[int, int] | None:
        """Each head's index (every one resident and fresh); None past the capacity."""
        for k in [k for k, e in self._entries.items() if e[0]() is None]:
            del self._entries[k]
        wanted = {id(h): h for h in heads}
        if len(wanted) > self.capacity:
            return None
        out: dict[int, int] = {}
        for key, head in wanted.items():
            e = self._entries.pop(key, None)
            if e is None or e[0]() is not head:
                e = [weakref.ref(head), self._free(set(wanted)), None]
            self._entries[key] = e
            sig = _signature(head)
            if e[2] != sig:
                self._copy(head, e[1])
                e[2] = sig
            out[key] = e[1]
        return out

    def _free(self, keep: set[int]) -> int:
        used = {e[1] for e in self._entries.values()}
        free = [i for i in range(1, self.capacity + 1) if i not in used]
        if free:
            return free[0]
        victim = next(k for k in self._entries if k not in keep)
        return self._entries.pop(victim)[1]

    def _copy(self, head: Any, i: int) -> None:
        with torch.no_grad():
            self.norm_w[i].copy_(head.norm.weight)
            self.norm_b[i].copy_(head.norm.bias)
            self.q_w[i].copy_(head.query_proj.weight)
            self.q_b[i].copy_(head.query_proj.bias)
            if self.s_w is not None:
                self.s_w[i].copy_(head.state_proj.weight)
                self.s_b[i].copy_(head.state_proj.bias)
            linears = [m for m in head.trunk if isinstance(m, torch.nn.Linear)]
            for (w, b), m in zip(self.trunk, linears, strict=True):
                w[i].copy_(m.weight)
                b[i].copy_(m.bias)
        self.copies += 1


def pooled_mlp(tensors: tuple, shape: HeadShape, query_B_Q_D: torch.Tensor, state_B_D: torch.Tensor,
               idx: torch.Tensor) -> torch.Tensor:
    """`MLPHead.forward` for every row with row ``n``'s head at index ``idx[n]`` of the bucket
    (float32, as the head runs): actions (B, horizon, action_dim)."""
    norm_w, norm_b, q_w, q_b, s_w, s_b, trunk = tensors
    x = F.layer_norm(query_B_Q_D.float(), (shape.hidden,))
    x = x * norm_w[idx][:, None] + norm_b[idx][:, None]
    q = torch.baddbmm(q_b[idx][:, None], x, q_w[idx].transpose(1, 2))  # (B, Q, width)
    x = F.gelu(q).flatten(1)
    if s_w is not None:
        st = state_B_D[:, : shape.state_dim].float()
        x = x + torch.baddbmm(s_b[idx][:, None], st[:, None], s_w[idx].transpose(1, 2))[:, 0]
    for j, (w, b) in enumerate(trunk):
        x = torch.baddbmm(b[idx][:, None], x[:, None], w[idx].transpose(1, 2))[:, 0]
        if j < len(trunk) - 1:
            x = F.gelu(x)
    return x.view(-1, shape.horizon, shape.action_dim)


class HeadPool:
    """Buckets per head shape on one device; `plan` maps a group's runs of rows to them.

    Every plan covers every bucket (rows of other shapes index 0), so one graph per (layout,
    rows, `generation`) serves any mix of resident heads; a new shape adds a bucket and bumps
    the generation (the engine captures again, as for a grown adapter pool)."""

    def __init__(self, device: torch.device, capacity: int = HEAD_POOL, max_shapes: int = HEAD_SHAPES_MAX) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise SchemaError(f"head pool capacity={capacity!r}: must be an integer >= 1")
        self.device = torch.device(device)
        self.capacity = capacity
        self.max_shapes = max_shapes
        self.buckets: dict[HeadShape, HeadBucket] = {}
        self.generation = 0
        self.fallbacks = 0  # groups refused (a bucket full)

    def plan(self, runs: Sequence[tuple[int, int, Any]], rows: int) -> "HeadPlan | None":
        """For rows [start, end) served by each run's head: every bucket's per-row indices and
        which bucket holds each run's head; None when a head is not poolable, a bucket is full or
        a new shape would pass `max_shapes`."""
        by_shape: dict[HeadShape, list[tuple[int, int, Any]]] = {}
        for start, end, head in runs:
            if not poolable(head):
                return None
            by_shape.setdefault(shape_of(head), []).append((start, end, head))
        if len(self.buckets.keys() | by_shape.keys()) > self.max_shapes:
            self.fallbacks += 1
            return None
        with torch.inference_mode(False), torch.no_grad():
            for shape in by_shape:
                if shape not in self.buckets:
                    self.buckets[shape] = HeadBucket(shape, self.capacity, self.device)
                    self.generation += 1
            shapes = list(self.buckets)
            idx = [torch.zeros(rows, dtype=torch.int64) for _ in shapes]
            for shape, members in by_shape.items():
                index = self.buckets[shape].assign([h for _, _, h in members])
                if index is None:
                    self.fallbacks += 1
                    return None
                t = idx[shapes.index(shape)]
                for start, end, head in members:
                    t[start:end] = index[id(head)]
        where = [shapes.index(shape_of(head)) for _, _, head in runs]
        return HeadPlan(self.generation, tuple(shapes), tuple(self.buckets[s].tensors() for s in shapes), idx, where)


@dataclass
class HeadPlan:
    """What the engine runs after the base: per bucket its shape, tensors and per-row indices
    (CPU int64, copied into the graph's static inputs); ``bucket_of_run[k]``: run k's bucket."""

    generation: int
    shapes: tuple[HeadShape, ...]
    tensors: tuple
    idx: list[torch.Tensor]
    bucket_of_run: list[int]
