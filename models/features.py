"""VLAFeature: the canonical, model-facing input of one sample, and `VLABatch`, a stack of them.

Every tensor shape is fixed by the `FeatureLayout` in the batch's `CompatibilityKey`, so batches
with equal keys concatenate along dim 0 without padding or re-layout (`VLABatch.cat`), and the
base forward of a concatenated batch splits back exactly (`models.group`).

Shape suffixes: B batch, S camera slots, C channels, H/W pixels, T prompt tokens, D state dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.errors import IncompatibleBatchError, InputError
from models.schema import CompatibilityKey


@dataclass
class VLABatch:
    """Canonical features of B samples that share one compatibility key.

    images_B_S_C_H_W: float32 in [0, 1], resized to the layout's image_size; absent slots are 0.
    image_mask_B_S: True where the slot holds a real camera frame.
    prompt_ids_B_T: prompt token ids (tenant template inside the base template), right-padded with 0.
    prompt_len_B: number of real ids in each prompt row.
    state_B_D / state_mask_B_D: proprio state zero-padded to max_state_dim, True where real.
    """

    key: CompatibilityKey
    images_B_S_C_H_W: torch.Tensor
    image_mask_B_S: torch.Tensor
    prompt_ids_B_T: torch.Tensor
    prompt_len_B: torch.Tensor
    state_B_D: torch.Tensor
    state_mask_B_D: torch.Tensor

    def __post_init__(self) -> None:
        lay = self.key.layout
        b = self.images_B_S_C_H_W.shape[0]
        expect = {
            "images_B_S_C_H_W": (b, lay.camera_slots, 3, *lay.image_size),
            "image_mask_B_S": (b, lay.camera_slots),
            "prompt_ids_B_T": (b, lay.max_prompt_tokens),
            "prompt_len_B": (b,),
            "state_B_D": (b, lay.max_state_dim),
            "state_mask_B_D": (b, lay.max_state_dim),
        }
        for name, shape in expect.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise InputError(f"VLABatch.{name}: shape {got}, layout {self.key} needs {shape}")

    def __len__(self) -> int:
        return self.images_B_S_C_H_W.shape[0]

    @property
    def device(self) -> torch.device:
        return self.images_B_S_C_H_W.device

    def to(self, device: torch.device | str) -> "VLABatch":
        return VLABatch(
            key=self.key,
            images_B_S_C_H_W=self.images_B_S_C_H_W.to(device, non_blocking=True),
            image_mask_B_S=self.image_mask_B_S.to(device, non_blocking=True),
            prompt_ids_B_T=self.prompt_ids_B_T.to(device, non_blocking=True),
            prompt_len_B=self.prompt_len_B.to(device, non_blocking=True),
            state_B_D=self.state_B_D.to(device, non_blocking=True),
            state_mask_B_D=self.state_mask_B_D.to(device, non_blocking=True),
        )

    @staticmethod
    def cat(batches: list["VLABatch"]) -> "VLABatch":
        """Stack batches that share a key. Unequal keys are an error, never a silent merge."""
        if not batches:
            raise InputError("VLABatch.cat: no batches")
        key = batches[0].key
        for b in batches[1:]:
            if b.key != key:
                raise IncompatibleBatchError(f"VLABatch.cat: keys differ ({key} vs {b.key}); run separate forwards")
        if len(batches) == 1:
            return batches[0]
        return VLABatch(
            key=key,
            images_B_S_C_H_W=torch.cat([b.images_B_S_C_H_W for b in batches]),
            image_mask_B_S=torch.cat([b.image_mask_B_S for b in batches]),
            prompt_ids_B_T=torch.cat([b.prompt_ids_B_T for b in batches]),
            prompt_len_B=torch.cat([b.prompt_len_B for b in batches]),
            state_B_D=torch.cat([b.state_B_D for b in batches]),
            state_mask_B_D=torch.cat([b.state_mask_B_D for b in batches]),
        )

    def index(self, idx: slice) -> "VLABatch":
        return VLABatch(
            key=self.key,
            images_B_S_C_H_W=self.images_B_S_C_H_W[idx],
            image_mask_B_S=self.image_mask_B_S[idx],
            prompt_ids_B_T=self.prompt_ids_B_T[idx],
            prompt_len_B=self.prompt_len_B[idx],
            state_B_D=self.state_B_D[idx],
            state_mask_B_D=self.state_mask_B_D[idx],
        )


# One sample is a batch of one: the same type, the same checks, no second code path.
VLAFeature = VLABatch
