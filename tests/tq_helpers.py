"""Tenants, micro-batches and an in-process reference trainer for the training-queue tests."""

from __future__ import annotations

import numpy as np

from protocol.messages import QueuePutRequest, TenantConfig

LIBERO_SCHEMA = {
    "cameras": [{"name": "agentview", "height": 16, "width": 16}, {"name": "wrist", "height": 16, "width": 16}],
    "state_dim": 8, "action_dim": 7, "action_horizon": 4,
    "instruction_template": "What should the robot do to {instruction}?",
}
CALVIN_SCHEMA = {
    "cameras": [{"name": "static", "height": 12, "width": 12}, {"name": "gripper", "height": 12, "width": 12}],
    "state_dim": 15, "action_dim": 7, "action_horizon": 4,
    "instruction_template": "{instruction}",
}
BASE = "tiny-qwen3-vl"


def tenant(name: str, schema=LIBERO_SCHEMA, head: str = "mlp", seed: int = 0, **kw) -> TenantConfig:
    return TenantConfig(name=name, base=BASE, schema=schema, head=head, seed=seed,
                        optim={"lr": 1e-3}, **kw)


def micro_batch(cfg: TenantConfig, job: str, seq: int, b: int = 2, rl_version: int = -1,
                seed: int = 0) -> QueuePutRequest:
    rng = np.random.default_rng(seed * 1000 + seq)
    s = cfg.schema
    images = {c["name"]: rng.integers(0, 256, (b, c["height"], c["width"], 3), dtype=np.uint8) for c in s["cameras"]}
    item = QueuePutRequest(
        tenant=cfg.name, job=job, seq=seq, images=images,
        state=rng.standard_normal((b, s["state_dim"])).astype(np.float32),
        instructions=[f"pick up block {i % 3}" for i in range(b)],
        actions=rng.uniform(-1, 1, (b, s["action_horizon"], s["action_dim"])).astype(np.float32),
    )
    if rl_version >= 0:
        item.old_log_prob = rng.standard_normal(b).astype(np.float32) - 5
        item.advantages = rng.standard_normal(b).astype(np.float32)
        item.returns = rng.standard_normal(b).astype(np.float32)
        item.behaviour_version = rl_version
    return item


class Reference:
    """The trainer's math in-process: same base init, same slot seed, same steps in order."""

    def __init__(self, cfg: TenantConfig) -> None:
        from models import BaseConfig, BaseModel, OptimConfig, TenantSchema, TenantSlot

        self.base = BaseModel.load(BaseConfig(source=cfg.base))
        self.slot = TenantSlot.create(cfg.name, TenantSchema.from_dict(cfg.schema), self.base, head_kind=cfg.head,
                                      head_options=cfg.head_params, optim=OptimConfig(**cfg.optim), seed=cfg.seed)

    def train(self, items: list[QueuePutRequest]) -> None:
        from actors.trainer import item_to_batch
        from models import train_step

        for item in items:
            train_step(self.base, [(self.slot, item_to_batch(self.slot, item))], grouped=True)

    def params(self) -> bytes:
        return self.slot.export_params()


def tensors_equal(payload_a: bytes, payload_b: bytes) -> bool:
    """Bit-exact equality of the tensors of two exported payloads (metadata aside)."""
    import torch
    from safetensors.torch import load

    a, b = load(payload_a), load(payload_b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
