"""Checks on a tenant's config before it is stored: schema, head, optimizer, base and adapter fit."""

from __future__ import annotations

import os
from typing import Any

from protocol.errors import InvalidField
from protocol.messages import TenantConfig
from protocol.subjects import canonical_base


def schema_signature(schema: dict[str, Any]) -> str:
    from models.schema import TenantSchema  # lazy: torch is heavy and only this op needs it

    try:
        return TenantSchema.from_dict(schema).signature()
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidField("config.schema", str(exc)) from None


def check_config(cfg: TenantConfig) -> None:
    from models.heads import head_config
    from models.slot import OptimConfig

    try:
        head_config(cfg.head, cfg.head_params)
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidField("config.head_params", str(exc)) from None
    try:
        OptimConfig(**cfg.optim)
    except (ValueError, TypeError) as exc:
        raise InvalidField("config.optim", str(exc)) from None
    for name in ("max_inflight_jobs", "sft_prefetch_items", "staleness_bound"):
        if getattr(cfg, name) < 1:
            raise InvalidField(f"config.{name}", "must be >= 1")
    from models.presets import PRESETS

    if cfg.base not in PRESETS and not os.path.isdir(cfg.base):
        raise InvalidField("config.base", f"{cfg.base!r} is neither a preset ({sorted(PRESETS)}) nor a local directory")
    # Stored by identity (a directory's resolved absolute path): every process then derives
    # the same inference pool from it, whatever its working directory.
    cfg.base = canonical_base(cfg.base)


def adapter_errors(cfg: TenantConfig) -> list[tuple[str, str, Any]]:
    """(field, message, value) for a base_adapter that does not fit the tenant's base: unknown
    target modules, a rank of 0 or above the layer width (models.lora names what it allows)."""
    from models.errors import ModelCoreError
    from models.lora import adapter_errors as check, base_linear_shapes

    try:
        shapes = base_linear_shapes(cfg.base)
    except (ModelCoreError, OSError, ValueError) as exc:
        return [("base", f"cannot read the layers of base {cfg.base!r} to check base_adapter: {exc}", cfg.base)]
    return check(shapes, cfg.base_adapter)


def base_fit_errors(cfg: TenantConfig, params_field: str = "action_module.params") -> list[tuple[str, str, Any]]:
    """`adapter_errors` plus, for an action expert, whether its options can read the base's
    per-layer KV cache (layer count, head shape; models.heads.expert names what it allows).
    params_field: where the head options sit in what the caller was given (spec or config)."""
    errors = adapter_errors(cfg) if cfg.base_adapter else []
    if cfg.head == "expert":
        from models.errors import ModelCoreError
        from models.heads.expert import base_expert_errors

        try:
            errors += base_expert_errors(cfg.base, dict(cfg.head_params), params_field)
        except (ModelCoreError, OSError, ValueError) as exc:
            errors.append(("base", f"cannot read the attention shape of base {cfg.base!r} to check the expert: {exc}",
                           cfg.base))
    return errors
