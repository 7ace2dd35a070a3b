"""`mlp`: OFT-style parallel decoding. L1 regression of the whole action chunk from the
hidden states at the action-query positions (plus proprio state), in one pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.features import VLABatch
from models.heads.base import ActionHead, HeadDims, LossOutput, TenantBatch, mlp, positive, register_head
from models.heads.vision import POOLINGS, ImageEncoder, InstructionEncoder
from models.outputs import BaseOutput


@dataclass(frozen=True)
class MLPHeadConfig:
    width: int = 256  # per-query projection and trunk width
    depth: int = 2  # hidden layers of the trunk
    # Channels of a small tenant-private CNN over the canonical camera slots (0: none). A frozen
    # random base keeps little of *where* things are in a frame (docs/results.md); this gives
    # the head its own trainable view, still without touching the shared base.
    image_channels: int = 0
    # How the CNN pools its map: "flatten" (a coarse 4x4 grid) or "keypoints" (a spatial
    # softmax: one expected (x, y) per channel; see models/heads/vision.py).
    image_pool: str = "flatten"
    # A tenant-private bag of hashed instruction n-grams (models/heads/vision.py): a direct
    # path for *which* task was asked, which the frozen base's query states blur.
    instruction_encoder: bool = False
    # Feed the proprio state to the head. False drops it: where the state holds the last
    # commanded velocity, behaviour cloning otherwise learns to copy the previous action.
    use_state: bool = True

    def __post_init__(self) -> None:
        positive("mlp.width", self.width)
        positive("mlp.depth", self.depth)
        if self.image_channels < 0:
            raise ValueError(f"mlp.image_channels={self.image_channels}: must be >= 0")
        if self.image_pool not in POOLINGS:
            raise ValueError(f"mlp.image_pool={self.image_pool!r}: must be one of {POOLINGS}")


@register_head("mlp", MLPHeadConfig)
class MLPHead(ActionHead):
    def __init__(self, dims: HeadDims, config: MLPHeadConfig) -> None:
        super().__init__(dims, config)
        w = config.width
        self.norm = nn.LayerNorm(dims.hidden_size)
        self.query_proj = nn.Linear(dims.hidden_size, w)
        self.state_proj = nn.Linear(max(dims.state_dim, 1), w * dims.num_queries)
        out = dims.action_horizon * dims.action_dim
        self.trunk = mlp([w * dims.num_queries] + [w] * config.depth + [out])
        self.instruction_encoder = self.instruction_proj = None
        if config.instruction_encoder:
            self.instruction_encoder = InstructionEncoder()
            self.instruction_proj = nn.Linear(self.instruction_encoder.dim, w * dims.num_queries)
        self.image_encoder = None
        if config.image_channels:
            # FiLM-conditioned on the instruction when the head has its own instruction encoder.
            cond = self.instruction_encoder.dim if self.instruction_encoder is not None else 0
            self.image_encoder = ImageEncoder(
                dims.camera_slots, config.image_channels, w * dims.num_queries, config.image_pool, cond
            )

    def forward(self, feats: BaseOutput, vla: VLABatch) -> torch.Tensor:
        q = self.query_proj(self.norm(feats.query_B_Q_D.to(self._device, torch.float32)))
        x = F.gelu(q).flatten(1)
        text = None
        if self.instruction_encoder is not None:
            text = self.instruction_encoder(vla.prompt_ids_B_T.to(self._device), vla.prompt_len_B)
            x = x + self.instruction_proj(text)
        if self.image_encoder is not None:
            x = x + self.image_encoder(vla.images_B_S_C_H_W.to(self._device, torch.float32), text)
        if self.dims.state_dim and self.config.use_state:
            x = x + self.state_proj(self.state(vla))
        return self.trunk(x).view(-1, self.dims.action_horizon, self.dims.action_dim)

    def loss(self, feats: BaseOutput, batch: TenantBatch, generator: torch.Generator) -> LossOutput:
        target = self.check_actions(batch.actions_B_H_A)
        loss = F.l1_loss(self(feats, batch.features), target)
        return LossOutput(loss, {"l1": float(loss.detach())})

    def predict(self, feats: BaseOutput, vla: VLABatch, generator: torch.Generator) -> torch.Tensor:
        return self(feats, vla)
