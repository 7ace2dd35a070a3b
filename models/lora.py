"""Per-tenant LoRA adapters on the shared frozen base: segmented LoRA inside one base forward.

    cfg = AdapterConfig(rank=8, target_modules=("q_proj", "v_proj"))
    slot = TenantSlot.create("acme", schema, base, adapter=cfg)     # the slot owns its adapter
    train_step(base, [(slot, batch), (frozen_slot, batch2)])        # one base forward for both
    slot.export_peft("out/acme")    # adapter_config.json + adapter_model.safetensors (peft)
    PeftModel.from_pretrained(copy_of_base.core, "out/acme")       # same outputs outside the service

How rows of many tenants share the base (the Punica / S-LoRA idea): every adaptable linear
layer of the base's language model carries one forward hook (`LoraRouter`, installed the first
time a slot with an adapter is built on that base; a base without LoRA tenants has no hooks).
The group forward sets the row assignment for the duration of one forward (`router.route`):
contiguous row segments, each with its tenant's adapter. The base's matmul runs once on all
rows; the hook then adds, per segment whose adapter adapts this layer,
``dropout(x[rows]) @ A^T @ B^T * alpha / rank`` to those rows only. Rows of tenants without an
adapter get nothing computed for them. Rows never mix inside the language model (attention,
norms and MLPs are per sample), so a tenant's loss has exactly zero gradient with respect to
another tenant's adapter: one backward over the summed losses gives each adapter its own.

peft semantics: A (r, in) kaiming-uniform with a=sqrt(5), B (out, r) zeros, scaling alpha / r,
dropout on the adapter's input only, the delta computed in the adapter's dtype (float32) and
added in the base's. Targets are matched as peft matches a list (the module path equals the
name or ends in ``.name``) but only inside the language model's decoder layers: the vision
tower runs on patches, not on a tenant's rows. Exports name tensors as peft does
(``base_model.model.<module path>.lora_A.weight``) and write a peft `LoraConfig` whose
``target_modules`` is a regex that selects exactly the adapted modules.

Dropout noise is drawn from a device generator seeded from the slot's generator once per
step, so a grouped and a serial step drop the same entries.

On the fast engine (models/fast.py, `BaseConfig(fast=True)`), inference groups take another
form of the same assignment, one that CUDA graphs and compiled blocks can replay: an int64
adapter index per row (0 = frozen base) and an `AdapterPool` holding every resident adapter's
A and B (scaled) stacked per adapted linear at fixed addresses, refreshed in place whenever an
adapter's weights change (a weight sync's `load_params`, a checkpoint, an optimizer step: the
tensors' version counters say so); the delta is gather + bmm (`pooled_delta`) and the hooks
compute nothing. Training forwards on the fast engine (issue 27 item 1) take the same layout
built from the tenants' own parameters (`training_stack`: stacked, padded and cast inside the
autograd graph), uncaptured (eager or compiled blocks), so each adapter's gradient reaches its
own A and B; adapters that train with dropout keep the segmented hooks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import threading
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from models.errors import CheckpointError, InputError, SchemaError

LORA = "lora"
PEFT_PREFIX = "base_model.model."
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterConfig:
    """A tenant's adapter on the base (the spec's `base_adapter`). alpha None = rank."""

    rank: int
    alpha: float | None = None
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0
    kind: str = LORA

    def __post_init__(self) -> None:
        if self.kind != LORA:
            raise SchemaError(f"base_adapter.kind={self.kind!r}: allowed {LORA!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise SchemaError(f"base_adapter.rank={self.rank!r}: must be an integer >= 1")
        if self.alpha is not None and not self.alpha > 0:
            raise SchemaError(f"base_adapter.alpha={self.alpha!r}: must be > 0 or None (= rank)")
        if not 0 <= self.dropout < 1:
            raise SchemaError(f"base_adapter.dropout={self.dropout!r}: must be in [0, 1)")
        targets = tuple(self.target_modules)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise SchemaError(f"base_adapter.target_modules={list(targets)!r}: a non-empty list of module names")
        object.__setattr__(self, "target_modules", targets)

    @property
    def scaling(self) -> float:
        return float(self.alpha if self.alpha is not None else self.rank) / self.rank

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "AdapterConfig | None":
        """The TenantConfig's `base_adapter` ({} or None: no adapter); unknown keys are an error."""
        if not d:
            return None
        allowed = {"kind", "rank", "alpha", "target_modules", "dropout"}
        unknown = set(d) - allowed
        if unknown:
            raise SchemaError(f"base_adapter: unknown fields {sorted(unknown)}; allowed: {sorted(allowed)}")
        if "rank" not in d:
            raise SchemaError("base_adapter.rank: required")
        return cls(**{**d, "target_modules": tuple(d.get("target_modules", ("q_proj", "v_proj")))})

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["target_modules"] = list(self.target_modules)
        return out


# ---- which layers of a base can be adapted ------------------------------------------------
def decoder_linears(core: nn.Module, decoder: str) -> dict[str, nn.Linear]:
    """Linear layers inside the language model's decoder layers (``<decoder>.layers.<i>.``), in
    forward order: the only ones that see whole samples as rows."""
    prefix = f"{decoder}.layers."
    return {name: mod for name, mod in core.named_modules()
            if isinstance(mod, nn.Linear) and name.startswith(prefix)}


def warmup_adapter(base: Any, cfg: dict[str, Any] | AdapterConfig) -> "LoraAdapter":
    """A throwaway adapter of a tenant's config on ``base`` (B zeros, as peft starts): what an
    inferencer warms its adapted graphs with before the tenant's weights are there; the pool
    keys graphs by rank and adapted linears, never by the weights."""
    acfg = AdapterConfig.from_dict(cfg) if isinstance(cfg, dict) else cfg
    shapes = router_for(base).shapes
    return LoraAdapter(acfg, {p: shapes[p] for p in target_paths(shapes, acfg)}, device=base.device)


def _matches(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)  # peft's rule for a list of names


def adapter_errors(shapes: dict[str, tuple[int, int]], cfg: dict[str, Any] | AdapterConfig,
                   field_prefix: str = "base_adapter") -> list[tuple[str, str, Any]]:
    """(field, message, value) for each way an adapter config does not fit a base whose adaptable
    layers have ``shapes`` (path -> (in, out)); [] when it fits."""
    d = cfg.to_dict() if isinstance(cfg, AdapterConfig) else dict(cfg)
    names = sorted({p.rsplit(".", 1)[-1] for p in shapes})
    errors: list[tuple[str, str, Any]] = []
    targets = list(d.get("target_modules") or [])
    for i, t in enumerate(targets):
        if not isinstance(t, str) or not any(_matches(p, t) for p in shapes):
            errors.append((f"{field_prefix}.target_modules[{i}]", f"{t!r} is no linear layer of this base's language "
                           f"model; allowed: {', '.join(names)}", t))
    rank = d.get("rank")
    chosen = [shapes[p] for p in shapes if any(isinstance(t, str) and _matches(p, t) for t in targets)]
    width = min((min(s) for s in chosen), default=min((min(s) for s in shapes.values()), default=0))
    if isinstance(rank, int) and not isinstance(rank, bool) and not 1 <= rank <= width:
        errors.append((f"{field_prefix}.rank", f"{rank} is out of range; allowed for this base: 1..{width} (the "
                       "narrowest adapted layer's width)", rank))
    if not errors:
        try:
            AdapterConfig.from_dict(d)
        except SchemaError as exc:
            text = str(exc)
            name, _, rest = text.partition(": ")
            errors.append((name.partition("=")[0], rest or text, d))
    return errors


def target_paths(shapes: dict[str, Any], cfg: AdapterConfig) -> list[str]:
    paths = [p for p in shapes if any(_matches(p, t) for t in cfg.target_modules)]
    if not paths:
        raise SchemaError(f"base_adapter.target_modules={list(cfg.target_modules)}: no linear layer of this base's "
                          f"language model matches; allowed: {sorted({p.rsplit('.', 1)[-1] for p in shapes})}")
    width = min(min(shapes[p]) for p in paths)
    if cfg.rank > width:
        raise SchemaError(f"base_adapter.rank={cfg.rank}: above the narrowest adapted layer's width; allowed 1..{width}")
    return paths


def peft_target_regex(paths: Sequence[str]) -> str:
    """A regex that peft full-matches against module names: exactly ``paths`` (as a family of
    layer indices and leaf names, so it stays short for a 36-layer base)."""
    by_shape: dict[str, set[str]] = {}
    for p in paths:
        by_shape.setdefault(re.sub(r"\.layers\.\d+\.", ".layers.{i}.", p), set()).add(p.split(".layers.", 1)[1].split(".", 1)[0])
    alts = []
    for shape, layers in sorted(by_shape.items()):
        head, tail = shape.split("{i}")
        alts.append(re.escape(head) + "(?:" + "|".join(sorted(layers, key=int)) + ")" + re.escape(tail))
    return "(?:" + "|".join(alts) + ")"


# ---- one tenant's adapter --------------------------------------------------------------------
class LoraAdapter(nn.Module):
    """A (r, in) and B (out, r) per adapted layer; parameters in float32."""

    def __init__(self, cfg: AdapterConfig, shapes: dict[str, tuple[int, int]], device: torch.device | str | None = None
                 ) -> None:
        super().__init__()
        self.config = cfg
        self.paths = list(shapes)
        self.index = {p: i for i, p in enumerate(self.paths)}
        self.shapes = dict(shapes)
        self.lora_A = nn.ParameterList([nn.Parameter(torch.empty(cfg.rank, shapes[p][0], device=device))
                                        for p in self.paths])
        self.lora_B = nn.ParameterList([nn.Parameter(torch.zeros(shapes[p][1], cfg.rank, device=device))
                                        for p in self.paths])
        for a in self.lora_A:
            # nn.Linear's default init, as peft (and microsoft/LoRA) initialise A; B stays zero.
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self._flat = [*self.lora_A, *self.lora_B]

    def signature(self) -> tuple:
        """Changes whenever a weight does: every in-place write (a weight load, an optimizer
        step, ``copy_``) bumps a tensor's version counter, and a move gives it new storage.
        What `AdapterPool` compares to know its copy of this adapter is stale."""
        return tuple((p._version, p.data_ptr()) for p in self._flat)

    @property
    def scaling(self) -> float:
        return self.config.scaling

    def delta(self, i: int, x: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        a, b = self.lora_A[i], self.lora_B[i]
        x = x.to(a.dtype)
        p = self.config.dropout
        if gen is not None and p > 0:
            keep = torch.rand(x.shape, generator=gen, device=x.device) >= p
            x = x * keep / (1 - p)
        return (x @ a.t()) @ b.t() * self.scaling

    # -- peft's on-disk format ----------------------------------------------------------
    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for p, a, b in zip(self.paths, self.lora_A, self.lora_B):
            out[f"{PEFT_PREFIX}{p}.lora_A.weight"] = a
            out[f"{PEFT_PREFIX}{p}.lora_B.weight"] = b
        return out

    def load_peft_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        own = self.peft_state_dict()
        if set(tensors) != set(own):
            missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
            raise CheckpointError(f"adapter keys differ: missing {missing[:3]}, unexpected {extra[:3]}")
        for k, v in tensors.items():
            if v.shape != own[k].shape:
                raise CheckpointError(f"adapter tensor {k}: shape {tuple(v.shape)}, the slot has {tuple(own[k].shape)}")
        with torch.no_grad():
            for k, t in own.items():
                t.copy_(tensors[k].to(t.dtype))

    def peft_config(self, base_id: str) -> dict[str, Any]:
        """peft's adapter_config.json content for this adapter (via peft's own LoraConfig)."""
        from peft import LoraConfig

        cfg = LoraConfig(r=self.config.rank, lora_alpha=float(self.config.alpha or self.config.rank),
                         lora_dropout=self.config.dropout, target_modules=peft_target_regex(self.paths),
                         bias="none", init_lora_weights=True, base_model_name_or_path=base_id)
        return cfg.to_dict()


def is_adapter_key(key: str) -> bool:
    return key.startswith(PEFT_PREFIX)


def write_peft_dir(path: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (what `PeftModel.from_pretrained` reads)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    for k, v in cfg.items():  # peft writes sets as lists
        if isinstance(v, set):
            cfg[k] = sorted(v)
    (out / PEFT_CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(out / PEFT_WEIGHTS_FILE),
              metadata={"format": "pt"})
    return out


def read_peft_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    p = Path(path)
    try:
        config = json.loads((p / PEFT_CONFIG_FILE).read_text())
        tensors = load_file(str(p / PEFT_WEIGHTS_FILE))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{p}: not a peft adapter directory ({exc})") from None
    return config, tensors


# ---- the row -> adapter assignment of one forward -------------------------------------------
@dataclass
class Segment:
    """Rows [start, end) of one forward use ``adapter``; ``gen`` draws its dropout (training)."""

    start: int
    end: int
    adapter: LoraAdapter
    gen: torch.Generator | None = None


@dataclass
class LoraRouter:
    """Forward hooks on a base's adaptable linears, reading the current forward's segments."""

    decoder: str
    linears: dict[str, nn.Linear]
    segments: list[Segment] | None = None
    handles: list[Any] = field(default_factory=list)
    calls: int = 0  # deltas computed (tests check frozen rows cost none)

    @classmethod
    def install(cls, core: nn.Module, decoder: str) -> "LoraRouter":
        linears = decoder_linears(core, decoder)
        if not linears:
            raise SchemaError(f"base_adapter: this base has no linear layers under {decoder}.layers to adapt")
        router = cls(decoder, linears)
        for path, mod in linears.items():
            router.handles.append(mod.register_forward_hook(router._hook(path)))
        return router

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        return {p: (m.in_features, m.out_features) for p, m in self.linears.items()}

    def _hook(self, path: str):
        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
            segs = self.segments
            if not segs:
                return None
            x = args[0]
            for bucket in _buckets(path, segs):
                if len(bucket) == 1:
                    s, i = bucket[0]
                    d = s.adapter.delta(i, x[s.start:s.end], s.gen)
                    out[s.start:s.end] += d.to(out.dtype)
                else:
                    _batched_delta(bucket, x, out)
                self.calls += len(bucket)
            return out

        return hook

    @contextlib.contextmanager
    def route(self, segments: list[Segment]) -> Iterator[None]:
        if self.segments is not None:
            raise InputError("LoRA router: a base forward is already routing adapters (nested forwards)")
        for s in segments:
            if s.adapter.shapes.keys() - self.linears.keys():
                raise InputError("LoRA router: an adapter built for another base was routed through this one")
        self.segments = segments
        try:
            yield
        finally:
            self.segments = None


def _buckets(path: str, segs: list[Segment]) -> list[list[tuple[Segment, int]]]:
    """The segments whose adapter adapts ``path``, bucketed so that each bucket's deltas can run
    as one batched matmul pair: equal row counts, ranks and scalings (one bucket per distinct
    triple, in order of first appearance). What the bucketing saves: 8 tenants x 4 modules x
    36 layers were 1,152 separate small matmul pairs per forward (launch-bound on a GPU)."""
    buckets: dict[tuple[int, int, float], list[tuple[Segment, int]]] = {}
    for s in segs:
        i = s.adapter.index.get(path)
        if i is not None:
            key = (s.end - s.start, s.adapter.config.rank, s.adapter.scaling)
            buckets.setdefault(key, []).append((s, i))
    return list(buckets.values())


def _batched_delta(bucket: list[tuple[Segment, int]], x: torch.Tensor, out: torch.Tensor) -> None:
    """One bucket's deltas as bmm: rows (S, n, ..., in) @ A^T (S, in, r) @ B^T (S, r, out), the
    same math per segment as `LoraAdapter.delta` (dropout, when training with it, drawn per
    segment from its own generator on its own slice, as the serial forward draws it)."""
    first, last = bucket[0][0], bucket[-1][0]
    n = first.end - first.start
    adjacent = all(b[0].start == a[0].end for a, b in zip(bucket, bucket[1:]))
    a0 = first.adapter.lora_A[bucket[0][1]]
    if adjacent:
        xs = x[first.start:last.end].reshape(len(bucket), n, *x.shape[1:]).to(a0.dtype)
    else:
        xs = torch.stack([x[s.start:s.end] for s, _ in bucket]).to(a0.dtype)
    if any(s.gen is not None and s.adapter.config.dropout > 0 for s, _ in bucket):
        parts = []
        for j, (s, _) in enumerate(bucket):
            p = s.adapter.config.dropout
            xj = xs[j]
            if s.gen is not None and p > 0:
                keep = torch.rand(xj.shape, generator=s.gen, device=xj.device) >= p
                xj = xj * keep / (1 - p)
            parts.append(xj)
        xs = torch.stack(parts)
    a = torch.stack([s.adapter.lora_A[i] for s, i in bucket])  # (S, r, in)
    b = torch.stack([s.adapter.lora_B[i] for s, i in bucket])  # (S, out, r)
    flat = xs.reshape(len(bucket), -1, xs.shape[-1])
    d = torch.bmm(torch.bmm(flat, a.transpose(1, 2)), b.transpose(1, 2)) * first.adapter.scaling
    d = d.to(out.dtype).reshape(len(bucket), n, *out.shape[1:])
    if adjacent:
        out[first.start:last.end] += d.reshape(-1, *out.shape[1:])
    else:
        for j, (s, _) in enumerate(bucket):
            out[s.start:s.end] += d[j]


# ---- the row -> adapter assignment as tensors: the fast engine's form (models/fast.py) ----------
def pooled_delta(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor
                 ) -> torch.Tensor:
    """``y`` plus every row's own adapter delta ``(x @ A[i]^T) @ B[i]^T`` for row adapter index
    ``i = rows[n]`` (B already scaled by alpha / r in the pool), as gather + bmm: no Python per
    segment, so a CUDA graph or a compiled block replays it for any assignment. x (B, L, in) and
    y (B, L, out), the linear's input and output; a (S, r, in), b (S, out, r) an `AdapterPool`'s,
    in the base dtype. The second matmul accumulates onto ``y`` in one kernel (`baddbmm`): the
    wide (B, L, out) delta is never written on its own, which keeps the adapted forward near the
    frozen one on a GPU. Index 0 is all zeros: a frozen-base row's ``x @ 0`` is exact zeros (its
    input is finite), and ``y + 0`` is ``y`` bit for bit."""
    return torch.baddbmm(y, torch.bmm(x, a[rows].transpose(1, 2)), b[rows].transpose(1, 2))


def training_stack(segments: Sequence[Segment], rows: int, dtype: torch.dtype
                   ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """The `AdapterPool` layout built from the segments' own parameters, for a training forward
    on the fast engine: per adapted linear ``path`` (A (S, r_max, in), B (S, out, r_max) times
    alpha / r) in ``dtype``, S = 1 + the distinct adapters in segment order, index 0 zeros, smaller
    ranks and linears an adapter does not adapt zero-padded; and each row's index (int64, CPU).
    Unlike the pool these are fresh tensors that autograd records (stack, pad, scale and cast
    are differentiable), so `pooled_delta`'s gather + bmm sends each row's gradient to its own
    tenant's A and B, and a frozen row's (index 0: constants) to nothing. No dropout here: the
    caller keeps the segmented hooks for adapters that train with it."""
    adapters: dict[int, LoraAdapter] = {}
    for s in segments:
        adapters.setdefault(id(s.adapter), s.adapter)
    order = {key: i + 1 for i, key in enumerate(adapters)}
    rank = max(a.config.rank for a in adapters.values())
    shapes: dict[str, tuple[int, int]] = {}
    for ad in adapters.values():
        shapes.update({p: ad.shapes[p] for p in ad.paths})
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for p, (n_in, n_out) in shapes.items():
        a_parts = [torch.zeros(rank, n_in, device=next(iter(adapters.values())).lora_A[0].device)]
        b_parts = [torch.zeros(n_out, rank, device=a_parts[0].device)]
        for ad in adapters.values():
            j, r = ad.index.get(p), ad.config.rank
            if j is None:
                a_parts.append(a_parts[0])
                b_parts.append(b_parts[0])
                continue
            a, b = ad.lora_A[j], ad.lora_B[j] * ad.scaling
            a_parts.append(a if r == rank else torch.nn.functional.pad(a, (0, 0, 0, rank - r)))
            b_parts.append(b if r == rank else torch.nn.functional.pad(b, (0, rank - r)))
        out[p] = (torch.stack(a_parts).to(dtype), torch.stack(b_parts).to(dtype))
    idx = torch.zeros(rows, dtype=torch.int64)
    for s in segments:
        idx[s.start:s.end] = order[id(s.adapter)]
    return out, idx


@dataclass
class _PoolEntry:
    ref: Any  # weakref to the LoraAdapter: a dropped slot's adapter frees its index
    index: int
    signature: tuple | None  # the adapter's weights as last copied (None: copy before next use)


class AdapterPool:
    """Every resident adapter's weights stacked per adapted linear, at fixed addresses, so the
    fast engine's CUDA graphs and compiled blocks replay any row assignment (`pooled_delta`).

    Per linear ``path`` that some resident adapter adapts: ``A[path]`` (S, r_max, in) and
    ``B[path]`` (S, out, r_max) times the adapter's scaling alpha / r, in the base dtype;
    S = capacity + 1, index 0 = zeros (frozen-base rows), smaller ranks zero-padded to r_max
    (padding adds exact zeros). On a float32 base the delta is the plain path's math (up to
    float32 rounding: the scaling is applied to B, not to the product); on a bf16 base its
    matmuls take bf16 operands with float32 accumulation (the plain path's run in float32): the
    difference is bf16 rounding of a small delta (bench/lora_group.py prints it). An adapter's weights
    are copied in place into its index before the first forward that uses it and again whenever
    they changed (`LoraAdapter.signature`: weight sync, a checkpoint load, an optimizer step),
    so a refresh never moves a tensor. A rank above r_max, or a linear no resident adapter
    adapted before, reallocates and bumps `generation`: the engine drops graphs of older
    generations and captures again. Capacity bounds the adapters resident at once (least
    recently used ones not in the current forward make room); a forward with more distinct
    adapters than that gets None from `assign`, and takes the plain (segmented) forward."""

    def __init__(self, shapes: dict[str, tuple[int, int]], capacity: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise SchemaError(f"lora_pool={capacity!r}: must be an integer >= 1 (adapters resident in the fast engine)")
        self.shapes = dict(shapes)
        self.capacity = capacity
        self.device = torch.device(device)
        self.dtype = dtype
        self.rank = 0
        self.A: dict[str, torch.Tensor] = {}
        self.B: dict[str, torch.Tensor] = {}
        self.generation = 0
        self._entries: dict[int, _PoolEntry] = {}  # id(adapter) -> entry, least recently used first
        self.copies = 0  # adapter copies into the pool (tests check refreshes happen, and only then)
        self.fallbacks = 0  # forwards refused for want of capacity

    def assign(self, segments: Sequence[Segment], rows: int) -> torch.Tensor | None:
        """The adapter index of each of ``rows`` rows (int64, on the CPU; 0 = frozen base), every
        segment's adapter resident and fresh; None when they are more than the capacity."""
        # The pool's tensors are made and written outside inference mode whatever the caller's
        # mode (`predict` runs under it): an inference tensor could not be refreshed in place
        # by a later no_grad forward.
        with torch.inference_mode(False), torch.no_grad():
            return self._assign(segments, rows)

    def _assign(self, segments: Sequence[Segment], rows: int) -> torch.Tensor | None:
        adapters: dict[int, LoraAdapter] = {}
        for s in segments:
            if s.adapter.shapes.keys() - self.shapes.keys():
                raise InputError("LoRA pool: an adapter built for another base was routed through this one")
            adapters.setdefault(id(s.adapter), s.adapter)
        for k in [k for k, e in self._entries.items() if e.ref() is None]:
            del self._entries[k]  # its slot is gone: the index is free again
        if len(adapters) > self.capacity:
            self.fallbacks += 1
            return None
        rank = max((a.config.rank for a in adapters.values()), default=0)
        new_paths = {p for a in adapters.values() for p in a.paths} - self.A.keys()
        if rank > self.rank or new_paths:
            self._grow(max(rank, self.rank), new_paths)
        index: dict[int, int] = {}
        for key, ad in adapters.items():
            e = self._entries.pop(key, None)
            if e is None or e.ref() is not ad:
                e = _PoolEntry(weakref.ref(ad), self._free_index(set(adapters)), None)
            self._entries[key] = e  # most recently used last
            sig = ad.signature()
            if e.signature != sig:
                self._copy(ad, e.index)
                e.signature = sig
            index[key] = e.index
        out = torch.zeros(rows, dtype=torch.int64)
        for s in segments:
            out[s.start:s.end] = index[id(s.adapter)]
        return out

    def layer(self, path: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.A[path], self.B[path]) if path in self.A else None

    def _free_index(self, keep: set[int]) -> int:
        used = {e.index for e in self._entries.values()}
        free = [i for i in range(1, self.capacity + 1) if i not in used]
        if free:
            return free[0]
        victim = next(k for k in self._entries if k not in keep)  # LRU not in this forward (assign checked room)
        return self._entries.pop(victim).index

    def _grow(self, rank: int, new_paths: set[str]) -> None:
        """Reallocate every pooled linear at ``rank`` (and the new ones): every resident adapter is
        copied again before its next use."""
        n = self.capacity + 1
        for p in sorted(self.A.keys() | new_paths):
            i, o = self.shapes[p]
            self.A[p] = torch.zeros(n, rank, i, dtype=self.dtype, device=self.device)
            self.B[p] = torch.zeros(n, o, rank, dtype=self.dtype, device=self.device)
        self.rank = rank
        self.generation += 1
        for e in self._entries.values():
            e.signature = None

    def _copy(self, ad: LoraAdapter, i: int) -> None:
        r = ad.config.rank
        for p in self.A:
            j = ad.index.get(p)
            if j is None:  # a linear this adapter does not adapt: exact zeros for its rows
                self.A[p][i].zero_()
                self.B[p][i].zero_()
                continue
            self.A[p][i, :r].copy_(ad.lora_A[j])
            self.A[p][i, r:].zero_()
            self.B[p][i, :, :r].copy_(ad.lora_B[j] * ad.scaling)  # scaled in the adapter's float32
            self.B[p][i, :, r:].zero_()
        self.copies += 1


_INSTALL = threading.Lock()


def router_for(base: Any) -> LoraRouter:
    """The base's router, installed on first use (bases without LoRA tenants carry no hooks).
    Locked: an inferencer builds slots in worker threads, and two routers would add every
    delta twice."""
    if base.lora_router is None:
        with _INSTALL:
            if base.lora_router is None:
                base.lora_router = LoraRouter.install(base.core, base.family.text_decoder)
    return base.lora_router


@functools.lru_cache(maxsize=16)
def base_linear_shapes(source: str) -> dict[str, tuple[int, int]]:
    """(in, out) of every adaptable linear of a base (preset name or save_pretrained directory),
    from its config alone: what the master checks a spec's base_adapter against at submit.

    One decoder layer of the language model is built on the meta device (no weights, no
    memory) and its linears repeated for every layer: these decoders' layers are all alike, and
    a whole 36-layer model took 15 s to build even on meta on a loaded host."""
    import copy

    from transformers import AutoConfig, AutoModel

    from models.families import MODEL_TYPE_TO_FAMILY, get_family
    from models.presets import PRESETS, get_preset

    if source in PRESETS:
        preset = get_preset(source)
        hf_config, family_name = preset.build_config(None), preset.family
    else:
        hf_config = AutoConfig.from_pretrained(source, local_files_only=True)
        family_name = MODEL_TYPE_TO_FAMILY.get(hf_config.model_type)
        if family_name is None:
            raise SchemaError(f"base={source!r}: model_type {hf_config.model_type!r} not supported")
    text = copy.deepcopy(hf_config.get_text_config())
    layers = int(text.num_hidden_layers)
    text.num_hidden_layers = 1
    with torch.device("meta"):
        one = AutoModel.from_config(text)
    decoder = get_family(family_name).text_decoder
    first = {p.removeprefix("layers.0."): (m.in_features, m.out_features) for p, m in one.named_modules()
             if isinstance(m, nn.Linear) and p.startswith("layers.0.")}
    return {f"{decoder}.layers.{i}.{rest}": shape for i in range(layers) for rest, shape in first.items()}
