"""vla-nexus model core: frozen shared VLM base, tenant slots, group-batched forward.

Used by the trainer and the inferencer processes; no NATS and no service code in here.

    from models import BaseConfig, BaseModel, TenantSchema, TenantSlot, train_step
    base = BaseModel.load(BaseConfig("tiny-qwen3-vl"))
    slot = TenantSlot.create("acme", schema, base, head_kind="mlp", seed=0)
    vla = slot.preprocessor(observations)            # raw obs -> canonical VLAFeature batch
    train_step(base, [(slot, TenantBatch(vla, actions_B_H_A))], grouped=True)

See docs/model_core.md for the design and the API.
"""

from models.base import BaseConfig, BaseModel
from models.errors import (
    CheckpointError,
    IncompatibleBatchError,
    InputError,
    ModelCoreError,
    SchemaError,
    UnknownNameError,
)
from models.features import VLABatch, VLAFeature
from models.group import (
    StepResult,
    encode_grouped,
    encode_serial,
    forward_backward,
    partition_by_key,
    predict,
    train_step,
)
from models.lora import AdapterConfig, LoraAdapter
from models.heads import HEADS, ActionHead, HeadDims, TenantBatch, build_head, head_config, register_head
from models.outputs import BaseOutput
from models.preprocess import Observation, TenantPreprocessor
from models.presets import PRESETS
from models.schema import CameraSpec, CompatibilityKey, FeatureLayout, TenantSchema
from models.slot import OptimConfig, TenantSlot

__all__ = [
    "HEADS", "PRESETS", "ActionHead", "AdapterConfig", "LoraAdapter", "BaseConfig", "BaseModel", "BaseOutput", "CameraSpec", "CheckpointError",
    "CompatibilityKey", "FeatureLayout", "HeadDims", "IncompatibleBatchError", "InputError", "ModelCoreError",
    "Observation", "OptimConfig", "SchemaError", "StepResult", "TenantBatch", "TenantPreprocessor", "TenantSchema",
    "TenantSlot", "UnknownNameError", "VLABatch", "VLAFeature", "build_head", "encode_grouped", "encode_serial",
    "forward_backward", "head_config", "partition_by_key", "predict", "register_head", "train_step",
]
