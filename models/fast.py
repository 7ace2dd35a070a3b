"""Optimized encode for Qwen3-VL bases: same math as the transformers forward, less overhead.

Enabled by `BaseConfig(fast=True)`. Where the plain forward spends time besides matmuls (H200
profile in docs/benchmarks.md): one attention call per image per vision layer, M-RoPE index
building in a Python loop, boolean-mask scatters that synchronize with the host, and a few
hundred kernel launches per call. This path:

1. precomputes per (layout, batch size) everything that depends only on shapes: vision
   position embeddings and rotary tables, the token skeleton, placeholder positions;
2. runs vision attention for all images in one batched SDPA call (every canonical image has the
   same size, so the block-diagonal attention is a plain batch);
3. scatters image features and deepstack features by precomputed flat indices (no host sync);
4. builds M-RoPE ids with the vectorized `Qwen3VLFamily.position_ids`;
5. on CUDA, captures the whole encode as a CUDA graph per (layout, batch size) and replays it;
6. runs the patch embedding as one matmul: the Conv3d's kernel equals its stride, so it is a
   linear map of each flat patch, and cuDNN's bf16 Conv3d for that shape is known to be one to
   several orders of magnitude slower than the matmul (transformers#45041, vLLM#27418);
7. with `fused=True` (opt-in: not yet measured on the H200, and it costs memory), runs each
   decoder layer from its own code with q/k/v and gate/up as one matmul each, on concatenated
   copies of those weights built once (+2.4B parameters' worth on qwen3-vl-4b, 4.7 GB in bf16):
   wider matmuls run nearer the chip's peak. bench/fast_profile.py measures both;
8. with `fp8=True` (opt-in, CUDA sm89+ only; issue 27 item 3): the decoder layers' and vision
   blocks' big linears run as FP8 matmuls (`torch._scaled_mm`, float8_e4m3fn, one scale per
   tensor): weights quantized once here, activations per call on the device (the scale stays a
   tensor, so graph capture works); implies the fused decoder layer. Its speed and its error
   against the bf16 forward are in docs/benchmarks.md. `fp8="rowwise"`: the same with one scale
   per token (activations, (M, 1)) and one per output channel (weights, (1, N)), float32, as
   sm90's row-wise `torch._scaled_mm` takes them; `fp8_vision=False` keeps the vision blocks bf16;
9. serves groups with LoRA rows (issue 27 item 1): each row's adapter index is one more static
   input, every adapter's weights sit in an `models.lora.AdapterPool` (stacked per adapted
   linear, fixed addresses, refreshed in place when a weight sync changes them), and the
   decoder layers that anything adapts run `_text_layer_lora` (gather + bmm deltas on the
   adapted projections), so one graph / compiled block per (layout, rows) serves any mix of
   adapters and frozen-base rows. Training forwards of adapted rows (`train_forward`) run the
   same layers uncaptured (eager, or the compiled blocks, which torch.compile differentiates)
   on `models.lora.training_stack`'s stacks of the tenants' own A and B, so gradients reach
   them; adapters with dropout keep the plain path (models/base.py);
10. serves groups with action-expert rows (issue 27 item 2): with ``kv=True`` every decoder
   layer runs `_text_layer_lora` (adapted or not) and also hands back its keys (normed,
   rotated) and values, (B, kv_heads, L, head_dim) in the base dtype as `Family.forward_kv`
   returns them, with each row's next position (`Family.next_positions`): more static outputs
   of a graph of its own per (layout, rows[, pool generation]) on CUDA, or of the compiled
   blocks, so the expert's prefix cache costs the frozen forward plus those copies.

It calls the model's own submodules (patch embed, blocks' norms/MLPs, mergers, decoder
layers, rotary embeddings), so a checkpoint's weights are used unchanged. Equality with the
plain path is tested on CPU (tests/models/test_model_fast.py); graphs are CUDA-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from models.features import VLABatch
from models.schema import FeatureLayout


@dataclass
class _Consts:
    ids_L: torch.Tensor
    slot_L: torch.Tensor
    prompt_start: int
    img_flat_idx: torch.Tensor  # flat (b * L + pos) index of every image placeholder, in order
    vis_pos: torch.Tensor  # (N * P, Dv) position embeddings of all images
    vis_cos: torch.Tensor
    vis_sin: torch.Tensor
    causal_L_L: torch.Tensor
    tokens_per_image: int


def make_fast_encoder(base, compile: bool = False) -> Callable[[VLABatch], tuple[torch.Tensor, torch.Tensor]]:
    if base.family.name != "qwen3_vl":
        raise NotImplementedError(f"fast encode exists for qwen3_vl only, not {base.family.name}")
    return FastQwen3VLEncoder(base, compile=compile)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# float8_e4m3fn's largest finite value: a per-tensor scale maps the tensor's amax onto it.
_FP8_MAX = 448.0

Fp8Weight = tuple[torch.Tensor, torch.Tensor, bool]  # (weight^T (K, N) column-major, scale, fast accum)

# `fp8` modes: one scale per tensor, or row-wise (per token x per output channel).
FP8_MODES = ("tensor", "rowwise")


def _fp8_weight(w: torch.Tensor, fast_accum: bool, rowwise: bool = False) -> Fp8Weight:
    """A linear weight (N, K) quantized once, as `torch._scaled_mm` takes its second operand;
    `rowwise`: one scale per output channel, shape (1, N) float32 (its rank marks the mode)."""
    if rowwise:
        scale = (w.abs().amax(dim=1, keepdim=True).float() / _FP8_MAX).clamp(min=1e-12)  # (N, 1)
        return (w.float() / scale).to(torch.float8_e4m3fn).t(), scale.t().contiguous(), fast_accum
    scale = (w.abs().amax().float() / _FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale).to(torch.float8_e4m3fn).t(), scale, fast_accum


def _fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    w8_t, w_scale, fast_accum = w
    x2 = x.reshape(-1, x.shape[-1])
    # Activation scale computed on the device (no .item(): capturable): one per tensor, or,
    # with a row-wise weight, one per token ((M, 1) float32, what row-wise scaling takes).
    rowwise = w_scale.dim() == 2
    amax = x2.abs().amax(dim=1, keepdim=True) if rowwise else x2.abs().amax()
    x_scale = (amax.float() / _FP8_MAX).clamp(min=1e-12)
    x8 = (x2.float() / x_scale).to(torch.float8_e4m3fn)
    # Row-wise: the bias is added after (an elementwise add inductor fuses), not handed to the
    # row-wise kernel, whose bias support varies across torch versions.
    y = torch._scaled_mm(x8, w8_t, scale_a=x_scale, scale_b=w_scale, bias=None if rowwise else bias,
                         out_dtype=x.dtype, use_fast_accum=fast_accum)
    if rowwise and bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], -1)


def _linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the FP8 matmul where `w` is an `Fp8Weight`."""
    return _fp8_linear(x, w, bias) if isinstance(w, tuple) else F.linear(x, w, bias)


def _vision_block(blk, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_img: int, p: int,
                  w8: tuple | None = None) -> torch.Tensor:
    """Qwen3VLVisionBlock with all images' attention in one batched SDPA call; with `w8`
    (FP8 qkv, proj, fc1, fc2), its linears as FP8 matmuls."""
    a = blk.attn
    n_tok = h.shape[0]
    x = blk.norm1(h)
    qkv = a.qkv(x) if w8 is None else _linear(x, w8[0], a.qkv.bias)
    q, k, val = qkv.reshape(n_tok, 3, a.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q = ((q.float() * cos) + (_rotate_half(q.float()) * sin)).to(x.dtype)
    k = ((k.float() * cos) + (_rotate_half(k.float()) * sin)).to(x.dtype)
    # (N*P, H, d) -> (N, H, P, d): block-diagonal attention over equal images is a batch.
    q, k, val = (y.reshape(n_img, p, a.num_heads, -1).transpose(1, 2) for y in (q, k, val))
    o = F.scaled_dot_product_attention(q, k, val, scale=a.scaling)
    o = o.transpose(1, 2).reshape(n_tok, -1)
    h = h + (a.proj(o) if w8 is None else _linear(o, w8[1], a.proj.bias))
    x, m = blk.norm2(h), blk.mlp
    if w8 is None:
        return h + m(x)
    return h + _linear(m.act_fn(_linear(x, w8[2], m.linear_fc1.bias)), w8[3], m.linear_fc2.bias)


def _text_layer_fused(layer, w_qkv, b_qkv: torch.Tensor | None, w_gu, h: torch.Tensor,
                      attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w_o=None, w_down=None) -> torch.Tensor:
    """Qwen3VLTextDecoderLayer's math (sdpa path) with q/k/v and gate/up each one matmul
    (weights bf16 or `Fp8Weight`; w_o / w_down: FP8 o and down projections, else the modules)."""
    a, mlp = layer.self_attn, layer.mlp
    b, length, _ = h.shape
    hd = a.head_dim
    n_kv = a.k_proj.out_features // hd
    n_q = a.q_proj.out_features // hd
    x = layer.input_layernorm(h)
    q, k, v = _linear(x, w_qkv, b_qkv).split([n_q * hd, n_kv * hd, n_kv * hd], dim=-1)
    q = a.q_norm(q.view(b, length, n_q, hd)).transpose(1, 2)
    k = a.k_norm(k.view(b, length, n_kv, hd)).transpose(1, 2)
    v = v.view(b, length, n_kv, hd).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = (q * cos) + (_rotate_half(q) * sin)
    k = (k * cos) + (_rotate_half(k) * sin)
    # GQA as transformers' sdpa path does it with a mask: repeat the kv heads (the fused
    # attention kernels that take a mask do not take enable_gqa).
    group = n_q // n_kv
    k = k[:, :, None].expand(b, n_kv, group, length, hd).reshape(b, n_q, length, hd)
    v = v[:, :, None].expand(b, n_kv, group, length, hd).reshape(b, n_q, length, hd)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=a.scaling)
    o = o.transpose(1, 2).reshape(b, length, -1)
    h = h + (a.o_proj(o) if w_o is None else _linear(o, w_o, a.o_proj.bias))
    x = layer.post_attention_layernorm(h)
    g, u = _linear(x, w_gu).chunk(2, dim=-1)
    x = mlp.act_fn(g) * u
    return h + (mlp.down_proj(x) if w_down is None else _linear(x, w_down, mlp.down_proj.bias))


def _fused_weights(layer) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    a, mlp = layer.self_attn, layer.mlp
    w_qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
    b_qkv = (torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None)
    if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
        raise NotImplementedError("fused decoder layer: gate/up projections with a bias")
    return w_qkv, b_qkv, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])


def _text_layer(layer, h: torch.Tensor, attn: torch.Tensor, pos_emb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    out = layer(h, attention_mask=attn, position_embeddings=pos_emb, position_ids=None)
    return out[0] if isinstance(out, tuple) else out


# The adaptable linears of a decoder layer, in `_text_layer_lora`'s order (their module paths
# below ``<decoder>.layers.<i>.``).
LORA_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NO_LORA = (None,) * len(LORA_LINEARS)  # a layer nothing adapts, through `_text_layer_lora`


def _text_layer_lora(layer, h: torch.Tensor, attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     rows: torch.Tensor | None, lora: tuple, fused: tuple = (), fp8: tuple = (),
                     return_kv: bool = False):
    """Qwen3VLTextDecoderLayer's math (sdpa path) with each row's own LoRA delta on its adapted
    linears (`models.lora.pooled_delta`; ``lora``: per `LORA_LINEARS` entry an `AdapterPool`'s
    (A, B) or None). The base part is the same ops as the module's own forward (separate
    q/k/v, gate/up), or with ``fused`` (w_qkv, b_qkv, w_gu) and ``fp8`` (w_o, w_down) as
    `_text_layer_fused` runs it; each delta is accumulated onto its projection's output.

    ``return_kv``: (h, keys, values), the layer's keys and values as its KV cache holds them
    ((B, kv_heads, L, head_dim), keys normed and rotated, the base dtype): the prefix an action
    expert reads (`models.outputs.PrefixKV`). With ``lora`` all None (and ``rows`` None) this is the
    frozen layer, so one function serves expert, LoRA and frozen rows in one forward."""
    from models.lora import pooled_delta

    a, mlp = layer.self_attn, layer.mlp
    b, length, _ = h.shape
    hd = a.head_dim
    n_kv = a.k_proj.out_features // hd
    n_q = a.q_proj.out_features // hd

    def plus(y: torch.Tensor, x: torch.Tensor, j: int) -> torch.Tensor:
        return y if lora[j] is None else pooled_delta(y, x, *lora[j], rows)

    x = layer.input_layernorm(h)
    if fused:
        q, k, v = _linear(x, fused[0], fused[1]).split([n_q * hd, n_kv * hd, n_kv * hd], dim=-1)
    else:
        q, k, v = (F.linear(x, m.weight, m.bias) for m in (a.q_proj, a.k_proj, a.v_proj))
    q, k, v = plus(q, x, 0), plus(k, x, 1), plus(v, x, 2)
    q = a.q_norm(q.view(b, length, n_q, hd)).transpose(1, 2)
    k = a.k_norm(k.view(b, length, n_kv, hd)).transpose(1, 2)
    v = v.view(b, length, n_kv, hd).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = (q * cos) + (_rotate_half(q) * sin)
    k = (k * cos) + (_rotate_half(k) * sin)
    k_cache, v_cache = k, v
    group = n_q // n_kv  # GQA as transformers' sdpa path does it (see `_text_layer_fused`)
    k = k[:, :, None].expand(b, n_kv, group, length, hd).reshape(b, n_q, length, hd)
    v = v[:, :, None].expand(b, n_kv, group, length, hd).reshape(b, n_q, length, hd)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=a.scaling)
    o = o.transpose(1, 2).reshape(b, length, -1)
    h = h + plus(_linear(o, fp8[0], a.o_proj.bias) if fp8 else F.linear(o, a.o_proj.weight, a.o_proj.bias), o, 3)
    x = layer.post_attention_layernorm(h)
    if fused:
        g, u = _linear(x, fused[2]).chunk(2, dim=-1)
    else:
        g, u = F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias), F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
    x = mlp.act_fn(plus(g, x, 4)) * plus(u, x, 5)
    down = _linear(x, fp8[1], mlp.down_proj.bias) if fp8 else F.linear(x, mlp.down_proj.weight, mlp.down_proj.bias)
    h = h + plus(down, x, 6)
    return (h, k_cache, v_cache) if return_kv else h


def _check_fp8_device(device: torch.device, fp8: bool | str = True) -> None:
    """FP8 matmuls (`torch._scaled_mm` on float8_e4m3fn) run on CUDA GPUs of compute capability
    8.9+ (Ada, Hopper) only: refuse anything else up front, not at the first forward. Row-wise
    scales with a bf16 output need sm90 (Hopper)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"fp8={fp8!r}: FP8 matmuls (torch._scaled_mm) need a CUDA GPU of compute capability "
                         f"8.9+ (Ada, Hopper); this base is on {device}")
    cap = torch.cuda.get_device_capability(device)
    need = (9, 0) if fp8 == "rowwise" else (8, 9)
    if cap < need:
        raise ValueError(f"fp8={fp8!r}: FP8 matmuls need compute capability {need[0]}.{need[1]}+; "
                         f"{device} has {cap[0]}.{cap[1]}")


class FastQwen3VLEncoder:
    def __init__(self, base, compile: bool = False, fused: bool = False, dynamic: bool | None = False,
                 fp8: bool | str = False, fp8_fast_accum: bool = False, fp8_vision: bool = True) -> None:
        # fp8: False (bf16), True or "tensor" (one scale per tensor), "rowwise" (per token x per
        # output channel); fp8_vision=False keeps the vision blocks bf16 (FP8 did not pay there).
        if fp8 is True:
            fp8 = "tensor"
        if fp8 and fp8 not in FP8_MODES:
            raise ValueError(f"fp8={fp8!r}: one of False, True, {', '.join(map(repr, FP8_MODES))}")
        if fp8:
            _check_fp8_device(base.device, True if fp8 == "tensor" else fp8)
        self.base = base
        self.core = base.core
        self.family = base.family
        self.fused = fused or fp8
        self._vision_block = _vision_block
        self._text_layer = _text_layer
        self._text_layer_fused = _text_layer_fused
        self._text_layer_lora = _text_layer_lora
        # LoRA rows (models.lora.AdapterPool, built at the first adapted group): per decoder layer
        # the pool's (A, B) per `LORA_LINEARS` entry, None for a layer nothing adapts.
        self.lora_pool = None
        # Tenants' plain `mlp` heads stacked per shape (models.heads.pool.HeadPool, built at the
        # first group that brings them), so a serving group's heads run inside its graph.
        self.head_pool = None
        self._lora_layers: list[tuple | None] = []
        self._lora_generation = -1
        self._lora_complete = False
        if compile:
            # One compiled function per layer kind, shared by all layers (their weights are
            # graph inputs), so compile time does not grow with depth. dynamic=False compiles
            # each batch size specialised (what was measured); dynamic=None (torch's automatic
            # dynamic: a second size recompiles once with the batch dimension symbolic, later
            # sizes reuse it) would let a server's capture sizes cost two compiles, not one
            # each: bench/fast_profile.py's `+dyn` variant measures its kernels.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self._vision_block = torch.compile(_vision_block, dynamic=dynamic)
            self._text_layer = torch.compile(_text_layer, dynamic=dynamic)
            self._text_layer_fused = torch.compile(_text_layer_fused, dynamic=dynamic)
            self._text_layer_lora = torch.compile(_text_layer_lora, dynamic=dynamic)
        # Profiling hook (bench/fast_profile.py): called with a stage name at stage ends of an
        # uncaptured forward; None in normal use (and never set while a graph is captured).
        self.on_stage: Callable[[str], None] | None = None
        self._fused: list[tuple] = []
        # fp8: per decoder layer (o, down) and per vision block (qkv, proj, fc1, fc2) FP8 weights.
        self._text_fp8: list[tuple] = [() for _ in self.core.language_model.layers]
        self._vis_fp8: list[tuple | None] = [None for _ in self.core.visual.blocks]
        with torch.no_grad():
            if self.fused:
                self._fused = [_fused_weights(layer) for layer in self.core.language_model.layers]
            if fp8:
                q8 = lambda w: _fp8_weight(w, fp8_fast_accum, rowwise=fp8 == "rowwise")  # noqa: E731
                self._fused = [(q8(wq), bq, q8(wg)) for wq, bq, wg in self._fused]
                self._text_fp8 = [(q8(lay.self_attn.o_proj.weight), q8(lay.mlp.down_proj.weight))
                                  for lay in self.core.language_model.layers]
                if fp8_vision:
                    self._vis_fp8 = [(q8(blk.attn.qkv.weight), q8(blk.attn.proj.weight), q8(blk.mlp.linear_fc1.weight),
                                      q8(blk.mlp.linear_fc2.weight)) for blk in self.core.visual.blocks]
            proj = self.core.visual.patch_embed.proj
            # A Conv3d whose kernel equals its stride: one matmul per flat patch, laid out
            # (C, T, H, W) as the kernel is (patchify's layout). A view: no weight copy (and
            # the identity where a transformers version already made the proj a Linear).
            self._patch_w = (proj.weight.view(proj.weight.shape[0], -1), proj.bias)
        self.use_graphs = base.device.type == "cuda"
        self._consts: dict[tuple[FeatureLayout, int], _Consts] = {}
        self._graphs: dict[tuple[FeatureLayout, int], tuple[torch.cuda.CUDAGraph, list, tuple]] = {}

    # ---- constants per (layout, B) ----------------------------------------------------------
    def consts(self, layout: FeatureLayout, b: int) -> _Consts:
        key = (layout, b)
        c = self._consts.get(key)
        if c is None:
            c = self._build_consts(layout, b)
            self._consts[key] = c
        return c

    def _build_consts(self, layout: FeatureLayout, b: int) -> _Consts:
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

        dev, v = self.base.device, self.core.visual
        sk = self.family.skeleton(layout, self.base.lead_ids)
        ids_L = sk.ids_L.to(dev)
        length = sk.length
        img_pos = (ids_L == self.family.ids.image).nonzero().squeeze(1)
        img_flat = (torch.arange(b, device=dev)[:, None] * length + img_pos[None, :]).reshape(-1)
        gh, gw = self.family.grid(layout)
        grid = torch.tensor([[1, gh, gw]], device=dev)
        with torch.no_grad():
            idx, w = get_vision_interpolation_indices_and_weights(
                grid, num_grid_per_side=v.num_grid_per_side, mode=v.interpolation_mode,
                align_corners=v.interpolation_align_corners, spatial_merge_size=v.config.spatial_merge_size)
            pos = (v.pos_embed(idx) * w[:, :, None]).sum(1)  # float weights promote, as in transformers
            rot_ids = get_vision_position_ids(grid, v.spatial_merge_size)
            cos, sin = v.rotary_pos_emb(pos, rot_ids)
        n_img = b * layout.camera_slots
        causal = torch.ones(length, length, dtype=torch.bool, device=dev).tril()
        return _Consts(
            ids_L=ids_L, slot_L=sk.slot_L.to(dev), prompt_start=sk.prompt_start, img_flat_idx=img_flat,
            vis_pos=pos.to(self.base.dtype).repeat(n_img, 1), vis_cos=cos.repeat(n_img, 1),
            vis_sin=sin.repeat(n_img, 1), causal_L_L=causal, tokens_per_image=gh * gw,
        )

    # ---- the forward ------------------------------------------------------------------------
    def _forward(self, c: _Consts, layout: FeatureLayout, prompt_ids: torch.Tensor, prompt_len: torch.Tensor,
                 image_mask: torch.Tensor, images: torch.Tensor, rows: torch.Tensor | None = None,
                 kv: bool = False, lora_layers: list[tuple | None] | None = None, heads=None,
                 state: torch.Tensor | None = None, head_idx: list[torch.Tensor] | None = None) -> tuple:
        """(hidden, mask), or with ``kv`` (hidden, mask, keys, values, next_pos_B): every decoder
        layer's cache as `Family.forward_kv` returns it and `Family.next_positions`.
        ``lora_layers``: per decoder layer the (A, B) per `LORA_LINEARS` entry that ``rows``
        index (a training forward's `training_stack`); default the pool's. ``heads`` (a
        `models.heads.pool.HeadPlan`) with ``state`` and ``head_idx``: also every bucket's
        actions for all rows, (hidden, mask, actions per bucket)."""
        lora_layers = self._lora_layers if lora_layers is None else lora_layers
        fam, dtype = self.family, self.base.dtype
        b, s = image_mask.shape
        t = prompt_ids.shape[1]
        # 1. token ids and mask from the skeleton (as Skeleton.fill, without host copies)
        ids = c.ids_L.expand(b, -1).clone()
        ids[:, c.prompt_start:c.prompt_start + t] = prompt_ids
        in_slot = c.slot_L >= 0
        present = image_mask.gather(1, c.slot_L.clamp(min=0).expand(b, -1))
        mask = torch.where(in_slot, present, torch.ones_like(present))
        mask[:, c.prompt_start:c.prompt_start + t] = torch.arange(t, device=ids.device)[None] < prompt_len[:, None]
        mask_l = mask.long()
        mm_type = (ids == fam.ids.image).long()
        pos3 = fam.position_ids(mm_type, mask_l, layout)
        # 2. vision tower, all images batched
        pixels = fam.patchify(fam.normalize(images.reshape(b * s, 3, *layout.image_size), dtype))
        self._stage("inputs")
        image_embeds, deepstack = self._vision(pixels, c)
        self._stage("vision_blocks")  # the blocks and the mergers
        # 3. language model
        lm = self.core.language_model
        h = lm.embed_tokens(ids)
        d = h.shape[-1]
        h = h.reshape(-1, d).index_copy(0, c.img_flat_idx, image_embeds.to(h.dtype)).view(b, -1, d)
        pos_emb = lm.rotary_emb(h, pos3)
        attn = (c.causal_L_L[None] & mask[:, None, :])[:, None]  # (B, 1, L, L), True = attend
        self._stage("embed")
        keys, values = [], []
        for i, layer in enumerate(lm.layers):
            lora = lora_layers[i] if rows is not None else None
            if kv:
                # Expert rows: every layer through the function that also hands back its cache
                # (frozen and LoRA rows of the same group go through it too).
                h, k, v = self._text_layer_lora(layer, h, attn, *pos_emb, rows if lora is not None else None,
                                                lora if lora is not None else _NO_LORA,
                                                self._fused[i] if self.fused else (), self._text_fp8[i],
                                                return_kv=True)
                keys.append(k)
                values.append(v)
            elif lora is not None:
                h = self._text_layer_lora(layer, h, attn, *pos_emb, rows, lora,
                                          self._fused[i] if self.fused else (), self._text_fp8[i])
            elif self.fused:
                h = self._text_layer_fused(layer, *self._fused[i], h, attn, *pos_emb, *self._text_fp8[i])
            else:
                h = self._text_layer(layer, h, attn, pos_emb)
            if i < len(deepstack):
                h = h.reshape(-1, d).index_add(0, c.img_flat_idx, deepstack[i].to(h.dtype)).view(b, -1, d)
        h = lm.norm(h)
        self._stage("text")
        if heads is not None:
            from models.heads.pool import pooled_mlp

            q = h[:, -layout.num_query_tokens:]
            acts = tuple(pooled_mlp(t, shape, q, state, i) for t, shape, i in zip(heads.tensors, heads.shapes, head_idx))
            return h, mask, acts
        if kv:
            # As Family.next_positions: the largest position id of the row (any axis) + 1.
            return h, mask, tuple(keys), tuple(values), pos3.amax(dim=(0, 2)) + 1
        return h, mask

    def _stage(self, name: str) -> None:
        if self.on_stage is not None:
            self.on_stage(name)

    def _vision(self, pixels: torch.Tensor, c: _Consts) -> tuple[torch.Tensor, list[torch.Tensor]]:
        v = self.core.visual
        h = F.linear(pixels.to(self._patch_w[0].dtype), *self._patch_w) + c.vis_pos
        self._stage("patch_embed")
        n_tok = h.shape[0]
        p = c.tokens_per_image
        n_img = n_tok // p
        cos = c.vis_cos.unsqueeze(-2).float()
        sin = c.vis_sin.unsqueeze(-2).float()
        deepstack = []
        for layer_num, blk in enumerate(v.blocks):
            h = self._vision_block(blk, h, cos, sin, n_img, p, self._vis_fp8[layer_num])
            if layer_num in v.deepstack_visual_indexes:
                deepstack.append(v.deepstack_merger_list[v.deepstack_visual_indexes.index(layer_num)](h))
        return v.merger(h), deepstack

    # ---- LoRA rows ----------------------------------------------------------------------------
    def lora_rows(self, segments: list, rows: int) -> torch.Tensor | None:
        """The adapter index per row of a group (`models.lora.AdapterPool.assign`, on the base's
        device) for `__call__`, every segment's adapter copied into the pool if it changed; None
        when the pool cannot hold them all (the caller takes the plain forward)."""
        from models.lora import AdapterPool, router_for

        if self.lora_pool is None:
            router = router_for(self.base)
            self.lora_pool = AdapterPool(router.shapes, self.base.lora_pool_size, self.base.device, self.base.dtype)
        pool = self.lora_pool
        idx = pool.assign(segments, rows)
        if idx is None:
            return None
        if pool.generation != self._lora_generation:
            # New pool tensors: layers map to them again, and graphs captured on the old ones go.
            prefix = f"{self.family.text_decoder}.layers."
            self._lora_layers = []
            for i in range(len(self.core.language_model.layers)):
                mods = tuple(pool.layer(f"{prefix}{i}.{name}") for name in LORA_LINEARS)
                self._lora_layers.append(mods if any(m is not None for m in mods) else None)
            # An adapted linear `_text_layer_lora` does not run (none on these bases) would lose
            # its delta: such groups take the plain forward.
            self._lora_complete = sum(m is not None for mods in self._lora_layers if mods for m in mods) == len(pool.A)
            self._graphs = {k: g for k, g in self._graphs.items() if k[2] is None}
            self._lora_generation = pool.generation
        return idx.to(self.base.device) if self._lora_complete else None

    def train_forward(self, batch: VLABatch, segments: list, kv: bool = False) -> tuple | None:
        """The encode of ``batch`` with each segment's adapter on its rows, recording autograd into
        the adapters' own parameters (never the base's: its weights do not require grad), as
        `__call__` returns it; None when an adapted linear is one `_text_layer_lora` does not run
        (the caller takes the plain forward). Not captured: a CUDA graph replays no autograd
        graph, and a training group's rows change with every step; with ``compile`` the blocks
        are compiled (forward and backward) once per shape and grad mode."""
        from models.lora import training_stack

        layout, b = batch.key.layout, len(batch)
        stack, rows = training_stack(segments, b, self.base.dtype)
        prefix = f"{self.family.text_decoder}.layers."
        layers: list[tuple | None] = []
        used = 0
        for i in range(len(self.core.language_model.layers)):
            mods = tuple(stack.get(f"{prefix}{i}.{name}") for name in LORA_LINEARS)
            used += sum(m is not None for m in mods)
            layers.append(mods if any(m is not None for m in mods) else None)
        if used != len(stack):
            return None
        inputs = [batch.prompt_ids_B_T, batch.prompt_len_B, batch.image_mask_B_S, batch.images_B_S_C_H_W]
        return self._forward(self.consts(layout, b), layout, *inputs, rows.to(self.base.device), kv=kv,
                             lora_layers=layers)

    # ---- entry point --------------------------------------------------------------------------
    def __call__(self, batch: VLABatch, rows: torch.Tensor | None = None, kv: bool = False, heads=None) -> tuple:
        """The encode of ``batch``: (hidden, mask); ``rows`` (from `lora_rows`): each row's LoRA
        adapter index, for a group with adapted rows (a graph of its own per pool generation,
        the row assignment one of its static inputs). ``kv``: also every decoder layer's keys
        and values and each row's next position, (hidden, mask, keys, values, next_pos_B), from
        the same forward (a graph of its own: the cache is more static outputs). ``heads`` (a
        `models.heads.pool.HeadPlan`, not with ``kv``): the group's plain `mlp` heads inside the
        same graph, (hidden, mask, actions per bucket) (a graph per head-pool generation)."""
        if heads is not None and kv:
            raise ValueError("heads inside the graph: not with the prefix-KV outputs (expert rows)")
        layout, b = batch.key.layout, len(batch)
        c = self.consts(layout, b)
        inputs = [batch.prompt_ids_B_T, batch.prompt_len_B, batch.image_mask_B_S, batch.images_B_S_C_H_W]
        # (layout, rows, LoRA pool generation or None, cache outputs)
        key: tuple = (layout, b, None, kv, heads.generation if heads is not None else None)
        if rows is not None:
            key = (layout, b, self._lora_generation, kv, key[4])
        inputs.append(rows)
        extra: dict = {}
        if heads is not None:
            extra = {"heads": heads, "state": batch.state_B_D,
                     "head_idx": [i.to(self.base.device) for i in heads.idx]}
        if not self.use_graphs:
            return self._forward(c, layout, *inputs, kv=kv, **extra)
        with torch.inference_mode(False), torch.no_grad():
            if heads is not None:
                inputs = [*inputs, extra["state"], *extra["head_idx"]]
            g = self._graphs.get(key)
            if g is None:
                g = self._capture(c, layout, inputs, kv, heads)
                self._graphs[key] = g
            graph, static_in, static_out = g
            for dst, src in zip(static_in, inputs):
                if dst is not None:
                    dst.copy_(src)
            graph.replay()
            # Outputs live in the graph's pool and are overwritten by the next replay.
            if heads is not None:
                return static_out[0].clone(), static_out[1].clone(), tuple(a.clone() for a in static_out[2])
            if not kv:
                return static_out[0].clone(), static_out[1].clone()
            h, mask, keys, values, next_pos = static_out
            return (h.clone(), mask.clone(), tuple(k.clone() for k in keys), tuple(v.clone() for v in values),
                    next_pos.clone())

    def _capture(self, c: _Consts, layout: FeatureLayout, inputs: list[torch.Tensor | None], kv: bool = False,
                 heads=None):
        static_in = [x.clone() if x is not None else None for x in inputs]
        base_in, extra = static_in[:5], {}
        if heads is not None:  # the state and each bucket's row indices follow the base's inputs
            extra = {"heads": heads, "state": static_in[5], "head_idx": static_in[6:]}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: cuBLAS handles and workspaces exist before capture
                self._forward(c, layout, *base_in, kv=kv, **extra)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self._forward(c, layout, *base_in, kv=kv, **extra)
        return graph, static_in, static_out
