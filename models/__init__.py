"""vla-nexus model core: frozen shared VLM base, tenant slots, group-batched forward.

Used by the trainer and the inferencer processes; no NATS and no service code in here.

    from models import BaseConfig, BaseModel, TenantSchema, TenantSlot, train_step
    base = BaseModel.load(BaseConfig("tiny-qwen3-vl"))
    slot = TenantSlot.create("acme", schema, base, head_kind="mlp", seed=0)
    vla = slot.preprocessor(observations)            # raw obs -> canonical VLAFeature batch
    train_step(base, [(slot, TenantBatch(vla, actions_B_H_A))], grouped=True)

See docs/model_core.md for the design and the API.
"""

# Names are imported on first use (PEP 562), not at `import models`: the CLI and the spec
# validator read `models.presets` (plain data), and must not pay for torch + transformers.
_SOURCES = {
    "models.base": ("BaseConfig", "BaseModel", "BaseOutput"),
    "models.errors": ("CheckpointError", "IncompatibleBatchError", "InputError", "ModelCoreError",
                      "SchemaError", "UnknownNameError"),
    "models.features": ("VLABatch", "VLAFeature"),
    "models.group": ("StepResult", "encode_grouped", "encode_serial", "forward_backward", "partition_by_key",
                     "predict", "train_step"),
    "models.heads": ("HEADS", "ActionHead", "HeadDims", "TenantBatch", "build_head", "head_config",
                     "register_head"),
    "models.preprocess": ("Observation", "TenantPreprocessor"),
    "models.presets": ("PRESETS",),
    "models.schema": ("CameraSpec", "CompatibilityKey", "FeatureLayout", "TenantSchema"),
    "models.slot": ("OptimConfig", "TenantSlot"),
}
_WHERE = {name: module for module, names in _SOURCES.items() for name in names}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "HEADS", "PRESETS", "ActionHead", "BaseConfig", "BaseModel", "BaseOutput", "CameraSpec", "CheckpointError",
    "CompatibilityKey", "FeatureLayout", "HeadDims", "IncompatibleBatchError", "InputError", "ModelCoreError",
    "Observation", "OptimConfig", "SchemaError", "StepResult", "TenantBatch", "TenantPreprocessor", "TenantSchema",
    "TenantSlot", "UnknownNameError", "VLABatch", "VLAFeature", "build_head", "encode_grouped", "encode_serial",
    "forward_backward", "head_config", "partition_by_key", "predict", "register_head", "train_step",
]
