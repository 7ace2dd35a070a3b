"""Tenant slots of one trainer: resident bases, slots, checkpoints and exports.

    store = SlotStore(bus, names, device=None)
    slot = await store.slot(tenant_config)        # resident, restored from its checkpoint
    await store.commit(tenant, applied_job_ids)   # checkpoint = the commit point of a job
    ref = await store.export(tenant, metrics)     # payload + manifest, announced
    store.enforce_budget(keep)                    # idle slots past the memory budget dropped

A checkpoint is one immutable object ``<tenant>/ckpt/<name>`` in the checkpoints bucket:
msgpack of the slot's own checkpoint bytes (head, AdamW moments, counters, RNG) together with
the ids of the jobs already applied, so "this job's step is applied" and "the state after it"
can never be written apart. Which object is the tenant's committed state is the master's
checkpoint pointer (`CheckpointRef`, moved by compare-and-set when the master accepts the
job's ``trained`` report under a live lease epoch): a trainer that lost its lease writes an
object nobody points at, and can never overwrite a newer checkpoint (docs/reliability.md).

Memory: beyond ``max_on_device`` the least recently used slots move to host memory
(`offload_idle`); beyond ``budget_bytes`` (NEXUS_TRAINER_SLOT_BUDGET_MB) the least recently
used idle slots whose state is committed are dropped (`enforce_budget`): their committed
checkpoint is already in the object store, and `slot()` restores it at the tenant's next job,
exactly (head, adapter, AdamW moments, counters, RNG). A slot in use (a job leased, preparing,
running or finishing here; an op between steps) or holding state not yet committed is never
dropped. A slot larger than the whole budget is refused (`CapacityExceeded` naming the setting).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from nats.js.errors import ObjectNotFoundError

from actors.budget import lru_victims, mib
from actors.trainer.torch_thread import TorchThread
from transport.bus import js_retry, retry_through_outage
from transport.weights import (MANIFEST_FORMAT, base_identity, check_manifest, get_manifest, get_object,
                             manifest_name, weights_name)
from protocol import ops
from protocol.codec import packb, unpackb
from protocol.errors import CapacityExceeded, InternalError, InvalidField, NotFound
from protocol.messages import CheckpointGetRequest, CheckpointRef, TenantConfig, WeightsRef
from protocol.subjects import Names
from protocol.wire import encode

# Applied job ids kept per tenant: ids are time-ordered, far more than ever in flight.
APPLIED_KEEP = 4096
CHECKPOINT_FORMAT = "vla-nexus/slot-checkpoint/1"


def checkpoint_name(tenant: str, tag: str) -> str:
    """A new, never reused checkpoint object name (``tag``: job id and lease epoch)."""
    return f"{tenant}/ckpt/{tag}"


@dataclass
class Resident:
    config: TenantConfig
    slot: Any  # models.TenantSlot
    applied: OrderedDict[str, None] = field(default_factory=OrderedDict)
    checkpoint_name: str = ""  # the committed checkpoint object this state was built on
    last_used: float = 0.0
    # (step, version) of the committed state this slot holds: another (step, version) is
    # training not yet committed, and such a slot is never dropped from memory.
    clean: tuple[int, int] | None = None
    footprint: int = 0  # `slot_footprint`, fixed once built
    # `TenantSlot.memory_bytes` as of the slot's last torch work, measured on the torch thread
    # (`measure`) and only read elsewhere: `info` answered on the event loop once read each
    # param's `.grad` while a step set it, and torch's Python-object bookkeeping is not safe
    # against that (an INTERNAL ASSERT in pyobject_preservation, then heap corruption and the
    # trainer's SIGSEGV / "corrupted unsorted chunks" seen in long runs: docs/results.md).
    memory: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.footprint = slot_footprint(self.slot)
        self.measure()

    def measure(self) -> None:
        """Refresh ``memory``; on the torch thread only (the slot's tensors are that thread's)."""
        self.memory = self.slot.memory_bytes()

    @property
    def committed_state(self) -> bool:
        return self.clean == (self.slot.step_count, self.slot.policy_version)


def slot_footprint(slot: Any) -> int:
    """Bytes the slot holds once it trained: trainable params, their grads and two AdamW
    moments, plus buffers. A slot not trained yet holds no grads or moments: counted as if it
    did, so the budget never admits what its first step would push over. (From the params
    alone: never reading the optimizer's state, which a training thread may be filling.) A head
    that can hold a KL anchor (a frozen copy of its policy, taken at the first step of a workload
    with algorithm.kl_coef > 0) counts it likewise, taken or not: the trainer cannot know at
    build time whether a workload will ask for one."""
    params = sum(p.numel() * p.element_size() for _, p in slot.named_trainable())
    buffers = sum(b.numel() * b.element_size() for b in slot.head.buffers())  # a held anchor's among them
    anchor = 0 if slot.anchor_version >= 0 else slot.head.anchor_bytes()
    return 4 * params + buffers + anchor


def fast_engine_applies(source: str, device: str | None) -> bool:
    """The fast engine (models.fast) serves Qwen3-VL bases, and the trainer uses it on CUDA only:
    its CUDA graphs are what make it fast (on CPU the plain forward is the reference). A forward
    that routes LoRA rows takes the plain path inside the base either way (models.base.encode)."""
    import torch

    from models.families import MODEL_TYPE_TO_FAMILY
    from models.presets import PRESETS, get_preset

    on_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if not on_cuda:
        return False
    if source in PRESETS:
        return get_preset(source).family == "qwen3_vl"
    config = Path(source) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    return MODEL_TYPE_TO_FAMILY.get(model_type) == "qwen3_vl"


class SlotStore:
    def __init__(self, bus, names: Names, device: str | None = None, max_on_device: int = 16,
                 fast: bool = False, compile: bool = False, image_size: int | None = None, budget_bytes: int = 0,
                 in_use: Callable[[str], bool] | None = None, log: Any = None,
                 torch_thread: TorchThread | None = None) -> None:
        self.bus = bus
        # Every torch call of this store runs on the trainer's one torch thread (torch_thread.py).
        self.torch = torch_thread or TorchThread(log=log)
        self.names = names
        self.device = device
        self.fast = fast
        self.compile = compile
        self.image_size = image_size  # the base's canonical resolution; None: its own
        self.max_on_device = max_on_device
        # Slot memory (0: none). ``in_use(tenant)``: the trainer's loop holds a job of it.
        self.budget_bytes = budget_bytes
        self.in_use = in_use or (lambda _tenant: False)
        self.log = log
        self._pins: dict[str, int] = {}  # tenants an op works on between steps (`pinned`)
        self._evicted: set[str] = set()  # dropped under the budget, not back yet
        self.evictions = 0
        self.restores = 0
        self.evicted_bytes = 0
        self.over_budget = False  # over it with nothing idle to drop (logged once per episode)
        self.bases: dict[str, Any] = {}
        self.resident: dict[str, Resident] = {}
        self._ckpt = None
        self._weights = None
        # Jobs are prepared concurrently: two tenants of a base not loaded yet must get one copy.
        self._base_lock = asyncio.Lock()

    async def _stores(self):
        if self._ckpt is None:
            # Binding a store asks its stream for info: it times out while a killed node's
            # streams elect a leader (a fresh trainer's first job right after a node loss).
            self._ckpt = await js_retry(self.bus.js.object_store, self.names.obj_checkpoints)
            self._weights = await js_retry(self.bus.js.object_store, self.names.obj_weights)
        return self._ckpt, self._weights

    # -- bases and slots -----------------------------------------------------------------
    async def base(self, source: str):
        base = self.bases.get(source)
        if base is not None:
            return base
        async with self._base_lock:
            base = self.bases.get(source)
            if base is None:
                from models import BaseConfig, BaseModel

                fast = self.fast and fast_engine_applies(source, self.device)
                cfg = BaseConfig(source=source, device=self.device, fast=fast, compile=fast and self.compile,
                                 image_size=self.image_size)
                # Loading a base takes seconds: off the event loop, so heartbeats keep flowing.
                base = await self.torch.run(BaseModel.load, cfg)
                self.bases[source] = base
        return base

    async def committed(self, tenant: str) -> CheckpointRef:
        """The master's checkpoint pointer for ``tenant`` (authoritative; rides out a restart)."""
        return await retry_through_outage(self.bus.call, ops.MASTER_CHECKPOINT_GET,
                                          CheckpointGetRequest(tenant=tenant), timeout_s=10)

    async def slot(self, cfg: TenantConfig) -> Resident:
        """The tenant's slot, created or brought up to its committed checkpoint."""
        ckpt_store, _ = await self._stores()
        res = self.resident.get(cfg.name)
        ref = await self.committed(cfg.name)
        # Rebuilt when the committed state moved or the tenant's config changed (a later
        # workload's optimizer settings): the checkpoint's moments carry over either way.
        if res is None or ref.object_name != res.checkpoint_name or encode(res.config) != encode(cfg):
            res = await self._build(cfg)
            self._check_fits(res)
            if ref.object_name:
                await self._restore(res, await get_object(ckpt_store, ref.object_name), ref.object_name)
            else:
                await self._start(res)
            res.clean = (res.slot.step_count, res.slot.policy_version)
            self.resident[cfg.name] = res
            if cfg.name in self._evicted:
                self._evicted.discard(cfg.name)
                self.restores += 1
                self._log("info", "slot restored from its checkpoint", tenant=cfg.name, checkpoint=ref.object_name,
                          step=res.slot.step_count, version=res.slot.policy_version)
        res.last_used = time.monotonic()
        base = await self.base(cfg.base)
        if res.slot.device != base.device:
            await self.torch.run(res.slot.to, base.device)
        self.enforce_budget(keep={cfg.name})
        return res

    def _check_fits(self, res: Resident) -> None:
        """A slot larger than the whole budget could never be resident with it: its job is
        refused (nothing of it stays; every other slot is untouched)."""
        need = res.footprint
        if self.budget_bytes and need > self.budget_bytes:
            budget_mb = self.budget_bytes / 2**20
            raise CapacityExceeded.of(
                "slot_budget_mb", budget_mb, "NEXUS_TRAINER_SLOT_BUDGET_MB",
                f"tenant {res.config.name!r}'s slot needs {mib(need)} (head {res.config.head!r}, adapter, gradients "
                f"and AdamW moments), more than this trainer's whole slot budget of {mib(self.budget_bytes)}; set it "
                f"to at least {-(-need // 2**20)}", tenant=res.config.name, slot_bytes=need)

    async def _build(self, cfg: TenantConfig) -> Resident:
        from models import OptimConfig, TenantSchema, TenantSlot

        base = await self.base(cfg.base)
        schema = TenantSchema.from_dict(cfg.schema)
        slot = await self.torch.run(TenantSlot.create, cfg.name, schema, base, head_kind=cfg.head,
                                    head_options=cfg.head_params, optim=OptimConfig(**cfg.optim), seed=cfg.seed,
                                    adapter=cfg.base_adapter or None)
        # Built on the torch thread: Resident measures the slot's tensors.
        return await self.torch.run(lambda: Resident(config=cfg, slot=slot))

    async def _start(self, res: Resident) -> None:
        """No checkpoint yet: a tenant that started from uploaded weights (`start_from`) has them
        as its version 0 export, which every trainer starts from (as every inferencer serves it);
        without one the slot keeps its seeded initialisation."""
        _, weights = await self._stores()
        name = weights_name(res.config.name, 0)
        try:
            payload = await get_object(weights, name)
        except ObjectNotFoundError:
            return
        check_manifest(await get_manifest(weights, name), name, base=res.config.base, key=res.slot.key,
                       signature=res.slot.schema.signature(), adapter=res.config.base_adapter)
        await self.torch.run(res.slot.load_params, payload)

    async def start_from(self, cfg: TenantConfig, weights_object: str, adapter_object: str = "") -> WeightsRef:
        """A new tenant's slot from the objects it uploaded (master/uploads.py): built from
        ``cfg``, every tensor checked against it (InvalidField naming each misfit tensor and both
        shapes), then exported as the tenant's version 0. Nothing is kept resident here: the
        tenant's first job builds its slot again from that export (`_start`)."""
        from models.errors import CheckpointError
        from safetensors import SafetensorError
        from safetensors.torch import load as st_load

        _, weights = await self._stores()
        res = await self._build(cfg)
        tensors: dict[str, Any] = {}
        for what, obj in (("init.weights", weights_object), ("init.adapter", adapter_object)):
            if not obj:
                continue
            try:
                part = st_load(await get_object(weights, obj))
            except ObjectNotFoundError:
                raise NotFound(f"{what}: upload {obj!r} is gone", details={"field": what}) from None
            except SafetensorError as exc:
                raise InvalidField(what, f"not a safetensors file: {exc}") from None
            both = sorted(set(part) & set(tensors))
            if both:
                raise InvalidField(what, f"tensor {both[0]!r} is in init.weights too: give each tensor once")
            tensors.update(part)
        where = "init" if adapter_object else "init.weights"
        try:
            await self.torch.run(lambda: (res.slot.load_start(tensors), res.measure()))
        except CheckpointError as exc:
            raise InvalidField(where, f"the upload does not fit tenant {cfg.name!r}'s spec: {exc}") from None
        return await self._export_resident(res, {})

    async def _restore(self, res: Resident, blob: bytes, name: str) -> None:
        data = unpackb(blob)
        if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
            raise InternalError(f"checkpoint of {res.config.name} has an unknown format")
        await self.torch.run(lambda: (res.slot.restore(data["slot"]), res.measure()))
        res.applied = OrderedDict((j, None) for j in data["applied"])
        res.checkpoint_name = name

    async def reload(self, tenant: str) -> None:
        """Drop in-memory state (after a failed job): the next `slot()` restores the checkpoint."""
        self.resident.pop(tenant, None)

    def forget(self, tenant: str) -> None:
        """The tenant was deleted: nothing of it stays."""
        self.resident.pop(tenant, None)
        self._evicted.discard(tenant)

    @contextlib.contextmanager
    def pinned(self, tenant: str) -> Iterator[None]:
        """``tenant``'s slot is not dropped inside the block (an op between steps uses it)."""
        self._pins[tenant] = self._pins.get(tenant, 0) + 1
        try:
            yield
        finally:
            self._pins[tenant] -= 1
            if not self._pins[tenant]:
                del self._pins[tenant]

    def resident_bytes(self) -> int:
        return sum(r.footprint for r in self.resident.values())

    def enforce_budget(self, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Drop the least recently used idle, committed slots until the rest fit the budget;
        return the tenants dropped. Never one in ``keep``, in use, pinned, or holding training
        not committed yet."""
        if not self.budget_bytes:
            return []
        sizes = {name: r.footprint for name, r in self.resident.items()}
        victims = lru_victims(((name, sizes[name], r.last_used, self._evictable(name, r, keep))
                               for name, r in self.resident.items()), self.budget_bytes)
        for name in victims:
            del self.resident[name]
            self._evicted.add(name)
            self.evictions += 1
            self.evicted_bytes += sizes[name]
            self._log("info", "slot evicted under the memory budget", tenant=name, bytes=sizes[name],
                      budget_bytes=self.budget_bytes)
        left = sum(sizes.values()) - sum(sizes[n] for n in victims)
        if left > self.budget_bytes and not self.over_budget:
            # What is over is in use: it goes once its jobs finish (`enforce_budget` runs again).
            self._log("warning", "slots in use exceed the memory budget", resident_bytes=left,
                      budget_bytes=self.budget_bytes, slots=len(self.resident))
        self.over_budget = left > self.budget_bytes
        return victims

    def _evictable(self, name: str, res: Resident, keep: set[str] | frozenset[str]) -> bool:
        return (name not in keep and name not in self._pins and not self.in_use(name)
                and res.committed_state)

    def _log(self, level: str, event: str, **fields: Any) -> None:
        if self.log is not None:
            getattr(self.log, level)(event, **fields)

    def offload_idle(self, keep: set[str]) -> None:
        """Keep at most ``max_on_device`` recently used slots on the accelerator."""
        on_device = [r for r in self.resident.values() if r.slot.device.type != "cpu"]
        if len(on_device) <= self.max_on_device:
            return
        on_device.sort(key=lambda r: r.last_used)
        for res in on_device[: len(on_device) - self.max_on_device]:
            if res.config.name not in keep:
                self.torch.submit(res.slot.offload)  # ordered before the next step's torch work

    # -- commit and export ---------------------------------------------------------------
    async def write_checkpoint(self, tenant: str, tag: str) -> str:
        """Write the slot's state (+ applied job ids) as a new checkpoint object; return its
        name. Nothing points at it until the master accepts the commit."""
        ckpt_store, _ = await self._stores()
        res = self.resident[tenant]
        while len(res.applied) > APPLIED_KEEP:
            res.applied.popitem(last=False)
        slot_bytes = await self.torch.run(res.slot.checkpoint)
        blob = packb({"format": CHECKPOINT_FORMAT, "slot": slot_bytes, "applied": list(res.applied),
                      "step": res.slot.step_count, "version": res.slot.policy_version})
        name = checkpoint_name(tenant, tag)
        await js_retry(ckpt_store.put, name, blob)
        return name

    async def committed_as(self, tenant: str, name: str) -> None:
        """The master accepted ``name``: it is the slot's base now; the old object goes."""
        res = self.resident.get(tenant)
        if res is None:
            return
        old, res.checkpoint_name = res.checkpoint_name, name
        # The tenant has no job training here while its commit runs: this is the state written.
        res.clean = (res.slot.step_count, res.slot.policy_version)
        if old and old != name:
            await self.delete_checkpoint(old)

    async def delete_checkpoint(self, name: str) -> None:
        """Best effort: an uncommitted or superseded checkpoint object."""
        ckpt_store, _ = await self._stores()
        try:
            await ckpt_store.delete(name)
        except ObjectNotFoundError:
            pass

    async def export(self, tenant: str, metrics: dict[str, float]) -> WeightsRef:
        """Put the tenant module's params and manifest in the weights bucket; record and announce."""
        return await self._export_resident(self.resident[tenant], metrics)

    async def _export_resident(self, res: Resident, metrics: dict[str, float]) -> WeightsRef:
        _, weights = await self._stores()
        tenant = res.config.name
        slot = res.slot
        payload = await self.torch.run(slot.export_params)
        version = slot.policy_version
        manifest = {
            "format": MANIFEST_FORMAT,
            "tenant": tenant,
            "base": res.config.base,
            "base_key": slot.key.digest,
            "base_identity": base_identity(slot.key),
            "schema": res.config.schema,
            "schema_signature": res.config.signature,
            "head": res.config.head,
            "head_params": res.config.head_params,
            # LoRA on the base ({}: frozen base). The payload then also holds the adapter under
            # peft's tensor names, and peft_config is its adapter_config.json (docs/lora.md).
            "base_adapter": res.config.base_adapter,
            "peft_config": slot.adapter.peft_config(slot.base_id) if slot.adapter is not None else None,
            "version": version,
            "step": slot.step_count,
            "metrics": metrics,
            "exported_at": time.time(),
        }
        name = weights_name(tenant, version)
        # Both objects at once (the announcement below follows both): the sync's transport stage.
        await asyncio.gather(js_retry(weights.put, name, payload),
                             js_retry(weights.put, manifest_name(name), json.dumps(manifest, sort_keys=True).encode()))
        ref = WeightsRef(tenant=tenant, version=version, object_name=name, size=len(payload), manifest=manifest)
        kv = await js_retry(self.bus.js.key_value, self.names.kv_versions)
        await js_retry(kv.put, tenant, encode(ref))
        await self.bus.publish(self.names.weights(tenant), ref, span_name="job.announce")
        return ref

    async def load_weights(self, tenant: str, object_name: str) -> dict[str, Any]:
        """Load an exported payload into the tenant's slot, after its manifest proves it was
        exported for this base and this tenant's schema (FailedPrecondition otherwise)."""
        _, weights = await self._stores()
        res = self.resident[tenant]
        payload = await get_object(weights, object_name)
        check_manifest(await get_manifest(weights, object_name), object_name, base=res.config.base,
                       key=res.slot.key, signature=res.slot.schema.signature(), adapter=res.config.base_adapter)
        return await self.torch.run(res.slot.load_params, payload)

    def budget_report(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "resident_bytes": self.resident_bytes(),
                "resident": len(self.resident), "evictions": self.evictions, "restores": self.restores,
                "evicted_bytes": self.evicted_bytes, "evicted_now": len(self._evicted),
                "over_budget": self.over_budget}

    def memory_report(self) -> dict[str, Any]:
        return {
            name: {"device": str(r.slot.device), "step": r.slot.step_count, "version": r.slot.policy_version,
                   **{f"{k}_bytes": v for k, v in r.memory.items()}}  # the torch thread's last measure
            for name, r in self.resident.items()
        }
