"""`flow`: GR00T-style flow-matching action head: a small DiT over action tokens that
cross-attends the base's hidden states (prefix mask respected).

Training: t = (s_max - s) / s_max with s ~ Beta(alpha, 1) (GR00T N1: alpha 1.5, s_max 0.999),
x_t = (1 - t) noise + t actions, loss = MSE(v(x_t, t), actions - noise).
Inference: K Euler steps from noise (t=0) to actions (t=1). Beta(alpha, 1) is sampled by its
inverse CDF u^(1/alpha), so the slot's seeded generator is the only source of randomness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.errors import SchemaError
from models.features import VLABatch
from models.heads.base import ActionHead, HeadDims, LossOutput, TenantBatch, positive, rand, randn, register_head
from models.outputs import BaseOutput


@dataclass(frozen=True)
class FlowHeadConfig:
    width: int = 256
    depth: int = 2  # DiT blocks
    num_heads: int = 4
    beta_alpha: float = 1.5
    max_time: float = 0.999
    euler_steps: int = 4

    def __post_init__(self) -> None:
        positive("flow.width", self.width)
        positive("flow.depth", self.depth)
        positive("flow.euler_steps", self.euler_steps)
        positive("flow.beta_alpha", self.beta_alpha)
        if self.width % self.num_heads:
            raise SchemaError(f"flow.num_heads={self.num_heads}: must divide flow.width={self.width}")
        if not 0 < self.max_time <= 1:
            raise SchemaError(f"flow.max_time={self.max_time}: must be in (0, 1]")


def timestep_embedding(t_B: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t_B.device, dtype=torch.float32) / half)
    args = (t_B.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class DiTBlock(nn.Module):
    """adaLN self-attention over action tokens, cross-attention to base features, MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False)
        self.self_attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.cross_attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm3 = nn.LayerNorm(width, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.ada = nn.Linear(width, 6 * width)
        # adaLN-zero: each block starts as identity, as in DiT.
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, ctx: torch.Tensor, ctx_pad: torch.Tensor) -> torch.Tensor:
        s1, b1, g1, s2, b2, g2 = self.ada(F.silu(temb)).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm1(x) * (1 + s1) + b1
        x = x + g1 * self.self_attn(h, h, h, need_weights=False)[0]
        h = self.norm2(x)
        x = x + self.cross_attn(h, ctx, ctx, key_padding_mask=ctx_pad, need_weights=False)[0]
        h = self.norm3(x) * (1 + s2) + b2
        return x + g2 * self.mlp(h)


class FlowMatchingHead(ActionHead):
    """Flow matching on an action chunk, whatever network gives the velocity: subclasses
    implement `context` (computed once per batch) and `velocity`. Their configs carry
    beta_alpha, max_time and euler_steps."""

    def context(self, feats: BaseOutput) -> tuple[object, torch.Tensor]:
        raise NotImplementedError

    def velocity(self, x_B_H_A: torch.Tensor, t_B: torch.Tensor, state: torch.Tensor | None,
                 ctx: object, ctx_pad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _state_or_none(self, vla: VLABatch) -> torch.Tensor | None:
        return self.state(vla) if self.dims.state_dim else None

    def sample_time(self, b: int, generator: torch.Generator) -> torch.Tensor:
        u = rand((b,), generator, self._device)
        s = u.pow(1.0 / self.config.beta_alpha)  # Beta(alpha, 1) by inverse CDF
        return (self.config.max_time - s * self.config.max_time) / self.config.max_time

    def loss(self, feats: BaseOutput, batch: TenantBatch, generator: torch.Generator) -> LossOutput:
        actions = self.check_actions(batch.actions_B_H_A)
        b = actions.shape[0]
        noise = randn(tuple(actions.shape), generator, self._device)
        t = self.sample_time(b, generator)
        x_t = (1 - t)[:, None, None] * noise + t[:, None, None] * actions
        ctx, pad = self.context(feats)
        v = self.velocity(x_t, t, self._state_or_none(batch.features), ctx, pad)
        loss = F.mse_loss(v, actions - noise)
        return LossOutput(loss, {"flow_mse": float(loss.detach())})

    def predict(self, feats: BaseOutput, vla: VLABatch, generator: torch.Generator) -> torch.Tensor:
        b = len(feats)
        x = randn((b, self.dims.action_horizon, self.dims.action_dim), generator, self._device)
        ctx, pad = self.context(feats)
        state = self._state_or_none(vla)
        k = self.config.euler_steps
        for i in range(k):
            t = torch.full((b,), i / k, device=x.device)
            x = x + self.velocity(x, t, state, ctx, pad) / k
        return x


@register_head("flow", FlowHeadConfig)
class FlowHead(FlowMatchingHead):
    def __init__(self, dims: HeadDims, config: FlowHeadConfig) -> None:
        super().__init__(dims, config)
        w = config.width
        self.ctx_norm = nn.LayerNorm(dims.hidden_size)
        self.ctx_proj = nn.Linear(dims.hidden_size, w)
        self.action_in = nn.Linear(dims.action_dim, w)
        self.state_in = nn.Linear(max(dims.state_dim, 1), w)
        self.pos = nn.Parameter(torch.randn(dims.action_horizon + 1, w) * 0.02)
        self.time_mlp = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.blocks = nn.ModuleList([DiTBlock(w, config.num_heads) for _ in range(config.depth)])
        self.out_norm = nn.LayerNorm(w)
        self.out = nn.Linear(w, dims.action_dim)

    def context(self, feats: BaseOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected base features and their key-padding mask; computed once per batch."""
        ctx = self.ctx_proj(self.ctx_norm(feats.hidden_B_L_D.to(self._device, torch.float32)))
        return ctx, ~feats.mask_B_L.to(self._device)

    def velocity(self, x_B_H_A: torch.Tensor, t_B: torch.Tensor, state: torch.Tensor | None,
                 ctx: torch.Tensor, ctx_pad: torch.Tensor) -> torch.Tensor:
        b = x_B_H_A.shape[0]
        s = self.state_in(state) if state is not None else torch.zeros(b, self.config.width, device=x_B_H_A.device)
        tokens = torch.cat([s.unsqueeze(1), self.action_in(x_B_H_A)], dim=1) + self.pos
        temb = self.time_mlp(timestep_embedding(t_B, self.config.width))
        for blk in self.blocks:
            tokens = blk(tokens, temb, ctx, ctx_pad)
        return self.out(self.out_norm(tokens[:, 1:]))
