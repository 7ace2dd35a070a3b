"""What the base hands its heads: `BaseOutput` (features of a batch) and its `PrefixKV` cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PrefixKV:
    """The base's per-layer attention keys and values over a batch's whole sequence (the prefix
    an action expert reads, models/heads/expert.py), in the base dtype, keys already rotated.

    keys / values: one (B, kv_heads, L, head_dim) tensor per text decoder layer.
    next_pos_B: the first position after each row's prefix (the expert's tokens continue there).
    rope(positions_B_T) -> (cos, sin), each (B, T, head_dim) float32: the base's own rotary
    table, so the expert's queries and keys rotate as the base's would at those positions."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    next_pos_B: torch.Tensor
    rope: Any

    def split(self, sizes: list[int]) -> list["PrefixKV"]:
        ks = [torch.split(k, sizes) for k in self.keys]
        vs = [torch.split(v, sizes) for v in self.values]
        ps = torch.split(self.next_pos_B, sizes)
        return [PrefixKV(tuple(k[i] for k in ks), tuple(v[i] for v in vs), ps[i], self.rope)
                for i in range(len(sizes))]

    def detach(self) -> "PrefixKV":
        return PrefixKV(tuple(k.detach() for k in self.keys), tuple(v.detach() for v in self.values),
                        self.next_pos_B, self.rope)


@dataclass
class BaseOutput:
    """Base features of a batch. hidden is in the base dtype; heads cast to their own.
    prefix: the per-layer KV cache, when the forward was asked for it (`encode(prefix_kv=True)`)."""

    hidden_B_L_D: torch.Tensor
    mask_B_L: torch.Tensor
    num_queries: int
    prefix: PrefixKV | None = None
    # With `encode(heads=plan)` on the fast engine: every head bucket's actions for all rows
    # (models.heads.pool), computed inside the base's graph; None: run the heads after.
    head_actions: tuple | None = None

    def __len__(self) -> int:
        return self.hidden_B_L_D.shape[0]

    @property
    def query_B_Q_D(self) -> torch.Tensor:
        return self.hidden_B_L_D[:, -self.num_queries:]

    def split(self, sizes: list[int]) -> list["BaseOutput"]:
        hs = torch.split(self.hidden_B_L_D, sizes)
        ms = torch.split(self.mask_B_L, sizes)
        ps = self.prefix.split(sizes) if self.prefix is not None else [None] * len(sizes)
        return [BaseOutput(h, m, self.num_queries, p) for h, m, p in zip(hs, ms, ps)]

    def detach(self) -> "BaseOutput":
        """Features whose backward stops here (a frozen-base tenant's, in a group with LoRA rows)."""
        return BaseOutput(self.hidden_B_L_D.detach(), self.mask_B_L, self.num_queries,
                          self.prefix.detach() if self.prefix is not None else None)
