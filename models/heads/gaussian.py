"""`gaussian`: RL policy head. Diagonal Gaussian over the flattened action chunk with a
state-independent log-std, plus a value head; log-prob and entropy for PPO.

loss(): PPO clipped surrogate + value MSE - entropy bonus when the batch carries RL fields
(old_log_prob_B, advantages_B, returns_B); plain negative log-likelihood (behaviour cloning)
when it does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from models.errors import InputError
from models.features import VLABatch
from models.heads.base import ActionHead, HeadDims, LossOutput, TenantBatch, mlp, positive, randn, register_head
from models.heads.vision import POOLINGS, ImageEncoder, InstructionEncoder
from models.outputs import BaseOutput

_LOG_2PI = math.log(2 * math.pi)


@dataclass(frozen=True)
class GaussianHeadConfig:
    width: int = 256
    init_log_std: float = -0.5
    clip_ratio: float = 0.2  # PPO
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    # A tenant-private CNN over the camera slots, as in the `mlp` head (0: none); see
    # models/heads/vision.py for the poolings.
    image_channels: int = 0
    image_pool: str = "keypoints"
    instruction_encoder: bool = False  # as in the `mlp` head

    def __post_init__(self) -> None:
        positive("gaussian.width", self.width)
        positive("gaussian.clip_ratio", self.clip_ratio)
        if self.image_channels < 0:
            raise ValueError(f"gaussian.image_channels={self.image_channels}: must be >= 0")
        if self.image_pool not in POOLINGS:
            raise ValueError(f"gaussian.image_pool={self.image_pool!r}: must be one of {POOLINGS}")


@register_head("gaussian", GaussianHeadConfig)
class GaussianHead(ActionHead):
    def __init__(self, dims: HeadDims, config: GaussianHeadConfig) -> None:
        super().__init__(dims, config)
        w = config.width
        n = dims.action_horizon * dims.action_dim
        self.norm = nn.LayerNorm(dims.hidden_size)
        self.in_proj = nn.Linear(dims.hidden_size + dims.state_dim, w)
        self.mean = mlp([w, w, n])
        self.value = mlp([w, w, 1])
        self.log_std = nn.Parameter(torch.full((n,), float(config.init_log_std)))
        self.instruction_encoder = self.instruction_proj = None
        if config.instruction_encoder:
            self.instruction_encoder = InstructionEncoder()
            self.instruction_proj = nn.Linear(self.instruction_encoder.dim, w)
        cond = self.instruction_encoder.dim if self.instruction_encoder is not None else 0
        self.image_encoder = (
            ImageEncoder(dims.camera_slots, config.image_channels, w, config.image_pool, cond)
            if config.image_channels else None
        )

    def trunk(self, feats: BaseOutput, vla: VLABatch) -> torch.Tensor:
        pooled = self.norm(feats.query_B_Q_D.to(self._device, torch.float32)).mean(dim=1)
        x = torch.cat([pooled, self.state(vla)], dim=-1) if self.dims.state_dim else pooled
        h = self.in_proj(x)
        text = None
        if self.instruction_encoder is not None:
            text = self.instruction_encoder(vla.prompt_ids_B_T.to(self._device), vla.prompt_len_B)
            h = h + self.instruction_proj(text)
        if self.image_encoder is not None:
            h = h + self.image_encoder(vla.images_B_S_C_H_W.to(self._device, torch.float32), text)
        return F.gelu(h)

    def _mean_value(self, feats: BaseOutput, vla: VLABatch) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(feats, vla)
        return self.mean(h), self.value(h).squeeze(-1)

    def _log_prob(self, mean: torch.Tensor, flat_actions: torch.Tensor) -> torch.Tensor:
        z = (flat_actions - mean) * torch.exp(-self.log_std)
        return (-0.5 * z.pow(2) - self.log_std - 0.5 * _LOG_2PI).sum(-1)

    def entropy(self, b: int) -> torch.Tensor:
        return (self.log_std + 0.5 * (1.0 + _LOG_2PI)).sum().expand(b)

    def evaluate_actions(self, feats: BaseOutput, vla: VLABatch, actions_B_H_A: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log_prob_B, entropy_B, value_B) of given actions: what PPO needs per minibatch."""
        actions = self.check_actions(actions_B_H_A).flatten(1)
        mean, value = self._mean_value(feats, vla)
        return self._log_prob(mean, actions), self.entropy(actions.shape[0]), value

    def act(self, feats: BaseOutput, vla: VLABatch, generator: torch.Generator,
            deterministic: bool | Sequence[bool] | torch.Tensor = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rollout step: (actions_B_H_A, log_prob_B, value_B).

        ``deterministic``: one flag for every row, or one per row (the inferencer groups rows of
        many requests, each with its own ``sample`` flag): a deterministic row gets the mean, a
        sampled row mean + std * noise. Noise is drawn only for the sampled rows, so a
        deterministic row never advances the generator."""
        mean, value = self._mean_value(feats, vla)
        det_B = torch.as_tensor(deterministic, dtype=torch.bool).flatten().cpu()
        if det_B.numel() == 1:
            det_B = det_B.expand(mean.shape[0])
        if det_B.numel() != mean.shape[0]:
            raise InputError(f"deterministic: {det_B.numel()} flags for {mean.shape[0]} rows")
        sampled = (~det_B).nonzero().flatten()
        flat = mean
        if len(sampled):
            noise = randn((len(sampled), mean.shape[1]), generator, mean.device)
            flat = mean.clone()
            rows = sampled.to(mean.device)
            flat[rows] = mean[rows] + torch.exp(self.log_std) * noise
        return flat.view(-1, self.dims.action_horizon, self.dims.action_dim), self._log_prob(mean, flat), value

    def loss(self, feats: BaseOutput, batch: TenantBatch, generator: torch.Generator) -> LossOutput:
        log_prob, entropy, value = self.evaluate_actions(feats, batch.features, batch.actions_B_H_A)
        rl = (batch.old_log_prob_B, batch.advantages_B, batch.returns_B)
        if all(x is None for x in rl):
            loss = -log_prob.mean()
            return LossOutput(loss, {"nll": float(loss.detach())})
        if any(x is None for x in rl):
            raise InputError("gaussian PPO loss: old_log_prob_B, advantages_B and returns_B must all be set")
        old, adv, ret = (x.to(self._device, torch.float32) for x in rl)
        ratio = torch.exp(log_prob - old)
        clip = self.config.clip_ratio
        policy_loss = -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean()
        value_loss = F.mse_loss(value, ret)
        ent = entropy.mean()
        loss = policy_loss + self.config.value_coef * value_loss - self.config.entropy_coef * ent
        with torch.no_grad():
            metrics = {
                "policy_loss": float(policy_loss), "value_loss": float(value_loss), "entropy": float(ent),
                "approx_kl": float((old - log_prob).mean()),
                "clip_frac": float(((ratio - 1).abs() > clip).float().mean()),
            }
        return LossOutput(loss, metrics)

    def predict(self, feats: BaseOutput, vla: VLABatch, generator: torch.Generator) -> torch.Tensor:
        return self.act(feats, vla, generator, deterministic=True)[0]
