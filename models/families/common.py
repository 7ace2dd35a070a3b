"""What every family shares: token ids, the fixed-length sequence skeleton, input bundle.

A sample's token sequence has one fixed layout per `FeatureLayout`:

    [lead ids] [slot 0 block] ... [slot S-1 block] [prompt: max_prompt_tokens] [queries: Q]

(PaliGemma puts the slot blocks before the lead, as its processor does.) A slot block is the
family's image wrapper around its image placeholders. Absent slots and prompt padding are
masked out of attention; the query tokens always sit at the last Q positions, so reading them
back needs no index arithmetic per sample. The lead is never masked, so no causal row is left
with nothing to attend to (a fully masked softmax row gives NaN that poisons the batch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from models.errors import InputError, SchemaError
from models.features import VLABatch
from models.schema import FeatureLayout


@dataclass(frozen=True)
class TokenIds:
    """Special token ids the input builder needs. `extra` holds family-specific ones."""

    pad: int
    bos: int
    query: int
    image: int
    extra: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> "TokenIds":
        core = {"pad", "bos", "query", "image"}
        return cls(**{k: int(d[k]) for k in core}, extra={k: int(v) for k, v in d.items() if k not in core})

    def to_dict(self) -> dict[str, int]:
        return {"pad": self.pad, "bos": self.bos, "query": self.query, "image": self.image, **self.extra}


@dataclass(frozen=True)
class AttentionShape:
    """The text decoder's attention: an action expert reading its per-layer KV cache must use
    ``head_dim`` and a multiple of ``kv_heads`` query heads, and map onto its ``layers``."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass
class ModelInputs:
    """Tensors for one base forward. `kwargs` go to the HF model; `mask_B_L` marks real tokens."""

    kwargs: dict[str, Any]
    mask_B_L: torch.Tensor


@dataclass
class Skeleton:
    """Token ids and region indices of the fixed-length sequence for one layout.

    ids_L: ids with the prompt region left as pad.
    slot_L: slot index of every token belonging to a slot block, -1 elsewhere.
    """

    ids_L: torch.Tensor
    slot_L: torch.Tensor
    prompt_start: int
    prompt_len: int
    num_queries: int

    @property
    def length(self) -> int:
        return int(self.ids_L.shape[0])

    @staticmethod
    def build(segments: list[tuple[list[int], int]], prompt_len: int, num_queries: int, query_id: int,
              pad_id: int) -> "Skeleton":
        """segments: (ids, slot index or -1) pieces in order, before the prompt."""
        ids: list[int] = []
        slots: list[int] = []
        for seg_ids, slot in segments:
            ids += seg_ids
            slots += [slot] * len(seg_ids)
        prompt_start = len(ids)
        ids += [pad_id] * prompt_len + [query_id] * num_queries
        slots += [-1] * (prompt_len + num_queries)
        return Skeleton(torch.tensor(ids, dtype=torch.long), torch.tensor(slots, dtype=torch.long),
                        prompt_start, prompt_len, num_queries)

    def fill(self, batch: VLABatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids_B_L, mask_B_L) for a batch: prompt ids written in, absent slots and pads masked."""
        dev = batch.device
        b = len(batch)
        ids = self.ids_L.to(dev).expand(b, -1).clone()
        p0, t = self.prompt_start, self.prompt_len
        ids[:, p0:p0 + t] = batch.prompt_ids_B_T
        slot_L = self.slot_L.to(dev)
        in_slot = slot_L >= 0
        slot_present = batch.image_mask_B_S.gather(1, slot_L.clamp(min=0).expand(b, -1))
        mask = torch.where(in_slot, slot_present, torch.ones_like(slot_present))
        arange_T = torch.arange(t, device=dev)
        mask[:, p0:p0 + t] = arange_T[None, :] < batch.prompt_len_B[:, None]
        return ids, mask


class Family(ABC):
    """One transformers model family: how to lay out, build and run its inputs."""

    name: str = ""
    # Images are normalized as (x - mean) / std; these three families all ship 0.5 / 0.5.
    image_mean = (0.5, 0.5, 0.5)
    image_std = (0.5, 0.5, 0.5)
    # Base prompt template for real tokenizers: lead text, then images, then body around the prompt.
    lead_text = ""
    body_template = "{prompt}"
    # Attribute of the core holding the language model's decoder layers: LoRA adapts only linears
    # under `<text_decoder>.layers.` (models/lora.py), where every row is one whole sample.
    text_decoder = "language_model"

    def __init__(self, hf_config: Any, token_ids: TokenIds, layout: FeatureLayout) -> None:
        self.hf_config = hf_config
        self.ids = token_ids
        self.layout = layout
        self.validate_layout(layout)
        self._skeletons: dict[FeatureLayout, Skeleton] = {}
        self._norm: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- per-family -------------------------------------------------------------------
    @abstractmethod
    def validate_layout(self, layout: FeatureLayout) -> None: ...

    @abstractmethod
    def image_tokens_per_slot(self, layout: FeatureLayout) -> int: ...

    @abstractmethod
    def segments(self, layout: FeatureLayout, lead_ids: list[int]) -> list[tuple[list[int], int]]: ...

    @abstractmethod
    def build_inputs(self, batch: VLABatch, lead_ids: list[int], dtype: torch.dtype) -> ModelInputs: ...

    @abstractmethod
    def forward(self, core: torch.nn.Module, inputs: ModelInputs) -> torch.Tensor:
        """Last hidden states (B, L, D) of the language model."""

    @abstractmethod
    def text_hidden_size(self) -> int: ...

    # ---- per-layer prefix KV (the action expert's input) ----------------------------------
    # Families whose inputs carry explicit position ids, so the positions after the prefix
    # are known per row: the expert's tokens continue there.
    prefix_kv = False

    def attention_shape(self) -> AttentionShape:
        return text_attention_shape(self.hf_config)

    def forward_kv(self, core: torch.nn.Module, inputs: ModelInputs
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """(last hidden states, per-layer keys, per-layer values) of one forward: the model's
        own cache, so keys are exactly what its attention read (normed, rotated, kv_heads)."""
        if not self.prefix_kv:
            raise SchemaError(f"base family {self.name!r}: no per-layer prefix KV for an action expert")
        out = core(**inputs.kwargs, use_cache=True)
        # transformers 5.2x renamed the output field (past_key_values -> cache); both work.
        cache = out["cache"] if "cache" in out else out["past_key_values"]
        layers = cache.layers
        return out.last_hidden_state, tuple(c.keys for c in layers), tuple(c.values for c in layers)

    def next_positions(self, inputs: ModelInputs) -> torch.Tensor:
        """First position id after each row's prefix: its largest position (any M-RoPE axis) + 1,
        as transformers continues a sequence after its prompt (masked tokens hold 0)."""
        pos = inputs.kwargs["position_ids"]
        b, l = inputs.mask_B_L.shape
        return pos.reshape(-1, b, l).amax(dim=(0, 2)) + 1

    def rope_fn(self, core: torch.nn.Module) -> Any:
        """positions_B_T -> (cos, sin), float32 (B, T, head_dim), from the decoder's own rotary
        module (Qwen3-VL: text positions on every M-RoPE axis, interleaved as its layers use)."""
        rotary = getattr(core, self.text_decoder).rotary_emb

        def rope(positions_B_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            probe = torch.empty(0, device=positions_B_T.device, dtype=torch.float32)
            cos, sin = rotary(probe, self.text_position_ids(positions_B_T))
            return cos.float(), sin.float()

        return rope

    def text_position_ids(self, positions_B_T: torch.Tensor) -> torch.Tensor:
        """Position ids of text tokens at these positions, in the shape the decoder takes."""
        return positions_B_T

    # ---- shared -----------------------------------------------------------------------
    def skeleton(self, layout: FeatureLayout, lead_ids: list[int]) -> Skeleton:
        sk = self._skeletons.get(layout)
        if sk is None:
            self.validate_layout(layout)
            if not lead_ids:
                raise SchemaError("lead_ids: the base template must start with at least one token")
            sk = Skeleton.build(self.segments(layout, lead_ids), layout.max_prompt_tokens,
                                layout.num_query_tokens, self.ids.query, self.ids.pad)
            self._skeletons[layout] = sk
        return sk

    def normalize(self, images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (images.device, dtype)
        if key not in self._norm:
            mean = torch.tensor(self.image_mean, device=images.device).view(3, 1, 1)
            std = torch.tensor(self.image_std, device=images.device).view(3, 1, 1)
            self._norm[key] = (mean, std)
        mean, std = self._norm[key]
        return ((images - mean) / std).to(dtype)

    @staticmethod
    def check_placeholders(ids_B_L: torch.Tensor, image_id: int, expected: int) -> None:
        got = int((ids_B_L == image_id).sum())
        if got != expected:
            raise InputError(f"image placeholders: {got} tokens with id {image_id}, the images need {expected}")


def require_multiple(name: str, value: int, of: int) -> None:
    if value % of:
        raise SchemaError(f"{name}={value}: must be a multiple of {of} for this base")


def text_attention_shape(hf_config: Any) -> AttentionShape:
    """From a config alone (the master checks an expert against it at submit, no weights)."""
    t = hf_config.get_text_config()
    heads = int(t.num_attention_heads)
    head_dim = int(getattr(t, "head_dim", None) or t.hidden_size // heads)
    return AttentionShape(int(t.num_hidden_layers), heads, int(getattr(t, "num_key_value_heads", None) or heads),
                          head_dim)
