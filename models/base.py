"""The frozen, resident base model: load once, encode canonical batches to hidden states.

    base = BaseModel.load(BaseConfig("tiny-qwen3-vl"))            # preset: config only, random init
    base = BaseModel.load(BaseConfig("/ckpt/Qwen3-VL-4B-Instruct"))  # save_pretrained directory
    out = base.encode(batch)   # BaseOutput: hidden_B_L_D, mask_B_L, query_B_Q_D

Frozen means: eval mode, every parameter requires_grad=False, forward under no_grad (or
inference_mode for serving). bf16 on CUDA, fp32 on CPU unless `BaseConfig.dtype` says otherwise.
Nothing is downloaded: directories load with local_files_only=True, and HF_HUB_OFFLINE is left
to transformers, which honours it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.errors import IncompatibleBatchError, SchemaError
from models.families import MODEL_TYPE_TO_FAMILY, AttentionShape, Family, TokenIds, get_family
from models.features import VLABatch
from models.outputs import BaseOutput, PrefixKV
from models.presets import PRESETS, get_preset
from models.schema import CompatibilityKey, FeatureLayout
from models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

# Config attribute where presets record family and token ids, so a save_pretrained copy of a
# preset loads back with the same input layout.
HF_CONFIG_ATTR = "vla_nexus"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class BaseConfig:
    """Which base to load and how.

    source: preset name (see models.presets.PRESETS) or a save_pretrained directory.
    device / dtype: None = cuda + bfloat16 when CUDA is available, else cpu + float32.
    image_size: canonical resolution override (Qwen3-VL: any multiple of 32; SigLIP-based
      presets rebuild their config at this size; ignored for directories with a fixed size).
    camera_slots / max_prompt_tokens / num_query_tokens / max_state_dim: default FeatureLayout.
    seed: random init of presets.
    fast: use the optimized encode path where a family has one (models.fast).
    compile: with fast, torch.compile each vision block and decoder layer (fuses the elementwise
      work between matmuls; first call per batch size compiles, tens of seconds).
    lora_pool: with fast, how many LoRA adapters the fast engine keeps stacked on the device at
      once (models.lora.AdapterPool); an inference group with more distinct adapters than
      that takes the plain forward.
    """

    source: str
    device: str | None = None
    dtype: str | None = None
    image_size: int | None = None
    camera_slots: int = 2
    max_prompt_tokens: int = 48
    num_query_tokens: int = 8
    max_state_dim: int = 32
    seed: int = 0
    attn_implementation: str = "sdpa"
    fast: bool = False
    compile: bool = False
    lora_pool: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.lora_pool, bool) or not isinstance(self.lora_pool, int) or self.lora_pool < 1:
            raise SchemaError(f"lora_pool={self.lora_pool!r}: must be an integer >= 1")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise SchemaError(f"dtype={self.dtype!r}: allowed {sorted(_DTYPES)} or None")
        if self.source not in PRESETS and not Path(self.source).is_dir():
            raise SchemaError(
                f"source={self.source!r}: neither a preset ({sorted(PRESETS)}) nor an existing directory"
            )


def _default_device_dtype(cfg: BaseConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        # "cuda" and "cuda:0" must compare equal when slots check they sit beside the base.
        device = torch.device("cuda", torch.cuda.current_device())
    if cfg.dtype is not None:
        return device, _DTYPES[cfg.dtype]
    return device, (torch.bfloat16 if device.type == "cuda" else torch.float32)


def _model_classes(family: str) -> tuple[type, type]:
    """(core class for presets, ForConditionalGeneration class for directories)."""
    import transformers as tf

    if family == "qwen3_vl":
        return tf.Qwen3VLModel, tf.Qwen3VLForConditionalGeneration
    if family == "paligemma":
        return tf.PaliGemmaModel, tf.PaliGemmaForConditionalGeneration
    return tf.Idefics3Model, tf.AutoModelForImageTextToText


class BaseModel:
    """A frozen VLM core plus its input builder. Shared by every tenant slot on the process."""

    def __init__(self, core: torch.nn.Module, family: Family, tokenizer: Tokenizer, lead_ids: list[int],
                 base_id: str, device: torch.device, dtype: torch.dtype, fast: bool = False,
                 compile: bool = False, lora_pool: int = 32) -> None:
        self.core = core
        self.family = family
        self.tokenizer = tokenizer
        self.lead_ids = lead_ids
        self.base_id = base_id
        self.device = device
        self.dtype = dtype
        self.layout = family.layout
        self.body_template = "{prompt}" if isinstance(tokenizer, ByteTokenizer) else family.body_template
        self._fast = None
        # models.lora.LoraRouter: hooks on the decoder's linears, installed by the first slot
        # with an adapter (`models.lora.router_for`); None = no LoRA tenant, no hooks at all.
        self.lora_router = None
        self.lora_pool_size = lora_pool  # adapters the fast engine stacks (BaseConfig.lora_pool)
        if fast:
            from models.fast import make_fast_encoder

            self._fast = make_fast_encoder(self, compile=compile)
        self._freeze()

    # ---- loading ----------------------------------------------------------------------
    @classmethod
    def load(cls, cfg: BaseConfig) -> "BaseModel":
        device, dtype = _default_device_dtype(cfg)
        if cfg.source in PRESETS:
            return cls._from_preset(cfg, device, dtype)
        return cls._from_directory(cfg, device, dtype)

    @classmethod
    def _from_preset(cls, cfg: BaseConfig, device: torch.device, dtype: torch.dtype) -> "BaseModel":
        preset = get_preset(cfg.source)
        hf_config = preset.build_config(cfg.image_size)
        hf_config._attn_implementation = cfg.attn_implementation
        setattr(hf_config, HF_CONFIG_ATTR, {"family": preset.family, "token_ids": preset.token_ids})
        core_cls, _ = _model_classes(preset.family)
        prev = torch.get_default_dtype()
        # Build straight on the device in the target dtype: a 4B model never exists in fp32 on CPU.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(cfg.seed)
            torch.set_default_dtype(dtype)
            try:
                with torch.device(device):
                    core = core_cls(hf_config)
            finally:
                torch.set_default_dtype(prev)
        core = core.to(device=device, dtype=dtype)
        family_cls = get_family(preset.family)
        image_size = cfg.image_size or preset.default_image_size
        layout = _layout(cfg, image_size)
        family = family_cls(hf_config, TokenIds.from_dict(preset.token_ids), layout)
        tok = ByteTokenizer(offset=4, vocab_size=int(hf_config.get_text_config().vocab_size))
        base_id = f"preset:{preset.name}:seed{cfg.seed}:{_config_digest(hf_config)}"
        return cls(core, family, tok, [family.ids.bos], base_id, device, dtype, fast=cfg.fast, compile=cfg.compile,
                   lora_pool=cfg.lora_pool)

    @classmethod
    def _from_directory(cls, cfg: BaseConfig, device: torch.device, dtype: torch.dtype) -> "BaseModel":
        from transformers import AutoConfig

        path = Path(cfg.source)
        if not (path / "config.json").is_file():
            raise SchemaError(f"source={cfg.source!r}: no config.json (expected a save_pretrained directory)")
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        family_name = MODEL_TYPE_TO_FAMILY.get(hf_config.model_type)
        if family_name is None:
            raise SchemaError(
                f"source={cfg.source!r}: model_type {hf_config.model_type!r} not supported; "
                f"supported: {sorted(MODEL_TYPE_TO_FAMILY)}"
            )
        _, full_cls = _model_classes(family_name)
        full = full_cls.from_pretrained(path, dtype=dtype, local_files_only=True,
                                        attn_implementation=cfg.attn_implementation)
        core = full.model if hasattr(full, "model") else full
        core = core.to(device)
        tokenizer, lead_ids, ids = _directory_tokens(path, hf_config, family_name)
        family_cls = get_family(family_name)
        image_size = _directory_image_size(hf_config, family_name, cfg.image_size)
        family = family_cls(hf_config, ids, _layout(cfg, image_size))
        if isinstance(tokenizer, ByteTokenizer):
            lead_ids = [ids.bos]
        else:
            lead_ids = (tokenizer.encode(family.lead_text) if family.lead_text else []) or [ids.bos]
        base_id = f"dir:{path.resolve()}:{_config_digest(hf_config)}"
        return cls(core, family, tokenizer, lead_ids, base_id, device, dtype, fast=cfg.fast, compile=cfg.compile,
                   lora_pool=cfg.lora_pool)

    def _freeze(self) -> None:
        self.core.eval()
        for p in self.core.parameters():
            p.requires_grad_(False)

    # ---- identity ---------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.family.text_hidden_size()

    def key_for(self, layout: FeatureLayout | None = None) -> CompatibilityKey:
        layout = layout or self.layout
        self.family.validate_layout(layout)
        return CompatibilityKey(self.base_id, str(self.dtype).removeprefix("torch."), layout)

    @property
    def key(self) -> CompatibilityKey:
        return self.key_for(self.layout)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.core.parameters())

    def encode_prompt(self, text: str) -> list[int]:
        """Tenant-templated instruction through the base's prompt template -> ids (not truncated)."""
        return self.tokenizer.encode(self.body_template.format(prompt=text))

    # ---- forward ----------------------------------------------------------------------
    def build_inputs(self, batch: VLABatch):
        """The exact HF model inputs for a batch (exposed for tests and debugging)."""
        self._check_key(batch)
        return self.family.build_inputs(batch.to(self.device), self.lead_ids, self.dtype)

    def encode(self, batch: VLABatch, *, inference: bool = False, adapters: list | None = None,
               prefix_kv: bool = False, heads: Any = None) -> BaseOutput:
        """Hidden states of the frozen base. `inference=True` uses inference_mode (serving only:
        its tensors cannot be saved for a head's backward).

        prefix_kv: also return every decoder layer's keys and values (`BaseOutput.prefix`), from
        the same forward, for action-expert tenants (models/heads/expert.py).

        heads: a `head_plan` of the rows' plain `mlp` heads: where the fast engine serves the
        group (not with prefix_kv), their actions come from the same forward (`head_actions`).

        adapters: `models.lora.Segment`s (row ranges of this batch and their tenant's adapter).
        Unless the caller disabled grad (or asked for inference), the forward then records
        autograd through the language model, so a backward reaches the adapters (never the
        base: its weights do not require grad)."""
        self._check_key(batch)
        # Adapted rows on the fast engine: when nothing needs gradients or dropout (serving), the
        # row assignment goes in as a tensor and every adapter's weights as a pool slot
        # (models.lora.AdapterPool), so its graphs and compiled blocks serve any mix of tenants.
        # A training forward runs the engine's layers uncaptured on stacks of the tenants' own
        # A and B (`FastQwen3VLEncoder.train_forward`); adapters training with dropout keep the
        # plain one (the segmented hooks draw it), as does a group the pool cannot hold.
        # A group with expert rows (`prefix_kv`) gets the per-layer cache from the fast engine's
        # own forward (its graph / compiled blocks, models/fast.py) whenever that forward serves
        # the group (serving, training a frozen base under no_grad, or adapters training).
        rows = None
        if adapters and self._fast is not None and all(s.gen is None for s in adapters):
            if inference or not torch.is_grad_enabled():
                rows = self._fast.lora_rows(adapters, len(batch))
            else:
                # Adapters training without dropout: the fast engine's layers, uncaptured, on
                # stacks of the tenants' own A and B (autograd reaches them; issue 27 item 1).
                out = self._fast.train_forward(batch.to(self.device), adapters, kv=prefix_kv)
                if out is not None:
                    return self._output(batch, out, prefix_kv)
        if adapters and rows is None:
            from models.lora import router_for

            route = router_for(self).route(adapters)
            ctx = torch.inference_mode() if inference else contextlib.nullcontext()
        else:
            route = contextlib.nullcontext()
            ctx = torch.inference_mode() if inference else torch.no_grad()
        with ctx, route:
            if self._fast is not None and (not adapters or rows is not None):
                if heads is not None and not prefix_kv:
                    hidden, mask, acts = self._fast(batch.to(self.device), rows, heads=heads)
                    return BaseOutput(hidden, mask, batch.key.layout.num_query_tokens, head_actions=acts)
                return self._output(batch, self._fast(batch.to(self.device), rows, kv=prefix_kv), prefix_kv)
            prefix = None
            inputs = self.family.build_inputs(batch.to(self.device), self.lead_ids, self.dtype)
            if prefix_kv:
                hidden, keys, values = self.family.forward_kv(self.core, inputs)
                prefix = PrefixKV(keys, values, self.family.next_positions(inputs), self.family.rope_fn(self.core))
            else:
                hidden = self.family.forward(self.core, inputs)
            mask = inputs.mask_B_L
        return BaseOutput(hidden, mask, batch.key.layout.num_query_tokens, prefix)

    def head_plan(self, runs: list, rows: int) -> Any:
        """For a serving group whose rows [start, end) each run's head serves (``runs``: (start,
        end, head)): the fast engine's `models.heads.pool.HeadPlan` (heads made resident), or
        None where the heads run after the forward (no fast engine, a head that is not a plain
        `mlp`, a full pool)."""
        if self._fast is None:
            return None
        if self._fast.head_pool is None:
            from models.heads.pool import HeadPool

            self._fast.head_pool = HeadPool(self.device)
        return self._fast.head_pool.plan(runs, rows)

    def lora_generation(self, adapters: list) -> int | None:
        """The fast engine's adapter-pool generation that serves groups with these
        `models.lora.LoraAdapter`s, every one made resident (its graphs and compiled blocks are
        keyed by it: a warm-up that runs one such group has captured what all of them replay);
        None when such a group takes the plain forward (no fast engine, or more adapters than
        the pool holds)."""
        from models.lora import Segment

        if self._fast is None or not adapters:
            return None
        with torch.inference_mode(False), torch.no_grad():
            rows = self._fast.lora_rows([Segment(0, 1, ad) for ad in adapters], 1)
        return None if rows is None else self._fast._lora_generation

    def _output(self, batch: VLABatch, out: tuple, prefix_kv: bool) -> BaseOutput:
        """The fast engine's (hidden, mask[, keys, values, next_pos]) as a `BaseOutput`."""
        prefix = None
        if prefix_kv:
            hidden, mask, keys, values, next_pos = out
            prefix = PrefixKV(keys, values, next_pos, self.family.rope_fn(self.core))
        else:
            hidden, mask = out
        return BaseOutput(hidden, mask, batch.key.layout.num_query_tokens, prefix)

    def attention_shape(self) -> "AttentionShape":
        """The text decoder's attention shape: what an action expert must match to read its cache."""
        return self.family.attention_shape()

    def _check_key(self, batch: VLABatch) -> None:
        if batch.key.base_id != self.base_id or batch.key != self.key_for(batch.key.layout):
            raise IncompatibleBatchError(f"batch key {batch.key} was not made for base {self.key}")

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write the core in save_pretrained layout (a preset copy loads back identically)."""
        self.core.save_pretrained(path)


def _layout(cfg: BaseConfig, image_size: int) -> FeatureLayout:
    return FeatureLayout(
        image_size=(image_size, image_size), camera_slots=cfg.camera_slots,
        max_prompt_tokens=cfg.max_prompt_tokens, num_query_tokens=cfg.num_query_tokens,
        max_state_dim=cfg.max_state_dim,
    )


def _config_digest(hf_config: Any) -> str:
    d = hf_config.to_dict()
    d.pop("_name_or_path", None)
    d.pop("transformers_version", None)
    d.pop("dtype", None)
    d.pop("torch_dtype", None)
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _directory_image_size(hf_config: Any, family: str, override: int | None) -> int:
    if family == "qwen3_vl":
        return override or 224  # dynamic resolution: 224 is what VLA recipes feed
    size = int(hf_config.vision_config.image_size)
    if override not in (None, size):
        raise SchemaError(f"image_size={override}: this checkpoint's vision tower is fixed at {size}")
    return size


def _directory_tokens(path: Path, hf_config: Any, family: str) -> tuple[Tokenizer, list[int], TokenIds]:
    nexus = getattr(hf_config, HF_CONFIG_ATTR, None)
    has_tok = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    if not has_tok:
        if not nexus:
            raise SchemaError(f"source={str(path)!r}: no tokenizer files and no {HF_CONFIG_ATTR} token ids")
        vocab = int(hf_config.get_text_config().vocab_size)
        return ByteTokenizer(offset=4, vocab_size=vocab), [], TokenIds.from_dict(nexus["token_ids"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    image_id = int(getattr(hf_config, "image_token_id", None) or getattr(hf_config, "image_token_index"))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    bos = tok.bos_token_id if tok.bos_token_id is not None else pad
    # The readout slots need a fixed id; eos is in every vocabulary and means nothing mid-sequence.
    query = tok.eos_token_id if tok.eos_token_id is not None else pad
    extra: dict[str, int] = {}
    if family == "qwen3_vl":
        extra = {"vision_start": int(hf_config.vision_start_token_id), "vision_end": int(hf_config.vision_end_token_id)}
    elif family == "idefics3":
        extra = {"fake_image": int(tok.convert_tokens_to_ids("<fake_token_around_image>")),
                 "global_image": int(tok.convert_tokens_to_ids("<global-img>"))}
    return HFTokenizer(tok), [], TokenIds(pad=pad, bos=bos, query=query, image=image_id, extra=extra)
