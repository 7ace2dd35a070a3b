"""Serving heads of one inferencer: (tenant, version) -> a loaded tenant slot.

    heads = ServingHeads(bus, names, base)
    await heads.sync_all()                  # every live tenant's current version (elastic join)
    slot = await heads.get("acme", -1)      # current version; a pinned version loads on demand
    await heads.on_announce(weights_ref)    # a new version: load, then swap in atomically

A swap replaces the dict entry; a request already holding the old slot finishes on it. The
current version of every tenant and every pinned version in use stay resident; other old
versions are evicted least-recently-used beyond ``max_cached``.

Memory: with ``budget_bytes`` (NEXUS_INFER_HEAD_BUDGET_MB) the least recently used heads, current
versions too, are dropped once the loaded ones hold more; the next request for one loads it
again from the weights store (`get`, the same path as a pinned version). A head held by a
request (``get(..., hold=True)`` until `release`: from admission to its reply, through its
group's forward) is never dropped. A head larger than the whole budget is refused
(`CapacityExceeded` naming the setting), like a version whose manifest does not match.

Weight sync (export -> servable, issue 27 item 5): a new version needs a slot built for the
tenant's config (a head's init runs on the CPU: the largest stage on a 4B base), its payload and
manifest (fetched together), and the load. Without a budget, the next version's slot is built
in the background right after a swap (one spare per tenant, at most ``max_cached`` spares, never
served before its load), so
an announcement pays fetch + load only. `sync_stages` keeps each stage's recent seconds (bounded)
for `info` and the benchmarks: ``transport`` (export -> announcement handled here: the trainer's
puts, the publish, this process's queue), ``create``, ``fetch``, ``load``, ``total``.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from typing import Any

from nats.js.errors import KeyNotFoundError, NoKeysError, ObjectNotFoundError

from actors.budget import lru_victims, mib
from transport.bus import js_retry
from transport.weights import check_manifest, get_manifest, get_object, weights_name
from protocol.errors import CapacityExceeded, FailedPrecondition, NotFound
from protocol.messages import TenantConfig, WeightsRef
from protocol.subjects import Names, check_token, pool_name
from protocol.wire import decode

# Why a (tenant, version) is never served here; remembered, and every request for it hears it.
REFUSALS = (FailedPrecondition, CapacityExceeded)
# Recent weight syncs kept per stage (for `info` percentiles): a bound, not a window.
SYNC_KEPT = 1024
SYNC_STAGES = ("transport", "create", "fetch", "load", "total")
# Evicted (tenant, version)s remembered to count their reloads (a few MB at most).
EVICTED_KEPT = 65536


def head_bytes(slot: Any) -> int:
    """What a serving head holds: its params and buffers (and its adapter's); no optimizer state."""
    m = slot.memory_bytes()
    return m["params"] + m["buffers"]


class ServingHeads:
    def __init__(self, bus, names: Names, base, base_source: str, max_cached: int = 64, budget_bytes: int = 0,
                 log: Any = None) -> None:
        self.bus, self.names, self.base, self.base_source = bus, names, base, base_source
        self.max_cached = max_cached
        self.budget_bytes = budget_bytes  # 0: no budget
        self.log = log
        self.sizes: dict[tuple[str, int], int] = {}  # `head_bytes` of each cached head
        self._loaded = 0  # their sum (checked at every reply: kept, not summed)
        self._holds: dict[tuple[str, int], int] = {}  # requests holding a head (`get(hold=True)`)
        # Dropped under the budget and not loaded again yet (to count reloads); bounded.
        self._evicted: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.evictions = 0
        self.reloads = 0
        self.current: dict[str, int] = {}
        self.cache: OrderedDict[tuple[str, int], Any] = OrderedDict()
        self.configs: dict[str, TenantConfig] = {}
        self._loading: dict[tuple[str, int], asyncio.Future] = {}
        # Versions whose manifest names another base or schema: refused, and every request for
        # one hears why (never a silent fall back to another version). Bounded like the cache.
        self.refused: OrderedDict[tuple[str, int], FailedPrecondition | CapacityExceeded] = OrderedDict()
        self.sync_seconds: deque[float] = deque(maxlen=SYNC_KEPT)  # export -> servable, per version
        self.sync_stages: dict[str, deque[float]] = {k: deque(maxlen=SYNC_KEPT) for k in SYNC_STAGES}
        # tenant -> (the config it was built for, a slot not yet loaded): the next version's
        # slot, built in the background after a swap (only without a budget: it is not counted).
        self._spares: dict[str, tuple[TenantConfig, Any]] = {}
        self._spare_tasks: dict[str, asyncio.Task] = {}
        self.spares_used = 0

    async def _kv(self, bucket: str):
        return await js_retry(self.bus.js.key_value, bucket)

    async def config(self, tenant: str) -> TenantConfig:
        cfg = self.configs.get(tenant)
        if cfg is None:
            kv = await self._kv(self.names.kv_tenants)
            try:
                cfg = decode((await kv.get(tenant)).value, TenantConfig)
            except KeyNotFoundError:
                raise NotFound(f"unknown tenant {tenant!r}", details={"tenant": tenant}) from None
            if pool_name(cfg.base) != pool_name(self.base_source):
                raise NotFound(f"tenant {tenant!r} uses base {cfg.base!r}; this pool serves {self.base_source!r}")
            self.configs[tenant] = cfg
        return cfg

    async def sync_all(self) -> int:
        """Load the current version of every tenant of this pool; return how many."""
        kv = await self._kv(self.names.kv_versions)
        try:
            keys = await kv.keys()
        except NoKeysError:
            keys = []
        n = 0
        for tenant in keys:
            ref = decode((await kv.get(tenant)).value, WeightsRef)
            try:
                await self.config(tenant)
            except NotFound:
                continue  # another pool's tenant
            if self.budget_bytes and self.loaded_bytes() >= self.budget_bytes:
                # The budget is full: the rest load at their first request (or announcement).
                self.current[tenant] = max(ref.version, self.current.get(tenant, -1))
                continue
            try:
                await self._install(ref)
            except REFUSALS:
                continue  # refused (see `refused`); its requests get the reason, the others go on
            n += 1
        return n

    async def on_announce(self, ref: WeightsRef) -> float | None:
        """A trainer exported a version: make it servable. Returns export -> servable seconds."""
        try:
            await self.config(ref.tenant)
        except NotFound:
            return None
        if ref.version <= self.current.get(ref.tenant, -1):
            return None
        exported_at = float(ref.manifest.get("exported_at", 0.0))
        stages: dict[str, float] = {}
        if exported_at:
            stages["transport"] = time.time() - exported_at
        await self._install(ref, stages)
        lag = time.time() - exported_at if exported_at else None
        if lag is not None:
            self.sync_seconds.append(lag)
            stages["total"] = lag
            for k, v in stages.items():
                self.sync_stages[k].append(v)
        self._make_spare(ref.tenant)
        return lag

    def sync_report(self) -> dict[str, dict[str, float]]:
        """Per stage: syncs seen (up to SYNC_KEPT recent), p50 and p95 seconds."""
        out = {}
        for k, xs in self.sync_stages.items():
            if xs:
                v = sorted(xs)
                out[k] = {"n": len(v), "p50": v[len(v) // 2], "p95": v[min(len(v) - 1, int(0.95 * len(v)))]}
        return out

    def _make_spare(self, tenant: str) -> None:
        """Build the tenant's next slot off the sync's path (no budget only; one per tenant)."""
        cfg = self.configs.get(tenant)
        if cfg is None or self.budget_bytes or tenant in self._spares or tenant in self._spare_tasks:
            return
        if len(self._spares) + len(self._spare_tasks) >= self.max_cached:
            return  # bounded like the cache: past it, a sync builds its own slot

        async def build() -> None:
            try:
                slot = await asyncio.to_thread(self._new_slot, tenant, cfg)
                if self.configs.get(tenant) is cfg:  # not deleted or changed meanwhile
                    self._spares[tenant] = (cfg, slot)
            except Exception as exc:  # a spare is an optimisation: the sync builds its own
                self._log("warning", "spare slot not built", tenant=tenant, error=str(exc))
            finally:
                self._spare_tasks.pop(tenant, None)

        self._spare_tasks[tenant] = asyncio.ensure_future(build())

    def _new_slot(self, tenant: str, cfg: TenantConfig) -> Any:
        from models import OptimConfig, TenantSchema, TenantSlot

        return TenantSlot.create(tenant, TenantSchema.from_dict(cfg.schema), self.base, cfg.head, cfg.head_params,
                                 OptimConfig(**cfg.optim), cfg.seed, None, cfg.base_adapter or None)

    async def _install(self, ref: WeightsRef, stages: dict[str, float] | None = None) -> None:
        try:
            slot = await self._load(ref.tenant, ref.version, ref.object_name, stages)
        except REFUSALS:
            # The tenant's current version cannot be served here: requests for it must hear
            # why, not get an older version (or the initial weights) instead.
            if ref.version >= self.current.get(ref.tenant, -1):
                self.current[ref.tenant] = ref.version
            raise
        self._put((ref.tenant, ref.version), slot)
        if ref.version >= self.current.get(ref.tenant, -1):
            self.current[ref.tenant] = ref.version  # the swap: one assignment
        self._evict(keep={(ref.tenant, ref.version)})

    async def get(self, tenant: str, version: int = -1, hold: bool = False) -> tuple[Any, int]:
        """(slot, version) for a request; version -1 = current (0 = initial weights if none).
        ``hold``: the head is not dropped under the budget until `release` (tenant, version)."""
        check_token("tenant", tenant)  # a KV key: '*' or '.' would fail there as a server error
        await self.config(tenant)
        if version < 0:
            version = self.current.get(tenant, 0)
        key = (tenant, version)
        refused = self.refused.get(key)
        if refused is not None:
            raise refused
        slot = self.cache.get(key)
        if slot is None:
            pending = self._loading.get(key)
            if pending is None:
                pending = asyncio.ensure_future(self._load(tenant, version, weights_name(tenant, version)))
                self._loading[key] = pending
                pending.add_done_callback(lambda _f: self._loading.pop(key, None))
            slot = await asyncio.shield(pending)
            if key in self._evicted:
                del self._evicted[key]
                self.reloads += 1
                self._log("info", "head reloaded", tenant=tenant, version=version, bytes=head_bytes(slot))
            self._put(key, slot)
            if version == 0 and tenant not in self.current:
                self.current[tenant] = 0
            self._evict(keep={key})
        self.cache.move_to_end(key)
        if hold:
            self._holds[key] = self._holds.get(key, 0) + 1
        return slot, version

    def release(self, tenant: str, version: int) -> None:
        """A request that held (tenant, version) is answered: the head may go again."""
        key = (tenant, version)
        n = self._holds.get(key, 0) - 1
        if n > 0:
            self._holds[key] = n
            return
        self._holds.pop(key, None)
        self._evict()  # what was over the budget while held

    def loaded_bytes(self) -> int:
        return self._loaded

    def _put(self, key: tuple[str, int], slot: Any) -> None:
        self.cache[key] = slot
        self.cache.move_to_end(key)
        size = head_bytes(slot)
        self._loaded += size - self.sizes.get(key, 0)
        self.sizes[key] = size

    async def _load(self, tenant: str, version: int, object_name: str,
                    stages: dict[str, float] | None = None) -> Any:
        stages = {} if stages is None else stages
        cfg = await self.config(tenant)
        t0 = time.perf_counter()
        spare = self._spares.pop(tenant, None)
        if spare is not None and spare[0] is cfg:
            slot = spare[1]  # built for this very config, never loaded or served
            self.spares_used += 1
        else:
            slot = await asyncio.to_thread(self._new_slot, tenant, cfg)
        stages["create"] = time.perf_counter() - t0
        store = await js_retry(self.bus.js.object_store, self.names.obj_weights)
        t0 = time.perf_counter()
        # Payload and manifest together: one round trip's wait, not two.
        got = await asyncio.gather(get_object(store, object_name), get_manifest(store, object_name),
                                   return_exceptions=True)
        stages["fetch"] = time.perf_counter() - t0
        payload, manifest = got
        if isinstance(payload, ObjectNotFoundError):
            if version == 0:
                self._check_fits(tenant, version, cfg, slot)
                return slot  # nothing trained yet: the initial weights, same seed as the trainer's
            raise NotFound(f"tenant {tenant!r} has no version {version}",
                           details={"tenant": tenant, "version": version}) from None
        if isinstance(payload, BaseException):
            raise payload
        # Never serve a payload exported for another base or schema: its manifest must name
        # this pool's base and the tenant's schema (FailedPrecondition naming both, otherwise).
        # (A missing manifest is refused too, but not remembered: an export may be mid-write.)
        if isinstance(manifest, BaseException):
            raise manifest
        try:
            check_manifest(manifest, object_name, base=self.base_source, key=slot.key,
                           signature=slot.schema.signature(), adapter=cfg.base_adapter)
        except FailedPrecondition as exc:
            self._refuse(tenant, version, exc)
            raise
        t0 = time.perf_counter()
        await asyncio.to_thread(slot.load_params, payload)
        stages["load"] = time.perf_counter() - t0
        slot.head.eval()  # an adapter has no mode: its dropout runs only in a training step
        self._check_fits(tenant, version, cfg, slot)
        return slot

    def _check_fits(self, tenant: str, version: int, cfg: TenantConfig, slot: Any) -> None:
        need = head_bytes(slot)
        if self.budget_bytes and need > self.budget_bytes:
            exc = CapacityExceeded.of(
                "head_budget_mb", self.budget_bytes / 2**20, "NEXUS_INFER_HEAD_BUDGET_MB",
                f"tenant {tenant!r}'s serving head (version {version}, head {cfg.head!r}) needs {mib(need)}, more than "
                f"this inferencer's whole head budget of {mib(self.budget_bytes)}; set it to at least "
                f"{-(-need // 2**20)}", tenant=tenant, version=version, head_bytes=need)
            self._refuse(tenant, version, exc)
            raise exc

    def _refuse(self, tenant: str, version: int, exc: FailedPrecondition | CapacityExceeded) -> None:
        self.refused[(tenant, version)] = exc
        while len(self.refused) > self.max_cached:
            self.refused.popitem(last=False)

    def forget(self, tenant: str) -> None:
        """The tenant was deleted: its config, current version and cached heads go."""
        self.current.pop(tenant, None)
        self.configs.pop(tenant, None)
        self._spares.pop(tenant, None)
        for key in [k for k in self.cache if k[0] == tenant]:
            self._drop(key)
        for key in [k for k in self._evicted if k[0] == tenant]:
            del self._evicted[key]

    def _drop(self, key: tuple[str, int]) -> int:
        del self.cache[key]
        size = self.sizes.pop(key, 0)
        self._loaded -= size
        return size

    def _evict(self, keep: set[tuple[str, int]] | frozenset[tuple[str, int]] = frozenset()) -> None:
        # Called at every reply (`release`): nothing is built unless the cache is over a bound.
        current = {(t, v) for t, v in self.current.items()} if len(self.cache) > self.max_cached else set()
        while len(self.cache) > self.max_cached:
            for key in self.cache:
                if key not in current and key not in keep:
                    self._drop(key)
                    break
            else:
                break
        if not self.budget_bytes or self._loaded <= self.budget_bytes:
            return
        # The budget: least recently used first (the cache's order), current versions too,
        # never one a request holds or the one just asked for.
        entries = ((key, self.sizes.get(key, 0), i, key not in keep and key not in self._holds)
                   for i, key in enumerate(self.cache))
        for key in lru_victims(entries, self.budget_bytes):
            size = self._drop(key)
            self._evicted[key] = None
            while len(self._evicted) > EVICTED_KEPT:
                self._evicted.popitem(last=False)
            self.evictions += 1
            self._log("info", "head evicted under the memory budget", tenant=key[0], version=key[1], bytes=size,
                      budget_bytes=self.budget_bytes)

    def budget_report(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "loaded_bytes": self.loaded_bytes(), "loaded": len(self.cache),
                "evictions": self.evictions, "reloads": self.reloads, "held": sum(self._holds.values())}

    def _log(self, level: str, event: str, **fields: Any) -> None:
        if self.log is not None:
            getattr(self.log, level)(event, **fields)
