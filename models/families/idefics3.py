"""Idefics3 / SmolVLM: per slot <fake_token_around_image><global-img> N x <image> <fake_token_around_image>.

One global image per slot, no tiling (the canonical resolution is the vision config's
image_size), N = (size/patch)^2 / scale_factor^2. `pixel_values` is (B, S, 3, H, W) with an
all-true `pixel_attention_mask`. Idefics3 drops images whose pixels are all exactly 0 as padding;
our absent slots are black, i.e. -1 after normalization, so every slot keeps its placeholders.
"""

from __future__ import annotations

import torch

from models.errors import SchemaError
from models.families.common import Family, ModelInputs
from models.features import VLABatch
from models.schema import FeatureLayout


class Idefics3Family(Family):
    name = "idefics3"
    text_decoder = "text_model"
    lead_text = "<|im_start|>User:"
    body_template = "{prompt}<end_of_utterance>\nAssistant:"

    def text_hidden_size(self) -> int:
        return int(self.hf_config.text_config.hidden_size)

    def validate_layout(self, layout: FeatureLayout) -> None:
        size = self.hf_config.vision_config.image_size
        if tuple(layout.image_size) != (size, size):
            raise SchemaError(f"layout.image_size={layout.image_size}: this Idefics3 base takes only ({size}, {size})")

    def image_tokens_per_slot(self, layout: FeatureLayout) -> int:
        v = self.hf_config.vision_config
        return (v.image_size // v.patch_size) ** 2 // self.hf_config.scale_factor**2

    def segments(self, layout: FeatureLayout, lead_ids: list[int]) -> list[tuple[list[int], int]]:
        n = self.image_tokens_per_slot(layout)
        fake, glob = self.ids.extra["fake_image"], self.ids.extra["global_image"]
        segs: list[tuple[list[int], int]] = [(list(lead_ids), -1)]
        for s in range(layout.camera_slots):
            segs.append(([fake, glob] + [self.ids.image] * n + [fake], s))
        return segs

    def build_inputs(self, batch: VLABatch, lead_ids: list[int], dtype: torch.dtype) -> ModelInputs:
        layout = batch.key.layout
        sk = self.skeleton(layout, lead_ids)
        ids, mask = sk.fill(batch)
        b, s = batch.image_mask_B_S.shape
        self.check_placeholders(ids, self.ids.image, b * s * self.image_tokens_per_slot(layout))
        pixels = self.normalize(batch.images_B_S_C_H_W, dtype)
        mask_l = mask.long()
        return ModelInputs(
            kwargs=dict(
                input_ids=ids,
                attention_mask=mask_l,
                position_ids=(torch.cumsum(mask_l, dim=1) - 1).clamp(min=0),
                pixel_values=pixels,
                pixel_attention_mask=torch.ones(b, s, *layout.image_size, dtype=torch.bool, device=ids.device),
            ),
            mask_B_L=mask,
        )

    def forward(self, core: torch.nn.Module, inputs: ModelInputs) -> torch.Tensor:
        return core(**inputs.kwargs, use_cache=False).last_hidden_state
