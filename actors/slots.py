"""Tenant slots of one trainer: resident bases, slots, checkpoints and exports.

    store = SlotStore(bus, names, device=None)
    slot = await store.slot(tenant_config)        # resident, restored from its checkpoint
    await store.commit(tenant, applied_job_ids)   # checkpoint = the commit point of a job
    ref = await store.export(tenant, metrics)     # payload + manifest, announced

A checkpoint is one object ``<tenant>/checkpoint`` in the checkpoints bucket: msgpack of the
slot's own checkpoint bytes (head, AdamW moments, counters, RNG) together with the ids of the
jobs already applied. One object put is atomic, so "this job's step is applied" and "the
state after it" can never be written apart: that is what makes a job's step apply at most
once across trainer crashes (see docs/architecture.md, exactly-once).
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from nats.js.errors import ObjectNotFoundError

from protocol.codec import packb, unpackb
from protocol.errors import InternalError
from protocol.messages import TenantConfig, WeightsRef
from protocol.subjects import Names
from protocol.wire import encode

# Applied job ids kept per tenant: ids are time-ordered, far more than ever in flight.
APPLIED_KEEP = 4096
CHECKPOINT_FORMAT = "vla-nexus/slot-checkpoint/1"


def checkpoint_name(tenant: str) -> str:
    return f"{tenant}/checkpoint"


def weights_name(tenant: str, version: int) -> str:
    return f"{tenant}/v{version:08d}"


async def get_object(store, name: str) -> bytes:
    # writeinto avoids nats-py's quadratic bytes concatenation for large objects.
    buf = io.BytesIO()
    await store.get(name, writeinto=buf)
    return buf.getvalue()


@dataclass
class Resident:
    config: TenantConfig
    slot: Any  # models.TenantSlot
    applied: OrderedDict[str, None] = field(default_factory=OrderedDict)
    checkpoint_nuid: str = ""  # of the checkpoint object this state matches
    last_used: float = 0.0


class SlotStore:
    def __init__(self, bus, names: Names, device: str | None = None, max_on_device: int = 16) -> None:
        self.bus = bus
        self.names = names
        self.device = device
        self.max_on_device = max_on_device
        self.bases: dict[str, Any] = {}
        self.resident: dict[str, Resident] = {}
        self._ckpt = None
        self._weights = None

    async def _stores(self):
        if self._ckpt is None:
            self._ckpt = await self.bus.js.object_store(self.names.obj_checkpoints)
            self._weights = await self.bus.js.object_store(self.names.obj_weights)
        return self._ckpt, self._weights

    # -- bases and slots -----------------------------------------------------------------
    async def base(self, source: str):
        base = self.bases.get(source)
        if base is None:
            from models import BaseConfig, BaseModel

            # Loading a base takes seconds: off the event loop, so heartbeats keep flowing.
            base = await asyncio.to_thread(BaseModel.load, BaseConfig(source=source, device=self.device))
            self.bases[source] = base
        return base

    async def slot(self, cfg: TenantConfig) -> Resident:
        """The tenant's slot, created or brought up to its latest checkpoint."""
        ckpt_store, _ = await self._stores()
        res = self.resident.get(cfg.name)
        try:
            info = await ckpt_store.get_info(checkpoint_name(cfg.name))
        except ObjectNotFoundError:
            info = None
        if res is None or (info is not None and info.nuid != res.checkpoint_nuid):
            res = await self._build(cfg)
            if info is not None:
                await self._restore(res, await get_object(ckpt_store, checkpoint_name(cfg.name)), info.nuid)
            self.resident[cfg.name] = res
        res.last_used = time.monotonic()
        base = await self.base(cfg.base)
        if res.slot.device != base.device:
            res.slot.to(base.device)
        return res

    async def _build(self, cfg: TenantConfig) -> Resident:
        from models import OptimConfig, TenantSchema, TenantSlot

        base = await self.base(cfg.base)
        schema = TenantSchema.from_dict(cfg.schema)
        slot = TenantSlot.create(cfg.name, schema, base, head_kind=cfg.head, head_options=cfg.head_params,
                                 optim=OptimConfig(**cfg.optim), seed=cfg.seed)
        return Resident(config=cfg, slot=slot)

    async def _restore(self, res: Resident, blob: bytes, nuid: str) -> None:
        data = unpackb(blob)
        if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
            raise InternalError(f"checkpoint of {res.config.name} has an unknown format")
        await asyncio.to_thread(res.slot.restore, data["slot"])
        res.applied = OrderedDict((j, None) for j in data["applied"])
        res.checkpoint_nuid = nuid

    async def reload(self, tenant: str) -> None:
        """Drop in-memory state (after a failed job): the next `slot()` restores the checkpoint."""
        self.resident.pop(tenant, None)

    def offload_idle(self, keep: set[str]) -> None:
        """Keep at most ``max_on_device`` recently used slots on the accelerator."""
        on_device = [r for r in self.resident.values() if r.slot.device.type != "cpu"]
        if len(on_device) <= self.max_on_device:
            return
        on_device.sort(key=lambda r: r.last_used)
        for res in on_device[: len(on_device) - self.max_on_device]:
            if res.config.name not in keep:
                res.slot.offload()

    # -- commit and export ---------------------------------------------------------------
    async def commit(self, tenant: str) -> str:
        """Write the checkpoint (slot state + applied job ids) atomically; return its nuid."""
        ckpt_store, _ = await self._stores()
        res = self.resident[tenant]
        while len(res.applied) > APPLIED_KEEP:
            res.applied.popitem(last=False)
        slot_bytes = await asyncio.to_thread(res.slot.checkpoint)
        blob = packb({"format": CHECKPOINT_FORMAT, "slot": slot_bytes, "applied": list(res.applied),
                      "step": res.slot.step_count, "version": res.slot.policy_version})
        info = await ckpt_store.put(checkpoint_name(tenant), blob)
        res.checkpoint_nuid = info.nuid
        return info.nuid

    async def export(self, tenant: str, metrics: dict[str, float]) -> WeightsRef:
        """Put the tenant module's params and manifest in the weights bucket; record and announce."""
        _, weights = await self._stores()
        res = self.resident[tenant]
        slot = res.slot
        payload = await asyncio.to_thread(slot.export_params)
        version = slot.policy_version
        manifest = {
            "format": "vla-nexus/adapter-manifest/1",
            "tenant": tenant,
            "base": res.config.base,
            "base_key": slot.key.digest,
            "schema": res.config.schema,
            "schema_signature": res.config.signature,
            "head": res.config.head,
            "head_params": res.config.head_params,
            "version": version,
            "step": slot.step_count,
            "metrics": metrics,
            "exported_at": time.time(),
        }
        name = weights_name(tenant, version)
        await weights.put(name, payload)
        await weights.put(name + ".manifest.json", json.dumps(manifest, sort_keys=True).encode())
        ref = WeightsRef(tenant=tenant, version=version, object_name=name, size=len(payload), manifest=manifest)
        kv = await self.bus.js.key_value(self.names.kv_versions)
        await kv.put(tenant, encode(ref))
        await self.bus.publish(self.names.weights(tenant), ref, span_name=f"announce {tenant} v{version}")
        return ref

    async def load_weights(self, tenant: str, object_name: str) -> dict[str, Any]:
        _, weights = await self._stores()
        payload = await get_object(weights, object_name)
        res = self.resident[tenant]
        return await asyncio.to_thread(res.slot.load_params, payload)

    def memory_report(self) -> dict[str, Any]:
        return {
            name: {"device": str(r.slot.device), "step": r.slot.step_count, "version": r.slot.policy_version,
                   **{f"{k}_bytes": v for k, v in r.slot.memory_bytes().items()}}
            for name, r in self.resident.items()
        }
