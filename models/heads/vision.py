"""A tenant-private image encoder for heads that look at the canonical frames themselves.

A frozen random base keeps little of *where* small things are in a frame (docs/results.md), so
heads may add their own trainable view of `VLABatch.images_B_S_C_H_W` (float32 in [0, 1]),
still without a gradient into the shared base.

Two poolings:
- ``flatten``: stride-2 convs down to a 4x4 map, flattened (position survives coarsely);
- ``keypoints``: a spatial softmax per channel (Levine et al. 2016, "End-to-End Training of
  Deep Visuomotor Policies"): each channel becomes the expected (x, y) of its activation, so
  "where is the red disc" is a coordinate the trunk can subtract from the agent's position,
  rather than a code it must learn to decode. Camera slots are encoded separately (grouped
  convs) because a keypoint mixing two views means nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

POOLINGS = ("flatten", "keypoints")


class SpatialSoftmax(nn.Module):
    """(B, C, H, W) -> (B, 2C): expected x and y in [-1, 1] of each channel's softmax map."""

    def __init__(self) -> None:
        super().__init__()
        self.log_temperature = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        attn = F.softmax(x.flatten(2) / self.log_temperature.exp(), dim=-1).view(b, c, h, w)
        ys = torch.linspace(-1.0, 1.0, h, device=x.device, dtype=x.dtype)
        xs = torch.linspace(-1.0, 1.0, w, device=x.device, dtype=x.dtype)
        ex = (attn.sum(2) * xs).sum(-1)
        ey = (attn.sum(3) * ys).sum(-1)
        return torch.stack([ex, ey], dim=-1).flatten(1)


class ImageEncoder(nn.Module):
    """(B, S, 3, H, W) in [0, 1] (+ optional conditioning (B, cond_dim)) -> (B, out_dim).

    With ``cond_dim`` > 0 every conv layer is FiLM-modulated by the conditioning vector
    (Perez et al. 2018; RT-1 conditions its image tokenizer on the instruction the same way):
    the instruction can then pick *which* disc the keypoints follow, instead of the trunk
    having to untangle three colours' positions after pooling."""

    def __init__(self, camera_slots: int, channels: int, out_dim: int, pooling: str = "flatten",
                 cond_dim: int = 0) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"image pooling {pooling!r}: must be one of {POOLINGS}")
        s, c = camera_slots, channels
        if pooling == "flatten":
            self.convs = nn.ModuleList([
                nn.Conv2d(3 * s, c, 5, stride=2, padding=2),
                nn.Conv2d(c, 2 * c, 3, stride=2, padding=1),
                nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1),
            ])
            self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten())
            pooled = 2 * c * 16
        else:
            # One stride-2 conv then full-resolution convs: a 3-px target at 64x64 must survive
            # to the map the softmax reads (32x32 here), so no further downsampling. Grouped:
            # each camera slot keeps its own channels.
            self.convs = nn.ModuleList([
                nn.Conv2d(3 * s, c * s, 5, stride=2, padding=2, groups=s),
                nn.Conv2d(c * s, c * s, 3, padding=1, groups=s),
                nn.Conv2d(c * s, c * s, 3, padding=1, groups=s),
            ])
            self.pool = SpatialSoftmax()
            pooled = 2 * c * s
        # FiLM on all but the last conv (whose map the pooling reads as is).
        self.film = nn.ModuleList(
            [nn.Linear(cond_dim, 2 * conv.out_channels) for conv in self.convs[:-1]] if cond_dim else []
        )
        for f in self.film:  # start as the identity: gamma 1, beta 0
            nn.init.zeros_(f.weight)
            nn.init.zeros_(f.bias)
        self.out = nn.Linear(pooled, out_dim)

    def forward(self, images_B_S_C_H_W: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        x = images_B_S_C_H_W.flatten(1, 2)
        for i, conv in enumerate(self.convs):
            x = conv(x)
            if i == len(self.convs) - 1:
                break
            if self.film and cond is not None:
                gamma, beta = self.film[i](cond)[:, :, None, None].chunk(2, dim=1)
                x = x * (1.0 + gamma) + beta
            x = F.gelu(x)
        return self.out(self.pool(x))


class InstructionEncoder(nn.Module):
    """(prompt_ids_B_T, prompt_len_B) -> (B, embed_dim): a bag of hashed token uni- and bigrams.

    The frozen base mixes the instruction with everything else it sees; for a random or
    small base the head cannot reliably read *which* task was asked from the query states
    (docs/results.md). A private bag of n-grams is the cheapest direct path, and hashing keeps
    its size independent of the tokenizer's vocabulary (151k ids for Qwen3-VL).
    """

    def __init__(self, embed_dim: int = 64, buckets: int = 4096) -> None:
        super().__init__()
        self.buckets = buckets
        self.dim = embed_dim
        self.embed = nn.Embedding(buckets, embed_dim)

    def forward(self, prompt_ids_B_T: torch.Tensor, prompt_len_B: torch.Tensor) -> torch.Tensor:
        ids = prompt_ids_B_T.long()
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device)
        valid = pos[None, :] < prompt_len_B.to(ids.device)[:, None]
        uni = ids % self.buckets
        # A bigram (a, b) hashes to a bucket of its own (1_000_003: a prime, so pairs spread).
        bi = (ids[:, :-1] * 1_000_003 + ids[:, 1:] + 7) % self.buckets
        grams = torch.cat([uni, bi], dim=1)
        mask = torch.cat([valid, valid[:, :-1] & valid[:, 1:]], dim=1)
        # Mean over the real n-grams; padding weighs 0.
        weights = mask.float()
        weights = weights / weights.sum(1, keepdim=True).clamp_min(1.0)
        return (self.embed(grams.masked_fill(~mask, 0)) * weights[..., None]).sum(1)
