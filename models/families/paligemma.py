"""PaliGemma (OpenPI's base): SigLIP image tokens first, then <bos>, prompt, queries.

Images and prompt form a bidirectional prefix (token_type_ids 0), the action-query tokens a
causal suffix (token_type_ids 1), as PaliGemma's processor marks prefix and suffix. The image
resolution is fixed by the vision config (its learned position table). Position ids count real
tokens only (1-indexed, as PaliGemma does) so padding never shifts them.

OpenPI: pi0's action expert attends to the prefix at every layer; sharing this family means
sharing a per-layer prefix KV cache (`Family.forward_kv`, read by models/heads/expert.py).
"""

from __future__ import annotations

import torch

from models.errors import SchemaError
from models.families.common import Family, ModelInputs
from models.features import VLABatch
from models.schema import FeatureLayout


class PaliGemmaFamily(Family):
    name = "paligemma"
    lead_text = ""  # <bos> is the lead; real tokenizers add nothing else before the prompt
    body_template = "{prompt}\n"
    prefix_kv = True

    def text_hidden_size(self) -> int:
        return int(self.hf_config.text_config.hidden_size)

    def validate_layout(self, layout: FeatureLayout) -> None:
        size = self.hf_config.vision_config.image_size
        if tuple(layout.image_size) != (size, size):
            raise SchemaError(f"layout.image_size={layout.image_size}: this PaliGemma base takes only ({size}, {size})")

    def image_tokens_per_slot(self, layout: FeatureLayout) -> int:
        v = self.hf_config.vision_config
        return (v.image_size // v.patch_size) ** 2

    def segments(self, layout: FeatureLayout, lead_ids: list[int]) -> list[tuple[list[int], int]]:
        n = self.image_tokens_per_slot(layout)
        segs = [([self.ids.image] * n, s) for s in range(layout.camera_slots)]
        segs.append((list(lead_ids), -1))
        return segs

    def build_inputs(self, batch: VLABatch, lead_ids: list[int], dtype: torch.dtype) -> ModelInputs:
        layout = batch.key.layout
        sk = self.skeleton(layout, lead_ids)
        ids, mask = sk.fill(batch)
        b, s = batch.image_mask_B_S.shape
        self.check_placeholders(ids, self.ids.image, b * s * self.image_tokens_per_slot(layout))
        token_type = torch.zeros_like(ids)
        token_type[:, sk.length - sk.num_queries:] = 1
        mask_l = mask.long()
        return ModelInputs(
            kwargs=dict(
                input_ids=ids,
                attention_mask=mask_l,
                position_ids=torch.cumsum(mask_l, dim=1) * mask_l,
                token_type_ids=token_type,
                pixel_values=self.normalize(batch.images_B_S_C_H_W.reshape(b * s, 3, *layout.image_size), dtype),
            ),
            mask_B_L=mask,
        )

    def forward(self, core: torch.nn.Module, inputs: ModelInputs) -> torch.Tensor:
        return core(**inputs.kwargs, use_cache=False).last_hidden_state
