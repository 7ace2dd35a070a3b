"""Per-family input builders and forwards for the frozen base.

Each family turns a canonical `VLABatch` into exactly the tensors its transformers model
expects (placeholder tokens, grids, token-type ids, position ids, pixel layout) and runs the
forward to the last hidden states. Nothing here uses a transformers processor: Qwen3-VL's needs
torchvision, and building inputs ourselves keeps the layout fixed-length and batch-invariant.
"""

from __future__ import annotations

from models.errors import UnknownNameError
from models.families.common import AttentionShape, Family, ModelInputs, TokenIds, text_attention_shape
from models.families.idefics3 import Idefics3Family
from models.families.paligemma import PaliGemmaFamily
from models.families.qwen3_vl import Qwen3VLFamily

FAMILIES: dict[str, type[Family]] = {
    Qwen3VLFamily.name: Qwen3VLFamily,
    PaliGemmaFamily.name: PaliGemmaFamily,
    Idefics3Family.name: Idefics3Family,
}
# transformers model_type -> family name, for loading a save_pretrained directory.
MODEL_TYPE_TO_FAMILY = {"qwen3_vl": "qwen3_vl", "paligemma": "paligemma", "idefics3": "idefics3", "smolvlm": "idefics3"}


def get_family(name: str) -> type[Family]:
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownNameError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}") from None


__all__ = ["FAMILIES", "MODEL_TYPE_TO_FAMILY", "AttentionShape", "Family", "ModelInputs", "TokenIds", "get_family",
           "text_attention_shape"]
