"""TenantSlot: one tenant's private trainable state, mounted beside the shared base.

Holds the action head, its AdamW optimizer and LR schedule, step counter, policy version, the
tenant preprocessor and a seeded RNG. The base is *not* part of a slot: slots are cheap to
create, export, offload and restore while the base stays resident.

    slot = TenantSlot.create("acme", schema, base, head_kind="flow", seed=1)
    blob = slot.export_params()          # safetensors bytes of the head only
    other.load_params(blob)              # bit-exact
    ckpt = slot.checkpoint()             # + optimizer moments, counters, RNG (no pickle)
    slot.offload(); slot.to("cuda")      # keep idle slots off the accelerator

With `adapter=` (models.lora.AdapterConfig) the slot also owns a LoRA adapter on the base's
language model: trained with the head by the same AdamW, exported beside the head's tensors
(peft key names) and in peft's own directory format (`export_peft`).

policy_version counts optimizer steps; exported params carry it so an inferencer knows which
version it serves.

A KL term (PPO's ``kl_coef``, models/heads/gaussian.py) pulls toward an anchor: a frozen copy of
the policy taken at a version (`use_anchor`). The slot checkpoints it with its version, so a
restored or evicted slot computes the same loss; exported params never carry it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch

from models.errors import CheckpointError, InputError, SchemaError
from models.heads import ActionHead, HeadDims, build_head, head_config
from models.lora import (AdapterConfig, LoraAdapter, Segment, is_adapter_key, read_peft_dir, router_for, target_paths,
                         write_peft_dir)
from models.preprocess import TenantPreprocessor
from models.schema import TenantSchema
from models.serialization import FORMAT_CHECKPOINT, FORMAT_PARAMS, dump, load

_MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "step")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW + linear warmup + cosine decay to min_lr_ratio * lr at total_steps (constant after).
    total_steps None = constant LR after warmup. grad_clip None = no clipping.

    ``schedule_start``: the slot's step count at which this schedule begins (the tenant's version
    when its current workload was accepted). A tenant outlives its workloads: without it a
    second SFT of 128 steps on a tenant at step 128 ran its whole budget past the first one's
    cosine, at the floor LR, with no warmup."""

    lr: float = 1e-4
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.1
    grad_clip: float | None = 1.0
    schedule_start: int = 0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise SchemaError(f"optim.lr={self.lr}: must be > 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise SchemaError(f"optim.beta1/beta2=({self.beta1}, {self.beta2}): must be in [0, 1)")
        if self.warmup_steps < 0 or (self.total_steps is not None and self.total_steps <= 0):
            raise SchemaError("optim.warmup_steps must be >= 0 and optim.total_steps > 0 or None")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise SchemaError(f"optim.grad_clip={self.grad_clip}: must be > 0 or None")
        if self.schedule_start < 0:
            raise SchemaError(f"optim.schedule_start={self.schedule_start}: must be >= 0")

    def lr_at(self, step: int) -> float:
        """The LR of the slot's step ``step`` (its lifetime count), on this workload's schedule."""
        step = max(0, step - self.schedule_start)
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return self.lr
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        cos = 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cos)


class TenantSlot:
    def __init__(self, tenant_id: str, schema: TenantSchema, preprocessor: TenantPreprocessor, head: ActionHead,
                 optim: OptimConfig, seed: int, adapter: LoraAdapter | None = None, base_id: str = "") -> None:
        self.tenant_id = tenant_id
        # The tenant's LoRA adapter on the shared base (None: frozen base); trained with the head.
        self.adapter = adapter
        self.base_id = base_id or preprocessor.key.base_id
        self.schema = schema
        self.preprocessor = preprocessor
        self.key = preprocessor.key
        self.head = head
        self.optim_config = optim
        self.seed = seed
        self.step_count = 0
        self.policy_version = 0
        self.anchor_version = -1  # the policy version the head's KL anchor was taken at (-1: none held)
        # Noise for flow time / actions is drawn from this CPU generator only (see heads.base).
        self.generator = torch.Generator().manual_seed(seed)
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self.named_trainable()], lr=optim.lr_at(0), betas=(optim.beta1, optim.beta2), eps=optim.eps,
            weight_decay=optim.weight_decay, foreach=False,
        )

    @classmethod
    def create(cls, tenant_id: str, schema: TenantSchema, base, head_kind: str = "mlp",
               head_options: dict[str, Any] | None = None, optim: OptimConfig | None = None, seed: int = 0,
               device: torch.device | str | None = None, adapter: AdapterConfig | dict[str, Any] | None = None
               ) -> "TenantSlot":
        """Slot for `base` (a BaseModel): head sized to the base, init from `seed`, on the base's device.
        adapter: LoRA on the base's language model (an `AdapterConfig`, or its dict; None/{}: none)."""
        pre = TenantPreprocessor.for_base(schema, base)
        lay = pre.key.layout
        att = base.attention_shape()
        dims = HeadDims(base.hidden_size, lay.num_query_tokens, lay.max_state_dim, schema.state_dim,
                        schema.action_dim, schema.action_horizon, lay.camera_slots,
                        att.layers, att.heads, att.kv_heads, att.head_dim)
        cfg = head_config(head_kind, head_options)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = build_head(head_kind, dims, cfg)
            lora = None
            acfg = AdapterConfig.from_dict(adapter) if isinstance(adapter, dict) else adapter
            if acfg is not None:
                router = router_for(base)
                shapes = router.shapes
                # Drawn after the head from the same seeded stream: a frozen tenant's head init
                # is the same with or without this feature.
                paths = target_paths(shapes, acfg)
                if head.needs_prefix_kv:
                    paths = cache_paths(paths, head.layer_map[-1])
                lora = LoraAdapter(acfg, {p: shapes[p] for p in paths})
        head.to(device or base.device)
        if lora is not None:
            lora.to(device or base.device)
        return cls(tenant_id, schema, pre, head, optim or OptimConfig(), seed, adapter=lora, base_id=base.base_id)

    # ---- identity -----------------------------------------------------------------------
    @property
    def head_kind(self) -> str:
        return self.head.kind

    @property
    def device(self) -> torch.device:
        return next(self.head.parameters()).device

    def named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Head parameters (their own names), then the adapter's (``adapter.`` + name)."""
        out = list(self.head.named_parameters())
        if self.adapter is not None:
            out += [(f"adapter.{n}", p) for n, p in self.adapter.named_parameters()]
        return out

    def adapter_segment(self, start: int, end: int, *, train: bool) -> Segment | None:
        """This slot's rows [start, end) of a group forward (None: frozen base, nothing to add).
        Training with dropout draws one seed from the slot's generator for the step's masks."""
        if self.adapter is None:
            return None
        gen = None
        if train and self.adapter.config.dropout > 0:
            seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
            gen = torch.Generator(device=self.device).manual_seed(seed)
        return Segment(start, end, self.adapter, gen)

    def _meta(self) -> dict[str, Any]:
        return {
            "tenant_id": self.tenant_id,
            "schema": self.schema.to_dict(),
            "schema_signature": self.schema.signature(),
            "compat_key": self.key.digest,
            "head_kind": self.head_kind,
            "head_config": asdict(self.head.config),
            "head_dims": asdict(self.head.dims),
            "policy_version": self.policy_version,
            "step": self.step_count,
            "base_id": self.base_id,
            "base_adapter": self.adapter.config.to_dict() if self.adapter is not None else {},
        }

    # ---- training ---------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> dict[str, float]:
        """Clip, set this step's LR, AdamW step; advances step_count and policy_version."""
        grad_norm = float("nan")
        if self.optim_config.grad_clip is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_([p for _, p in self.named_trainable()],
                                                             self.optim_config.grad_clip))
        lr = self.optim_config.lr_at(self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.step_count += 1
        self.policy_version += 1
        return {"lr": lr, "grad_norm": grad_norm}

    def use_anchor(self, version: int) -> None:
        """Hold the anchor of policy version ``version``: kept if held, taken now when the slot
        is at that version (before the step that needs it), else InputError: an anchor is this
        slot's own policy at a version, and a version gone by cannot be copied any more."""
        if version == self.anchor_version:
            return
        held = f"holds the anchor of version {self.anchor_version}" if self.anchor_version >= 0 else "holds no anchor"
        if version < 0 or version != self.policy_version:
            raise InputError(f"tenant {self.tenant_id}: a KL term anchored at version {version}, but the slot is at "
                             f"version {self.policy_version} and {held}; an anchor is taken when the slot is at its "
                             "version (kl_anchor_version: the version the workload starts from, or the one held)")
        self.head.take_anchor()
        self.anchor_version = version

    def _drop_anchor(self) -> None:
        self.head.drop_anchor()
        self.anchor_version = -1

    # ---- params export ----------------------------------------------------------------
    def export_params(self) -> bytes:
        """safetensors bytes of the head's parameters and buffers, plus the adapter's tensors under
        peft's names (``base_model.model.<path>.lora_A.weight``); never base weights."""
        return dump(self._module_tensors(), self._meta(), FORMAT_PARAMS)

    def _module_tensors(self) -> dict[str, torch.Tensor]:
        tensors = dict(self.head.state_dict())
        if self.adapter is not None:
            tensors.update(self.adapter.peft_state_dict())
        return tensors

    def export_peft(self, path: str | Any) -> Any:
        """The adapter as a peft directory (adapter_config.json + adapter_model.safetensors) that
        `PeftModel.from_pretrained(<this base's core>, path)` loads. Returns the path."""
        if self.adapter is None:
            raise CheckpointError(f"tenant {self.tenant_id}: no base_adapter to export (the base is frozen)")
        return write_peft_dir(path, self.adapter.peft_config(self.base_id), self.adapter.peft_state_dict())

    def load_peft(self, path: str | Any) -> None:
        """Load a peft adapter directory exported for this base into the slot's adapter."""
        if self.adapter is None:
            raise CheckpointError(f"tenant {self.tenant_id}: no base_adapter to load into (the base is frozen)")
        config, tensors = read_peft_dir(path)
        theirs = config.get("base_model_name_or_path")
        if theirs != self.base_id:
            raise CheckpointError(f"adapter {path} was exported for base {theirs!r}, this slot's base is "
                                  f"{self.base_id!r}: refusing to load it")
        self.adapter.load_peft_state_dict(tensors)

    def load_params(self, data: bytes, *, strict_schema: bool = True) -> dict[str, Any]:
        """Load exported params bit-exactly; adopts their policy_version. Returns their metadata."""
        tensors, meta = load(data, FORMAT_PARAMS)
        self._check_meta(meta, strict_schema)
        self._load_head_tensors(tensors)
        self.policy_version = int(meta.get("policy_version", self.policy_version))
        self._drop_anchor()  # its version's policy is no longer this slot's history
        return meta

    def load_start(self, tensors: dict[str, torch.Tensor]) -> None:
        """Start from tensors a tenant brought (a policy it downloaded, its own head, a peft
        adapter): every name and shape must be the slot's own (the head's state_dict names and
        the adapter's peft names), else one CheckpointError naming each tensor that does not fit
        and both shapes. Floating tensors are cast to the slot's dtype; the version stays 0."""
        own = self._module_tensors()
        errors = []
        for k in sorted(set(tensors) - set(own)):
            errors.append(f"tensor {k!r} (shape {tuple(tensors[k].shape)}) is not in the spec's action module "
                          f"or adapter")
        for k in sorted(set(own) - set(tensors)):
            errors.append(f"tensor {k!r} of the spec's action module (shape {tuple(own[k].shape)}) is missing "
                          "from the upload")
        for k in sorted(set(own) & set(tensors)):
            theirs, mine = tensors[k], own[k]
            if tuple(theirs.shape) != tuple(mine.shape):
                errors.append(f"tensor {k!r}: uploaded shape {tuple(theirs.shape)}, the spec's action module has "
                              f"{tuple(mine.shape)}")
            elif theirs.dtype != mine.dtype and not (theirs.is_floating_point() and mine.is_floating_point()):
                errors.append(f"tensor {k!r}: uploaded dtype {theirs.dtype}, the spec's action module has {mine.dtype}")
        if errors:
            more = f" (and {len(errors) - 8} more)" if len(errors) > 8 else ""
            raise CheckpointError("; ".join(errors[:8]) + more)
        self._load_head_tensors({k: v.to(own[k].dtype) for k, v in tensors.items()})
        self._drop_anchor()

    def _check_meta(self, meta: dict[str, Any], strict_schema: bool) -> None:
        mine = self.adapter.config.to_dict() if self.adapter is not None else {}
        theirs = meta.get("base_adapter") or {}
        if (theirs or self.head.needs_prefix_kv) and meta.get("base_id") and meta["base_id"] != self.base_id:
            # An adapter's deltas, and an expert's attention over the base's cache, only mean
            # something on the weights they were trained against.
            what = "adapter" if theirs else "expert"
            raise CheckpointError(f"{what} payload was exported for base {meta['base_id']!r}, this slot's base is "
                                  f"{self.base_id!r}: refusing to load it")
        if theirs != mine:
            raise CheckpointError(f"payload base_adapter {theirs or 'none'}, the slot has {mine or 'none'}")
        if meta.get("head_kind") != self.head_kind:
            raise CheckpointError(f"payload head_kind {meta.get('head_kind')!r}, slot has {self.head_kind!r}")
        if strict_schema and meta.get("schema_signature") != self.schema.signature():
            raise CheckpointError("payload schema_signature differs from the slot's schema")

    def _load_head_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.adapter is not None:
            self.adapter.load_peft_state_dict({k: v for k, v in tensors.items() if is_adapter_key(k)})
            tensors = {k: v for k, v in tensors.items() if not is_adapter_key(k)}
        own = self.head.state_dict()
        if set(tensors) != set(own):
            missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
            raise CheckpointError(f"param keys differ: missing {missing[:5]}, unexpected {extra[:5]}")
        for k, v in tensors.items():
            if v.shape != own[k].shape or v.dtype != own[k].dtype:
                raise CheckpointError(f"param {k}: {tuple(v.shape)}/{v.dtype}, slot has {tuple(own[k].shape)}/{own[k].dtype}")
        with torch.no_grad():
            for k, t in own.items():
                t.copy_(tensors[k])

    # ---- full checkpoint --------------------------------------------------------------
    def checkpoint(self) -> bytes:
        """Params + AdamW moments + counters + RNG state, as safetensors bytes."""
        tensors: dict[str, torch.Tensor] = {f"param.{k}": v for k, v in self._module_tensors().items()}
        names = {id(p): n for n, p in self.named_trainable()}
        for p, st in self.optimizer.state.items():
            for k in _MOMENT_KEYS:
                if k in st:
                    v = st[k]
                    tensors[f"optim.{names[id(p)]}.{k}"] = v if torch.is_tensor(v) else torch.tensor(float(v))
        tensors["rng.generator"] = self.generator.get_state()
        meta = self._meta() | {"optim_config": asdict(self.optim_config), "seed": self.seed}
        if self.anchor_version >= 0:  # only then: a slot without a KL term checkpoints as before
            tensors.update({f"anchor.{k}": v for k, v in self.head.anchor_tensors().items()})
            meta["anchor_version"] = self.anchor_version
        return dump(tensors, meta, FORMAT_CHECKPOINT)

    def restore(self, data: bytes) -> None:
        tensors, meta = load(data, FORMAT_CHECKPOINT)
        self._check_meta(meta, strict_schema=True)
        self._load_head_tensors({k[6:]: v for k, v in tensors.items() if k.startswith("param.")})
        device = self.device
        state: dict[int, dict[str, torch.Tensor]] = {}
        for i, (name, p) in enumerate(self.named_trainable()):
            moments = {k: tensors[f"optim.{name}.{k}"] for k in _MOMENT_KEYS if f"optim.{name}.{k}" in tensors}
            if moments:
                # AdamW keeps `step` on CPU (capturable=False); moments live with the param.
                state[i] = {k: (v if k == "step" else v.to(device)) for k, v in moments.items()}
        sd = self.optimizer.state_dict()
        sd["state"] = state
        self.optimizer.load_state_dict(sd)
        self.generator.set_state(tensors["rng.generator"])
        self.step_count = int(meta["step"])
        self.policy_version = int(meta["policy_version"])
        self._drop_anchor()
        if int(meta.get("anchor_version", -1)) >= 0:
            self.head.set_anchor({k[7:]: v for k, v in tensors.items() if k.startswith("anchor.")})
            self.anchor_version = int(meta["anchor_version"])

    # ---- placement --------------------------------------------------------------------
    def to(self, device: torch.device | str) -> "TenantSlot":
        """Move head and optimizer moments (AdamW's scalar `step` stays on CPU)."""
        self.head.to(device)
        if self.adapter is not None:
            self.adapter.to(device)
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and k != "step":
                    st[k] = v.to(device)
        return self

    def offload(self) -> "TenantSlot":
        return self.to("cpu")

    def memory_bytes(self) -> dict[str, int]:
        trainable = [p for _, p in self.named_trainable()]
        params = sum(p.numel() * p.element_size() for p in trainable)
        buffers = sum(b.numel() * b.element_size() for b in self.head.buffers())
        # Call this on the thread that trains the slot, never beside it: reading `.grad` makes a
        # Python object for a tensor that a step may be freeing at the same moment, which torch
        # does not guard (the trainer's `Resident.measure` runs on its torch thread for this).
        grads = sum(g.numel() * g.element_size() for g in (p.grad for p in trainable) if g is not None)
        optim = sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                    for v in st.values() if torch.is_tensor(v))
        return {"params": params, "buffers": buffers, "grads": grads, "optimizer": optim,
                "total": params + buffers + grads + optim}

    def __repr__(self) -> str:
        lora = "" if self.adapter is None else f", lora=r{self.adapter.config.rank}"
        return (f"TenantSlot({self.tenant_id!r}, head={self.head_kind}{lora}, step={self.step_count}, "
                f"version={self.policy_version}, key={self.key})")


def cache_paths(paths: list[str], last_layer: int) -> list[str]:
    """The adapted linears that can change the KV cache an action expert reads up to base layer
    ``last_layer``: every layer before it, and in it only the key and value projections (its
    queries, output and MLP, and later layers, reach no cache the expert reads: an adapter there
    would get no gradient, and AdamW would still decay it)."""
    keep = []
    for p in paths:
        layer = int(re.search(r"\.layers\.(\d+)\.", p).group(1))
        if layer < last_layer or (layer == last_layer and p.rsplit(".", 1)[-1] in ("k_proj", "v_proj")):
            keep.append(p)
    if not keep:
        raise SchemaError(f"base_adapter.target_modules: none of the adapted layers can change the KV cache this expert "
                          f"reads (base layers 0..{last_layer}; in layer {last_layer} only k_proj, v_proj)")
    return keep


def schema_from_meta(meta: dict[str, Any]) -> TenantSchema:
    """The schema stored in exported params / checkpoint metadata."""
    return TenantSchema.from_dict(meta["schema"] if isinstance(meta["schema"], dict) else json.loads(meta["schema"]))
