"""`expert`: a pi0-style action expert (OpenPI) on the shared base's per-layer prefix KV cache.

    slot = TenantSlot.create("acme", schema, base, head_kind="expert", head_options={"width": 128})
    train_step(base, [(slot, batch), (other, batch2)])   # one base forward computes the cache for all rows

A small transformer of its own: `depth` layers (default: as many as the base's text decoder),
each with its own weights. Expert layer i attends to the base's layer m(i) keys and values over
the whole prefix (images, prompt, query tokens; padding masked) plus its own tokens: one
state token and `action_horizon` action tokens, the noisy action of each step mixed with the
flow time by an MLP (pi0's action-time MLP). Suffix attention is pi0's block mask: the state
token sees the prefix and itself, the action tokens see the prefix, the state and each other.

Reading the base's cache fixes the head shape: `head_dim` equals the base's, `num_heads` is a
multiple of the base's `num_key_value_heads` (GQA: query head h reads cache head
h // (num_heads / kv_heads), as transformers' repeat_kv pairs them). Layer mapping: `depth` must
divide the base's layer count L; expert layer i reads base layer (i + 1) * L / depth - 1 (the
last of each block of L / depth layers; depth = L is one to one). The expert's queries and keys
are rotated by the base's own rotary table at the positions that continue each row's prefix
(`PrefixKV.next_pos_B` + 0..H), as pi0 numbers its suffix after the prefix's real tokens.

Sampling several tenants at once: experts of one shape (same options and tenant dims) whose
rows are equally many sample together in a grouped `predict` (`ExpertHead.predict_many`): their
weights are stacked and each linear layer runs as one batched matmul over the tenants, so the
Euler loop launches once per step for all of them instead of once per tenant; each tenant's
noise still comes from its own generator, and grouped == serial within 1e-5 (CPU fp32).
The noise is drawn before the loop, so the loop reads only fixed inputs: `EulerBucket` keeps
them in fixed buffers per (bucket shape, tenants) and on CUDA replays the whole loop (every
step, every layer) as one CUDA graph; each expert layer's prefix + suffix KV is one buffer
written in place (no per-step concatenation of the cache) and GQA reads the cache unrepeated.

Training: flow matching on the action chunk (models/heads/flow.py's schedule: t from
Beta(alpha, 1), x_t = (1 - t) noise + t actions, MSE on the velocity). Inference: the base's
forward (and its cache) runs once; `euler_steps` Euler steps run the expert alone on it.
The cache is computed under no_grad: gradients reach only the expert (and the tenant's LoRA
adapter, if it has one, through its own rows).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.errors import InputError, SchemaError
from models.families.common import AttentionShape
from models.heads.base import HeadDims, positive, randn, register_head
from models.heads.flow import FlowMatchingHead, timestep_embedding
from models.outputs import BaseOutput

EXPERT = "expert"


@dataclass(frozen=True)
class ExpertHeadConfig:
    """None = taken from the base (what its cache allows)."""

    width: int = 256  # the expert's hidden size (pi0: 1024 beside PaliGemma's 2048)
    depth: int | None = None  # None: the base's text layers; else a divisor of them
    num_heads: int | None = None  # None: the base's query heads; a multiple of its kv heads
    head_dim: int | None = None  # None: the base's; nothing else can read its cache
    mlp_width: int | None = None  # None: 4 * width
    beta_alpha: float = 1.5
    max_time: float = 0.999
    euler_steps: int = 10  # OpenPI samples pi0 with 10 Euler steps

    def __post_init__(self) -> None:
        positive("expert.width", self.width)
        positive("expert.euler_steps", self.euler_steps)
        positive("expert.beta_alpha", self.beta_alpha)
        for name in ("depth", "num_heads", "head_dim", "mlp_width"):
            value = getattr(self, name)
            if value is not None:
                positive(f"expert.{name}", value)
        if not 0 < self.max_time <= 1:
            raise SchemaError(f"expert.max_time={self.max_time}: must be in (0, 1]")


# ---- what a base's cache allows (also the master's submit-time check) ----------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_errors(shape: AttentionShape, params: dict[str, Any], field: str = "action_module.params"
                  ) -> list[tuple[str, str, Any]]:
    """(field, message, value) for each way expert options cannot read a base whose text
    attention is ``shape``; [] when they fit."""
    errors: list[tuple[str, str, Any]] = []
    allowed = {f.name for f in fields(ExpertHeadConfig)}
    for key in sorted(set(params) - allowed):
        errors.append((f"{field}.{key}", f"unknown expert option; allowed: {', '.join(sorted(allowed))}", params[key]))
    depth, heads, head_dim = params.get("depth"), params.get("num_heads"), params.get("head_dim")
    if _is_int(depth) and depth not in _divisors(shape.layers):
        errors.append((f"{field}.depth", f"{depth} expert layers cannot map onto this base's {shape.layers} text "
                       f"layers; allowed: {', '.join(map(str, _divisors(shape.layers)))} (a divisor: expert layer i "
                       f"reads base layer (i + 1) * {shape.layers} / depth - 1)", depth))
    if _is_int(head_dim) and head_dim != shape.head_dim:
        errors.append((f"{field}.head_dim", f"{head_dim} cannot read this base's KV cache; allowed: {shape.head_dim} "
                       "(the base's head_dim)", head_dim))
    if _is_int(heads) and (heads < 1 or heads % shape.kv_heads):
        examples = ", ".join(str(shape.kv_heads * k) for k in (1, 2, 4))
        errors.append((f"{field}.num_heads", f"{heads} query heads cannot share this base's {shape.kv_heads} KV "
                       f"heads; allowed: a multiple of {shape.kv_heads} (e.g. {examples})", heads))
    if not errors:
        try:
            ExpertHeadConfig(**params)
        except (SchemaError, TypeError) as exc:
            name, _, rest = str(exc).partition(": ")
            errors.append((f"{field}.{name.partition('=')[0].removeprefix('expert.')}", rest or str(exc), params))
    return errors


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@functools.lru_cache(maxsize=16)
def base_attention(source: str) -> tuple[str, AttentionShape]:
    """(family, text attention shape) of a base (preset name or save_pretrained directory), from
    its config alone: what the master checks an expert against at submit."""
    from models.families import MODEL_TYPE_TO_FAMILY, text_attention_shape
    from models.presets import PRESETS, get_preset

    if source in PRESETS:
        preset = get_preset(source)
        return preset.family, text_attention_shape(preset.build_config(None))
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(source, local_files_only=True)
    family = MODEL_TYPE_TO_FAMILY.get(hf_config.model_type)
    if family is None:
        raise SchemaError(f"base={source!r}: model_type {hf_config.model_type!r} not supported")
    return family, text_attention_shape(hf_config)


def base_expert_errors(source: str, params: dict[str, Any], field: str = "action_module.params"
                       ) -> list[tuple[str, str, Any]]:
    """`expert_errors` against a base named by source, plus whether its family has a cache to read."""
    from models.families import get_family

    family, shape = base_attention(source)
    if not get_family(family).prefix_kv:
        supported = sorted(name for name, cls in _families().items() if cls.prefix_kv)
        return [("action_module.kind", f"'expert' reads a per-layer KV cache, which base family {family!r} does not "
                 f"expose; allowed families: {', '.join(supported)}", EXPERT)]
    return expert_errors(shape, params, field)


def _families() -> dict[str, Any]:
    from models.families import FAMILIES

    return FAMILIES


# ---- the network ----------------------------------------------------------------------------
def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it (rotate_half), x (B, heads, T, D), cos/sin (B, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class ExpertLayer(nn.Module):
    """Pre-norm attention over [base layer's prefix KV ; own KV], then a GeGLU MLP (Gemma-style).
    No biases on q/k/v/o: a key bias gets an exactly zero gradient (softmax ignores shifts)."""

    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int, mlp_width: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.attn_norm = nn.RMSNorm(width, eps=1e-6)
        self.q = nn.Linear(width, heads * head_dim, bias=False)
        self.k = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, width, bias=False)
        self.mlp_norm = nn.RMSNorm(width, eps=1e-6)
        self.gate = nn.Linear(width, mlp_width, bias=False)
        self.up = nn.Linear(width, mlp_width, bias=False)
        self.down = nn.Linear(mlp_width, width, bias=False)

    def forward(self, x_B_T_W: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
                mask_B_1_T_S: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x_B_T_W.shape
        h = self.attn_norm(x_B_T_W)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k = torch.cat([prefix_k, k], dim=2)
        v = torch.cat([prefix_v, v], dim=2)
        group = self.heads // self.kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B_1_T_S)
        x = x_B_T_W + self.o(a.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        h = self.mlp_norm(x)
        return x + self.down(F.gelu(self.gate(h), approximate="tanh") * self.up(h))


_LAYER_PARAMS = ("attn_norm.weight", "q.weight", "k.weight", "v.weight", "o.weight", "mlp_norm.weight",
                 "gate.weight", "up.weight", "down.weight")


def _lin(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Per-tenant linear: x (S, ..., in), w (S, out, in), bias (S, out) -> (S, ..., out)."""
    flat = x.reshape(x.shape[0], -1, x.shape[-1])
    wt = w.transpose(1, 2)
    y = torch.bmm(flat, wt) if bias is None else torch.baddbmm(bias[:, None], flat, wt)
    return y.view(*x.shape[:-1], w.shape[1])


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    """nn.RMSNorm with a per-tenant weight (S, W) on x (S, ..., W)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight.view(shape)


def _layer_many(layer: "ExpertLayer", p: dict[str, torch.Tensor], x: torch.Tensor, kv_k: torch.Tensor,
                kv_v: torch.Tensor, length: int, mask_g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                math: Any = None) -> torch.Tensor:
    """One expert layer over S stacked tenants (`_layer_math`; ``math``: a compiled copy of it)."""
    return (math or _layer_math)(layer.heads, layer.kv_heads, layer.head_dim, layer.attn_norm.eps,
                                 layer.mlp_norm.eps, p, x, kv_k, kv_v, length, mask_g, cos, sin)


@functools.cache
def _layer_math_compiled() -> Any:
    """`_layer_math` compiled once per process: its arguments are the layer's sizes (equal for
    every layer of a shape, so one trace serves all of them) and tensors, never a module."""
    return torch.compile(_layer_math, dynamic=False)


def _layer_math(heads: int, kv: int, hd: int, attn_eps: float | None, mlp_eps: float | None,
                p: dict[str, torch.Tensor], x: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, length: int,
                mask_g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """ExpertLayer.forward with weights stacked over S tenants: x (S, B, T, W); the cache, mask
    and rotary tables over the S * B rows (attention is per row, so rows of all tenants batch).

    kv_k / kv_v: (S * B, kv_heads, length + T, head_dim) buffers whose first ``length``
    positions hold the base's prefix (filled once per sampling); this layer writes its own keys
    and values into the last T in place (no concatenation of the whole cache per step).
    GQA without repeating the cache: the ``group`` query heads of one KV head attend as one
    (group * T)-row query block, ``mask_g`` (S * B, 1, group * T, length + T) the suffix mask
    tiled ``group`` times (`_grouped_mask`); each query row's softmax is unchanged."""
    s_, b, t, _ = x.shape
    h = _rms(x, p["attn_norm.weight"], attn_eps)
    q = _lin(h, p["q.weight"]).view(s_ * b, t, heads, hd).transpose(1, 2)
    k = _lin(h, p["k.weight"]).view(s_ * b, t, kv, hd).transpose(1, 2)
    v = _lin(h, p["v.weight"]).view(s_ * b, t, kv, hd).transpose(1, 2)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    kv_k[:, :, length:] = k
    kv_v[:, :, length:] = v
    # Query head h reads KV head h // group (repeat_interleave's pairing): (N, kv, group * T, hd).
    a = F.scaled_dot_product_attention(q.reshape(s_ * b, kv, (heads // kv) * t, hd), kv_k, kv_v, attn_mask=mask_g)
    a = a.reshape(s_ * b, heads, t, hd)  # reshape: CUDA kernels may return it transposed in memory
    x = x + _lin(a.transpose(1, 2).reshape(s_, b, t, heads * hd), p["o.weight"])
    h = _rms(x, p["mlp_norm.weight"], mlp_eps)
    return x + _lin(F.gelu(_lin(h, p["gate.weight"]), approximate="tanh") * _lin(h, p["up.weight"]), p["down.weight"])


@dataclass
class ExpertContext:
    """What every Euler step reuses: the mapped layers' prefix KV (float32) and the rotary tables."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor


@register_head(EXPERT, ExpertHeadConfig)
class ExpertHead(FlowMatchingHead):
    needs_prefix_kv = True

    def __init__(self, dims: HeadDims, config: ExpertHeadConfig) -> None:
        super().__init__(dims, config)
        if not dims.text_layers:
            raise SchemaError("expert: HeadDims carry no text attention shape of the base (build it with TenantSlot.create)")
        shape = AttentionShape(dims.text_layers, dims.text_heads, dims.text_kv_heads, dims.text_head_dim)
        errors = expert_errors(shape, {k: v for k, v in vars(config).items() if v is not None}, field="expert")
        if errors:
            raise SchemaError("; ".join(f"{f}: {m}" for f, m, _ in errors))
        depth = config.depth or shape.layers
        heads = config.num_heads or shape.heads
        w = config.width
        stride = shape.layers // depth
        self.layer_map = [(i + 1) * stride - 1 for i in range(depth)]
        self.action_in = nn.Linear(dims.action_dim, w)
        self.state_in = nn.Linear(max(dims.state_dim, 1), w)
        # pi0's action-time MLP: [action embedding ; time embedding] -> swish -> width.
        self.time_in = nn.Linear(2 * w, w)
        self.time_out = nn.Linear(w, w)
        self.layers = nn.ModuleList([ExpertLayer(w, heads, shape.kv_heads, shape.head_dim, config.mlp_width or 4 * w)
                                     for _ in range(depth)])
        self.out_norm = nn.RMSNorm(w, eps=1e-6)
        self.out = nn.Linear(w, dims.action_dim)
        # Block mask of the suffix (state, then H actions): pi0's [state | actions] blocks.
        block = torch.tensor([0] + [1] * dims.action_horizon)
        self.register_buffer("suffix_mask", block[None, :] <= block[:, None], persistent=False)

    def context(self, feats: BaseOutput) -> tuple[ExpertContext, torch.Tensor]:
        prefix = feats.prefix
        if prefix is None:
            raise InputError("expert head: the features carry no prefix KV cache (encode with prefix_kv=True)")
        if len(prefix.keys) != self.dims.text_layers:
            raise InputError(f"expert head: the cache has {len(prefix.keys)} layers, this expert was built for "
                             f"{self.dims.text_layers}")
        dev = self._device
        b, length = feats.mask_B_L.shape
        t = self.dims.action_horizon + 1
        keys = [prefix.keys[j].to(dev, torch.float32) for j in self.layer_map]
        values = [prefix.values[j].to(dev, torch.float32) for j in self.layer_map]
        positions = prefix.next_pos_B.to(dev)[:, None] + torch.arange(t, device=dev)
        cos, sin = prefix.rope(positions)
        prefix_mask = feats.mask_B_L.to(dev)[:, None, None, :].expand(b, 1, t, length)
        suffix = self.suffix_mask.to(dev)[None, None].expand(b, 1, t, t)
        return ExpertContext(keys, values, cos.to(dev), sin.to(dev)), torch.cat([prefix_mask, suffix], dim=-1)

    def batch_key(self, feats: BaseOutput) -> Any:
        return (ExpertHead, self.config, self.dims, self._device, tuple(feats.mask_B_L.shape))

    @classmethod
    def predict_many(cls, heads: list["ExpertHead"], feats: list[BaseOutput], vlas: list[Any],
                     generators: list[torch.Generator]) -> list[torch.Tensor]:
        """Euler sampling of equal-shaped experts together: (S tenants, B rows) at each step.

        The noise is drawn first, each tenant's from its own generator (as `predict` draws it);
        after that the loop is a function of static inputs (the cache does not change while
        sampling), so on CUDA the whole loop of a bucket runs as one CUDA graph per (bucket
        shape, tenants), its inputs copied into the graph's buffers (`EulerBucket`)."""
        h0 = heads[0]
        dev, b = h0._device, len(feats[0])
        x0 = torch.stack([randn((b, h0.dims.action_horizon, h0.dims.action_dim), g, dev) for g in generators])
        bucket = EulerBucket.get(h0, len(heads), feats[0], states=bool(h0.dims.state_dim))
        with torch.inference_mode(False), torch.no_grad():
            bucket.load(heads, feats, vlas, x0)
            return list(bucket.run(h0).unbind(0))

    def _euler_many(self, p: dict[str, torch.Tensor], x: torch.Tensor, state: torch.Tensor | None,
                    ctx: ExpertContext, length: int, mask_g: torch.Tensor, math: Any = None) -> torch.Tensor:
        """`euler_steps` Euler steps from noise x (S, B, H, A) with every weight stacked over S."""
        k = self.config.euler_steps
        n = x.shape[0] * x.shape[1]
        for i in range(k):
            t = torch.full((n,), i / k, device=x.device)
            x = x + self._velocity_many(p, x, t, state, ctx, length, mask_g, math) / k
        return x

    def _velocity_many(self, p: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor,
                       state: torch.Tensor | None, ctx: ExpertContext, length: int, mask_g: torch.Tensor,
                       math: Any = None) -> torch.Tensor:
        """`velocity` with every weight stacked over S tenants: x (S, B, H, A), state (S, B, 1, sd),
        ctx (its keys / values: `_layer_many`'s prefix + suffix buffers) and the grouped mask
        over the S * B rows in tenant order."""
        s_, b, h, _ = x.shape
        w = self.config.width
        a = _lin(x, p["action_in.weight"], p["action_in.bias"])
        temb = timestep_embedding(t, w).view(s_, b, 1, w).expand(s_, b, h, w)
        a = _lin(F.silu(_lin(torch.cat([a, temb], dim=-1), p["time_in.weight"], p["time_in.bias"])),
                 p["time_out.weight"], p["time_out.bias"])
        s = (_lin(state, p["state_in.weight"], p["state_in.bias"]) if state is not None
             else torch.zeros(s_, b, 1, w, device=x.device))
        tokens = torch.cat([s, a], dim=2)
        for i, (layer, pk, pv) in enumerate(zip(self.layers, ctx.keys, ctx.values)):
            tokens = _layer_many(layer, {n: p[f"layers.{i}.{n}"] for n in _LAYER_PARAMS}, tokens, pk, pv, length,
                                 mask_g, ctx.cos, ctx.sin, math)
        return _lin(_rms(tokens[:, :, 1:], p["out_norm.weight"], self.out_norm.eps), p["out.weight"], p["out.bias"])

    def velocity(self, x_B_H_A: torch.Tensor, t_B: torch.Tensor, state: torch.Tensor | None,
                 ctx: ExpertContext, mask: torch.Tensor) -> torch.Tensor:
        b, h, _ = x_B_H_A.shape
        w = self.config.width
        a = self.action_in(x_B_H_A)
        temb = timestep_embedding(t_B, w)[:, None].expand(b, h, w)
        a = self.time_out(F.silu(self.time_in(torch.cat([a, temb], dim=-1))))
        s = self.state_in(state) if state is not None else torch.zeros(b, w, device=x_B_H_A.device)
        tokens = torch.cat([s[:, None], a], dim=1)
        for layer, k, v in zip(self.layers, ctx.keys, ctx.values):
            tokens = layer(tokens, k, v, mask, ctx.cos, ctx.sin)
        return self.out(self.out_norm(tokens[:, 1:]))


# ---- the grouped Euler loop: static buffers, and on CUDA one graph per bucket ----------------
# Buckets kept (least recently used goes first): each holds its cache buffers (float32, S * B
# rows x every expert layer's prefix + suffix) and, on CUDA, its graph's memory pool.
EULER_BUCKETS = 4


@dataclass(frozen=True)
class EulerOptions:
    """How a bucket's loop runs (`bench/expert_profile.py` measures each; docs/benchmarks.md).

    tf32: the loop's float32 matmuls as TF32 on CUDA (the flag is set while the graph is
          captured, so only the captured kernels use it; the rest of the process keeps its
          setting); compile: each expert layer's math compiled by inductor before capture (one
          trace serves every layer of a shape; fewer, fused kernels: a step was ~25 small
          kernels per layer and bucket)."""

    tf32: bool = False
    compile: bool = False

    @classmethod
    def parse(cls, text: str) -> "EulerOptions":
        """"fp32" (neither), "tf32", "compile" or "compile+tf32"."""
        parts = {p.strip() for p in text.split("+") if p.strip()} - {"fp32"}
        if parts - {"tf32", "compile"}:
            raise ValueError(f"euler options {text!r}: unknown {sorted(parts - {'tf32', 'compile'})}; "
                             "allowed: fp32, tf32, compile, compile+tf32")
        return cls(tf32="tf32" in parts, compile="compile" in parts)


_EULER = EulerOptions()


def set_euler_options(options: EulerOptions) -> None:
    """The options buckets created from now on take (a process-wide engine setting, like the
    inferencer's compile flag; existing buckets keep theirs: the options are part of the key)."""
    global _EULER
    _EULER = options


class EulerBucket:
    """Everything `ExpertHead._euler_many` reads for one bucket shape (expert config and dims,
    device, prefix length, S tenants x B rows), in fixed buffers: stacked weights, the noise, the
    state, each expert layer's prefix + suffix KV (`_layer_many`), rotary tables and the grouped
    mask. `load` copies one call's inputs in; `run` samples. On CUDA the first `run` captures
    the whole loop (all Euler steps) as a CUDA graph and later ones replay it: the loop is a few
    hundred small kernels per step, launch-bound, while the cache it reads does not change. On
    CPU (and without CUDA) it runs the same function eagerly on the same buffers."""

    _cache: ClassVar[OrderedDict[tuple, "EulerBucket"]] = OrderedDict()

    @classmethod
    def get(cls, h0: ExpertHead, tenants: int, feats0: BaseOutput, states: bool) -> "EulerBucket":
        options = _EULER
        key = (h0.batch_key(feats0), tenants, states, options)
        bucket = cls._cache.pop(key, None)
        if bucket is None:
            b, length = feats0.mask_B_L.shape
            bucket = cls(h0, tenants, b, length, states, options)
        cls._cache[key] = bucket
        while len(cls._cache) > EULER_BUCKETS:
            cls._cache.popitem(last=False)
        return bucket

    def __init__(self, h0: ExpertHead, tenants: int, rows: int, length: int, states: bool,
                 options: EulerOptions = EulerOptions()) -> None:
        dev, d = h0._device, h0.dims
        self.options = options
        self._math = _layer_math_compiled() if options.compile else None
        t = d.action_horizon + 1
        lay = h0.layers[0]
        n = tenants * rows
        self.length, self.tokens, self.group = length, t, lay.heads // lay.kv_heads
        with torch.inference_mode(False), torch.no_grad():
            self.params = {name: torch.empty((tenants, *p.shape), device=dev, dtype=p.dtype)
                           for name, p in h0.named_parameters()}
            self.x0 = torch.empty(tenants, rows, d.action_horizon, d.action_dim, device=dev)
            self.state = torch.empty(tenants, rows, 1, d.state_dim, device=dev) if states else None
            kv = lambda: torch.empty(n, lay.kv_heads, length + t, lay.head_dim, device=dev)  # noqa: E731
            self.ctx = ExpertContext([kv() for _ in h0.layers], [kv() for _ in h0.layers],
                                     torch.empty(n, t, lay.head_dim, device=dev),
                                     torch.empty(n, t, lay.head_dim, device=dev))
            self.mask_g = torch.empty(n, 1, self.group * t, length + t, dtype=torch.bool, device=dev)
        self.use_graph = dev.type == "cuda" and torch.cuda.is_available()
        self._src: list[torch.Tensor] = []  # the parameters last stacked, and their versions
        self._versions: list[int] = []
        self.graph: Any = None
        self.out: torch.Tensor | None = None

    def load(self, heads: list[ExpertHead], feats: list[BaseOutput], vlas: list[Any], x0: torch.Tensor) -> None:
        """One call's inputs into the buffers (weights restacked every call: an optimizer step
        changes them in place between calls)."""
        h0, length, t = heads[0], self.length, self.tokens
        dev = h0._device
        self.x0.copy_(x0)
        src = [p for h in heads for p in h.parameters()]
        if self._changed(src):
            named = [dict(h.named_parameters()) for h in heads]
            for name, buf in self.params.items():
                torch.stack([p[name] for p in named], out=buf)
        if self.state is not None:
            self.state[:, :, 0].copy_(torch.stack([h.state(v) for h, v in zip(heads, vlas)]))
        for i, j in enumerate(h0.layer_map):
            # base dtype -> float32 in the copy (what `context` does with .to(float32))
            self.ctx.keys[i][:, :, :length].copy_(torch.cat([f.prefix.keys[j] for f in feats]))
            self.ctx.values[i][:, :, :length].copy_(torch.cat([f.prefix.values[j] for f in feats]))
        positions = torch.cat([f.prefix.next_pos_B for f in feats]).to(dev)[:, None] + torch.arange(t, device=dev)
        cos, sin = feats[0].prefix.rope(positions)  # one base: one rotary table for every row
        self.ctx.cos.copy_(cos)
        self.ctx.sin.copy_(sin)
        prefix = torch.cat([f.mask_B_L for f in feats]).to(dev)
        n = prefix.shape[0]
        mask = torch.cat([prefix[:, None, None, :].expand(n, 1, t, length),
                          h0.suffix_mask.to(dev)[None, None].expand(n, 1, t, t)], dim=-1)
        self.mask_g.copy_(mask.repeat(1, 1, self.group, 1))  # `_layer_many`'s query block g * T + t

    def _changed(self, src: list[torch.Tensor]) -> bool:
        """Do the stacked weights need restacking? Not when the same parameter tensors come in
        unchanged since the last call (their version counters: an optimizer step or a weight
        sync writes in place and bumps them): restacking 8 experts' layers is hundreds of copies.
        The bucket holds the tensors it compared, so an id is never reused under it."""
        try:
            versions = [p._version for p in src]
        except RuntimeError:  # an inference tensor keeps no version: always restack
            self._src, self._versions = [], []
            return True
        same = (len(src) == len(self._src) and all(a is b for a, b in zip(src, self._src))
                and versions == self._versions)
        self._src, self._versions = src, versions
        return not same

    def _sample(self, h0: ExpertHead) -> torch.Tensor:
        return h0._euler_many(self.params, self.x0, self.state, self.ctx, self.length, self.mask_g, self._math)

    def run(self, h0: ExpertHead) -> torch.Tensor:
        """The actions (S, B, H, A) from the loaded inputs (a fresh tensor)."""
        if not self.use_graph:
            return self._sample(h0)
        if self.graph is None:
            prev = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = self.options.tf32 or prev
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up: cuBLAS handles, workspaces (and a compile) before capture
                        self._sample(h0)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.out = self._sample(h0)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = prev
            self.graph = graph
        self.graph.replay()
        return self.out.clone()
