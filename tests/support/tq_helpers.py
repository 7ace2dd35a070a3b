"""Tenants, micro-batches, queued jobs and an in-process reference trainer for the
training-queue tests (the exactly-once check: `exactly_once`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from protocol import ops
from protocol.messages import InfoRequest, QueuePutRequest, RoleInfo, TenantConfig

if TYPE_CHECKING:
    from sdk.client import AsyncClient

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


def tenant(name: str, schema=LIBERO_SCHEMA, head: str = "mlp", seed: int = 0, base: str = BASE, **kw) -> TenantConfig:
    return TenantConfig(name=name, base=base, schema=schema, head=head, seed=seed,
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


async def queue_job(c: AsyncClient, cfg: TenantConfig, n_items: int, seed: int = 0):
    """Reserve an SFT job of ``cfg``, put ``n_items`` micro-batches in its partition and mark it
    ready; return the job and the items (what `exactly_once` replays)."""
    job = await c.reserve(cfg.name, "sft", wait_s=60)
    items = [micro_batch(cfg, job.job, i, seed=seed) for i in range(n_items)]
    for item in items:
        await c.queue_put(item)
    await c.mark_ready(cfg.name, job.job)
    return job, items


async def role_info(c: AsyncClient, role: str, instance: str) -> RoleInfo:
    """One role instance's `info` reply (a trainer's counters are in ``extra``)."""
    return await c.bus.call(ops.INFO.of(role), InfoRequest(), instance=instance, timeout_s=10)


class Reference:
    """The trainer's math in-process: same base init, same slot seed, same steps in order."""

    def __init__(self, cfg: TenantConfig) -> None:
        from models import BaseConfig, BaseModel, OptimConfig, TenantSchema, TenantSlot

        self.base = BaseModel.load(BaseConfig(source=cfg.base))
        self.slot = TenantSlot.create(cfg.name, TenantSchema.from_dict(cfg.schema), self.base, head_kind=cfg.head,
                                      head_options=cfg.head_params, optim=OptimConfig(**cfg.optim), seed=cfg.seed)

    def train(self, items: list[QueuePutRequest]) -> None:
        from actors.trainer.step import item_to_batch
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


def exactly_once(cfg: TenantConfig, items: list[QueuePutRequest], payload: bytes) -> bool:
    """Are the exported weights ``payload`` bit-identical to applying each of ``items`` once, in
    order, in-process? A lost or a repeated step would change them."""
    ref = Reference(cfg)
    ref.train(items)
    return tensors_equal(payload, ref.params())
