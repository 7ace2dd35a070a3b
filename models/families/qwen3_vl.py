"""Qwen3-VL (StarVLA's base): inputs built without its processor (which needs torchvision).

Per camera slot: <|vision_start|> + N x <|image_pad|> + <|vision_end|>, N = (H/p)(W/p)/m^2 with
patch p=16 and spatial merge m=2 (49 for 224x224). `pixel_values` are the image processor's
flat patch layout (merge windows contiguous, each patch repeated over temporal_patch_size),
`image_grid_thw` is (1, H/p, W/p) per image, `mm_token_type_ids` is 1 on image placeholders.

We compute the 3-D M-RoPE position ids ourselves, vectorized, from `mm_token_type_ids` and the
attention mask (the same values as transformers' `get_rope_index`, which loops in Python per
sample), and pass them in: cheaper, and identical in grouped and serial forwards. Dropping
`mm_token_type_ids` would make every token a text token and silently change the hidden states;
tests/models/test_model_inputs.py checks both the equality with transformers and that change.
"""

from __future__ import annotations

import torch

from models.families.common import Family, ModelInputs, require_multiple
from models.features import VLABatch
from models.schema import FeatureLayout

TEXT_TYPE, IMAGE_TYPE = 0, 1


class Qwen3VLFamily(Family):
    name = "qwen3_vl"
    lead_text = "<|im_start|>user\n"
    body_template = "{prompt}<|im_end|>\n<|im_start|>assistant\n"
    prefix_kv = True

    @property
    def _vcfg(self):
        return self.hf_config.vision_config

    def text_hidden_size(self) -> int:
        return int(self.hf_config.text_config.hidden_size)

    def validate_layout(self, layout: FeatureLayout) -> None:
        unit = self._vcfg.patch_size * self._vcfg.spatial_merge_size
        require_multiple("layout.image_size[0]", layout.image_size[0], unit)
        require_multiple("layout.image_size[1]", layout.image_size[1], unit)

    def grid(self, layout: FeatureLayout) -> tuple[int, int]:
        p = self._vcfg.patch_size
        return layout.image_size[0] // p, layout.image_size[1] // p

    def image_tokens_per_slot(self, layout: FeatureLayout) -> int:
        gh, gw = self.grid(layout)
        return gh * gw // self._vcfg.spatial_merge_size**2

    def segments(self, layout: FeatureLayout, lead_ids: list[int]) -> list[tuple[list[int], int]]:
        n = self.image_tokens_per_slot(layout)
        vs, ve = self.ids.extra["vision_start"], self.ids.extra["vision_end"]
        segs: list[tuple[list[int], int]] = [(list(lead_ids), -1)]
        for s in range(layout.camera_slots):
            segs.append(([vs] + [self.ids.image] * n + [ve], s))
        return segs

    def patchify(self, images_N_C_H_W: torch.Tensor) -> torch.Tensor:
        """The Qwen2-VL image processor's flat patch layout: (N * gh * gw, C * tps * p * p)."""
        v = self._vcfg
        n, c, h, w = images_N_C_H_W.shape
        p, m, tps = v.patch_size, v.spatial_merge_size, v.temporal_patch_size
        gh, gw = h // p, w // p
        x = images_N_C_H_W.reshape(n, c, gh // m, m, p, gw // m, m, p)
        x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)  # n, gh/m, gw/m, m, m, c, p, p
        x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, tps, -1, -1)
        return x.reshape(n * gh * gw, c * tps * p * p)

    def position_ids(self, mm_type_B_L: torch.Tensor, mask_B_L: torch.Tensor, layout: FeatureLayout) -> torch.Tensor:
        """M-RoPE ids (3, B, L), as transformers' get_rope_index computes them (masked tokens: 0).

        Text advances every axis by 1; an image group starts at the running position `s`, gives
        its token (i, j) of the merged grid (s, s+i, s+j), then advances by max(rows, cols).
        Masked tokens are skipped, exactly as get_rope_index drops them.
        """
        gh, gw = self.grid(layout)
        m = self._vcfg.spatial_merge_size
        rows, cols = gh // m, gw // m
        b, l = mm_type_B_L.shape
        dev = mm_type_B_L.device
        is_img = mm_type_B_L == IMAGE_TYPE
        prev_img = torch.zeros_like(is_img)
        prev_img[:, 1:] = is_img[:, :-1]
        next_img = torch.zeros_like(is_img)
        next_img[:, :-1] = is_img[:, 1:]
        arange_L = torch.arange(l, device=dev).expand(b, -1)
        run_start = torch.where(is_img & ~prev_img, arange_L, torch.zeros_like(arange_L))
        idx_in_img = arange_L - torch.cummax(run_start, dim=1).values
        last_img = is_img & ~next_img
        advance = torch.where(is_img, torch.where(last_img, max(rows, cols), 0), 1) * mask_B_L
        start = torch.cumsum(advance, dim=1) - advance
        h_off = torch.where(is_img, idx_in_img // cols, 0)
        w_off = torch.where(is_img, idx_in_img % cols, 0)
        pos = torch.stack([start, start + h_off, start + w_off])
        return pos * mask_B_L.unsqueeze(0)

    def text_position_ids(self, positions_B_T: torch.Tensor) -> torch.Tensor:
        """(3, B, T): a text token has the same position on every M-RoPE axis."""
        return positions_B_T[None].expand(3, -1, -1)

    def build_inputs(self, batch: VLABatch, lead_ids: list[int], dtype: torch.dtype) -> ModelInputs:
        layout = batch.key.layout
        sk = self.skeleton(layout, lead_ids)
        ids, mask = sk.fill(batch)
        mm_type = (ids == self.ids.image).to(torch.int32)
        b, s = batch.image_mask_B_S.shape
        images = batch.images_B_S_C_H_W.reshape(b * s, 3, *layout.image_size)
        pixel_values = self.patchify(self.normalize(images, dtype))
        gh, gw = self.grid(layout)
        grid = torch.tensor([1, gh, gw], device=ids.device).expand(b * s, 3).contiguous()
        self.check_placeholders(ids, self.ids.image, b * s * self.image_tokens_per_slot(layout))
        mask_l = mask.long()
        return ModelInputs(
            kwargs=dict(
                input_ids=ids,
                attention_mask=mask_l,
                position_ids=self.position_ids(mm_type, mask_l, layout),
                pixel_values=pixel_values,
                image_grid_thw=grid,
                mm_token_type_ids=mm_type,
            ),
            mask_B_L=mask,
        )

    def forward(self, core: torch.nn.Module, inputs: ModelInputs) -> torch.Tensor:
        return core(**inputs.kwargs, use_cache=False).last_hidden_state
