"""Action-head contract, tenant batches and the head registry.

A head is a tenant-private `nn.Module` on top of the frozen base's features:

    head.loss(feats, batch, generator) -> LossOutput   # scalar loss + float metrics
    head.predict(feats, vla, generator) -> actions_B_H_A

`feats` is a `BaseOutput` (hidden states, mask, query positions) computed without grad;
`vla` is the canonical `VLABatch` (for the padded proprio state). Randomness (noise, flow
time, action sampling) comes only from the `generator` the slot passes in, so a grouped and a
serial run draw identical numbers. Noise is drawn on CPU and moved: CPU and CUDA generators
have different states, and CPU draws keep a slot's stream the same wherever it lives.

Register a new head with `@register_head("name", ConfigClass)`.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from models.errors import InputError, SchemaError, UnknownNameError
from models.features import VLABatch
from models.outputs import BaseOutput


@dataclass(frozen=True)
class HeadDims:
    """Shapes a head is built for: the base's and the tenant's."""

    hidden_size: int  # base text hidden size D
    num_queries: int  # action-query tokens Q
    max_state_dim: int  # canonical padded state width
    state_dim: int  # tenant's real state dims (first ones of the padded state)
    action_dim: int
    action_horizon: int
    camera_slots: int = 2  # canonical camera slots (heads that look at the frames themselves)
    # The base's text attention (models.families.AttentionShape), for heads that read its
    # per-layer KV cache (the action expert); 0 = not given.
    text_layers: int = 0
    text_heads: int = 0
    text_kv_heads: int = 0
    text_head_dim: int = 0


@dataclass
class TenantBatch:
    """One tenant's training micro-batch. RL fields are set for PPO, absent for SFT."""

    features: VLABatch
    actions_B_H_A: torch.Tensor
    old_log_prob_B: torch.Tensor | None = None
    advantages_B: torch.Tensor | None = None
    returns_B: torch.Tensor | None = None
    # Weight of the KL term to the slot's anchor policy (`TenantSlot.use_anchor`); 0: none.
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.actions_B_H_A.ndim != 3 or self.actions_B_H_A.shape[0] != len(self.features):
            raise InputError(
                f"actions_B_H_A: shape {tuple(self.actions_B_H_A.shape)}, need ({len(self.features)}, horizon, action_dim)"
            )

    def __len__(self) -> int:
        return len(self.features)


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


class ActionHead(nn.Module):
    """Base class: subclasses implement `loss` and `predict`."""

    kind: str = ""
    # True: `feats.prefix` must hold the base's per-layer KV cache (BaseModel.encode(prefix_kv=True)).
    needs_prefix_kv: bool = False

    def __init__(self, dims: HeadDims, config: Any) -> None:
        super().__init__()
        self.dims = dims
        self.config = config

    def state(self, vla: VLABatch) -> torch.Tensor:
        """Tenant's real state dims, float32, on the head's device."""
        return vla.state_B_D[:, : self.dims.state_dim].to(self._device, torch.float32)

    @property
    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def check_actions(self, actions: torch.Tensor) -> torch.Tensor:
        want = (self.dims.action_horizon, self.dims.action_dim)
        if tuple(actions.shape[1:]) != want:
            raise InputError(f"actions_B_H_A: shape {tuple(actions.shape)}, this head needs (B, {want[0]}, {want[1]})")
        return actions.to(self._device, torch.float32)

    def loss(self, feats: BaseOutput, batch: TenantBatch, generator: torch.Generator) -> LossOutput:
        raise NotImplementedError

    def predict(self, feats: BaseOutput, vla: VLABatch, generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    # ---- the KL anchor: a frozen copy of the policy a KL term pulls toward (heads with a
    # log-prob: models/heads/gaussian.py). Heads without one refuse to take it.
    def take_anchor(self) -> None:
        raise InputError(f"head {self.kind!r} has no KL term (kl_coef): only a gaussian head's PPO loss takes one")

    def set_anchor(self, tensors: dict[str, torch.Tensor]) -> None:
        self.take_anchor()

    def drop_anchor(self) -> None:
        """Forget the anchor (none held: nothing to do)."""

    def anchor_tensors(self) -> dict[str, torch.Tensor]:
        """The held anchor's tensors by policy tensor name ({}: none held)."""
        return {}

    def anchor_bytes(self) -> int:
        """Bytes an anchor of this head takes once held (0: it takes none)."""
        return 0

    def batch_key(self, feats: BaseOutput) -> Any:
        """Heads whose keys are equal can sample together (`predict_many`, one batched network
        for several tenants' rows); None (the default): this head samples alone."""
        return None

    @classmethod
    def predict_many(cls, heads: list["ActionHead"], feats: list[BaseOutput], vlas: list[VLABatch],
                     generators: list[torch.Generator]) -> list[torch.Tensor]:
        """`predict` of each head on its own rows, for heads of equal `batch_key`."""
        return [h.predict(f, v, g) for h, f, v, g in zip(heads, feats, vlas, generators)]


# Data parallelism (models/parallel.py): a rank holds rows [start, start + rows) of a tenant's
# `total` rows. While a window is set for a generator, a per-row draw (first dim == rows) draws
# the whole batch's numbers and keeps this rank's slice, so every rank advances the generator as
# one process would and each row gets the noise it gets on one rank. Keyed by id(generator).
_ROW_WINDOWS: contextvars.ContextVar[Mapping[int, tuple[int, int, int]]] = contextvars.ContextVar(
    "row_windows", default={})


@contextlib.contextmanager
def row_windows(windows: Mapping[torch.Generator, tuple[int, int, int]]) -> Iterator[None]:
    """Per generator ``(start, rows, total)``: draws whose first dimension is ``rows`` are
    drawn at ``total`` and sliced at ``start`` (see `randn`); other draws are unchanged (a draw
    whose shape does not depend on the batch is the same on every rank)."""
    token = _ROW_WINDOWS.set({id(g): w for g, w in windows.items()})
    try:
        yield
    finally:
        _ROW_WINDOWS.reset(token)


def _draw(fn: Callable[..., torch.Tensor], shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    window = _ROW_WINDOWS.get().get(id(generator))
    if window is None or not shape or shape[0] != window[1]:
        return fn(shape, generator=generator)
    start, rows, total = window
    return fn((total, *shape[1:]), generator=generator)[start:start + rows]


def randn(shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    return _draw(torch.randn, shape, generator).to(device)


def rand(shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    return _draw(torch.rand, shape, generator).to(device)


def mlp(sizes: list[int], act: Callable[[], nn.Module] = nn.GELU) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


# ---- registry -------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadEntry:
    cls: type[ActionHead]
    config_cls: type


HEADS: dict[str, HeadEntry] = {}


def register_head(kind: str, config_cls: type) -> Callable[[type[ActionHead]], type[ActionHead]]:
    def deco(cls: type[ActionHead]) -> type[ActionHead]:
        if kind in HEADS:
            raise ValueError(f"head kind {kind!r} registered twice")
        cls.kind = kind
        HEADS[kind] = HeadEntry(cls, config_cls)
        return cls

    return deco


def head_config(kind: str, options: dict[str, Any] | None = None) -> Any:
    """Typed config for a head kind from plain options; unknown option names are an error."""
    entry = _entry(kind)
    options = dict(options or {})
    allowed = {f.name for f in fields(entry.config_cls)}
    unknown = set(options) - allowed
    if unknown:
        raise SchemaError(f"head {kind!r}: unknown options {sorted(unknown)}; allowed: {sorted(allowed)}")
    # Every head's switches at once: "yes" or 3 from a spec is an error, not a truthy value.
    for f in fields(entry.config_cls):
        if f.type in ("bool", bool) and f.name in options and not isinstance(options[f.name], bool):
            raise SchemaError(f"{kind}.{f.name}={options[f.name]!r}: must be true or false")
    return entry.config_cls(**options)


def build_head(kind: str, dims: HeadDims, config: Any = None) -> ActionHead:
    entry = _entry(kind)
    if config is None:
        config = entry.config_cls()
    if not isinstance(config, entry.config_cls):
        raise SchemaError(f"head {kind!r}: config must be {entry.config_cls.__name__}, got {type(config).__name__}")
    return entry.cls(dims, config)


def _entry(kind: str) -> HeadEntry:
    try:
        return HEADS[kind]
    except KeyError:
        raise UnknownNameError(f"unknown head kind {kind!r}; registered: {sorted(HEADS)}") from None


def positive(name: str, value: float) -> None:
    if not value > 0:
        raise SchemaError(f"{name}={value!r}: must be > 0")
