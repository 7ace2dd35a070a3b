"""Tenant-private action heads and their registry (`mlp`, `flow`, `gaussian`, `expert`).

    head = build_head("flow", dims, head_config("flow", {"euler_steps": 4}))
"""

from models.heads.base import (
    HEADS,
    ActionHead,
    HeadDims,
    LossOutput,
    TenantBatch,
    build_head,
    head_config,
    register_head,
)
from models.heads.expert import ExpertHead, ExpertHeadConfig
from models.heads.flow import FlowHead, FlowHeadConfig
from models.heads.gaussian import GaussianHead, GaussianHeadConfig
from models.heads.mlp import MLPHead, MLPHeadConfig

__all__ = [
    "HEADS", "ActionHead", "ExpertHead", "ExpertHeadConfig", "FlowHead", "FlowHeadConfig", "GaussianHead", "GaussianHeadConfig", "HeadDims",
    "LossOutput", "MLPHead", "MLPHeadConfig", "TenantBatch", "build_head", "head_config", "register_head",
]
