"""`gaussian`: RL policy head. Diagonal Gaussian over the flattened action chunk with a
state-independent log-std, plus a value head; log-prob and entropy for PPO.

loss(): PPO clipped surrogate + value MSE - entropy bonus when the batch carries RL fields
(old_log_prob_B, advantages_B, returns_B); plain negative log-likelihood (behaviour cloning)
when it does not. With ``batch.kl_coef`` > 0 either adds ``kl_coef * KL(pi || pi_anchor)``: the
closed-form KL between this policy's diagonal Gaussian and the anchor's (a frozen copy of the
policy part, everything but the value net, taken by `take_anchor`; its mean on the same
features), averaged over the batch, reported as ``kl_ref``. The anchor is held as
non-persistent buffers under ``anchor.``: it moves with the head and counts in its memory, but
stays out of the exported params (an inferencer never needs it); the slot checkpoints it.
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
    # The value net reads the shared trunk's features detached: its loss trains the value net
    # alone. For PPO from an SFT start: the value net starts untrained, and its large first
    # errors, sent back through the trunk, move the features the SFT mean was built on (the
    # PushCube runs in docs/results.md lost SFT skill even in value-only warm-up updates).
    value_detach: bool = False

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
        self.anchor = nn.Module()  # the KL anchor's buffers, by policy tensor name (none held yet)

    def forward(self, feats: BaseOutput, vla: VLABatch) -> torch.Tensor:
        """The policy's mean (B, H * A): what `functional_call` runs with the anchor's tensors."""
        return self.mean(self.trunk(feats, vla))

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
        return self.mean(h), self.value(h.detach() if self.config.value_detach else h).squeeze(-1)

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

    # ---- the KL anchor ------------------------------------------------------------------
    def policy_tensors(self) -> dict[str, torch.Tensor]:
        """What the action distribution is made of (mean and log_std): every parameter and
        buffer but the value net's (and the anchor's own)."""
        named = [*self.named_parameters(), *self.named_buffers()]
        return {n: t for n, t in named if not n.startswith(("value.", "anchor."))}

    def take_anchor(self) -> None:
        self.set_anchor({n: t.detach().clone() for n, t in self.policy_tensors().items()})

    def set_anchor(self, tensors: dict[str, torch.Tensor]) -> None:
        own = self.policy_tensors()
        if set(tensors) != set(own):
            missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
            raise InputError(f"anchor tensors differ from the policy's: missing {missing[:5]}, unexpected {extra[:5]}")
        store = nn.Module()
        for name, t in tensors.items():
            if t.shape != own[name].shape or t.dtype != own[name].dtype:
                raise InputError(f"anchor tensor {name}: {tuple(t.shape)}/{t.dtype}, the policy's is "
                                 f"{tuple(own[name].shape)}/{own[name].dtype}")
            *path, leaf = name.split(".")
            node = store
            for part in path:
                if not hasattr(node, part):
                    node.add_module(part, nn.Module())
                node = getattr(node, part)
            node.register_buffer(leaf, t.detach().to(own[name].device).clone(), persistent=False)
        self.anchor = store

    def drop_anchor(self) -> None:
        self.anchor = nn.Module()

    def anchor_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.anchor.named_buffers())

    def anchor_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.policy_tensors().values())

    def kl_to_anchor(self, mean: torch.Tensor, feats: BaseOutput, vla: VLABatch) -> torch.Tensor:
        """Mean over rows of KL(N(mean, std) || N(anchor mean, anchor std)), summed over the
        action dims; the anchor's side without gradient."""
        anchor = self.anchor_tensors()
        if not anchor:
            raise InputError("gaussian loss: kl_coef > 0 but no anchor is held (TenantSlot.use_anchor takes it)")
        with torch.no_grad():
            ref_mean = torch.func.functional_call(self, anchor, (feats, vla), strict=False)
        ref_log_std = anchor["log_std"]
        var_ratio = torch.exp(2 * (self.log_std - ref_log_std))
        diff = (mean - ref_mean) * torch.exp(-ref_log_std)
        kl = (ref_log_std - self.log_std) + 0.5 * (var_ratio + diff.pow(2) - 1)
        return kl.sum(-1).mean()

    def loss(self, feats: BaseOutput, batch: TenantBatch, generator: torch.Generator) -> LossOutput:
        actions = self.check_actions(batch.actions_B_H_A).flatten(1)
        mean, value = self._mean_value(feats, batch.features)
        log_prob, entropy = self._log_prob(mean, actions), self.entropy(actions.shape[0])
        out = self._objective(log_prob, entropy, value, batch)
        if batch.kl_coef > 0:
            kl = self.kl_to_anchor(mean, feats, batch.features)
            out.loss = out.loss + batch.kl_coef * kl
            out.metrics["kl_ref"] = float(kl.detach())
        return out

    def _objective(self, log_prob: torch.Tensor, entropy: torch.Tensor, value: torch.Tensor, batch: TenantBatch
                   ) -> LossOutput:
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
