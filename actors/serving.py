"""Serving heads of one inferencer: (tenant, version) -> a loaded tenant slot.

    heads = ServingHeads(bus, names, base)
    await heads.sync_all()                  # every live tenant's current version (elastic join)
    slot = await heads.get("acme", -1)      # current version; a pinned version loads on demand
    await heads.on_announce(weights_ref)    # a new version: load, then swap in atomically

A swap replaces the dict entry; a request already holding the old slot finishes on it. The
current version of every tenant and every pinned version in use stay resident; other old
versions are evicted least-recently-used beyond ``max_cached``.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

from nats.js.errors import KeyNotFoundError, NoKeysError, ObjectNotFoundError

from actors.bus import js_retry
from actors.weights import check_manifest, get_manifest, get_object, weights_name
from protocol.errors import FailedPrecondition, NotFound
from protocol.messages import TenantConfig, WeightsRef
from protocol.subjects import Names, check_token, pool_name
from protocol.wire import decode


class ServingHeads:
    def __init__(self, bus, names: Names, base, base_source: str, max_cached: int = 64) -> None:
        self.bus, self.names, self.base, self.base_source = bus, names, base, base_source
        self.max_cached = max_cached
        self.current: dict[str, int] = {}
        self.cache: OrderedDict[tuple[str, int], Any] = OrderedDict()
        self.configs: dict[str, TenantConfig] = {}
        self._loading: dict[tuple[str, int], asyncio.Future] = {}
        # Versions whose manifest names another base or schema: refused, and every request for
        # one hears why (never a silent fall back to another version). Bounded like the cache.
        self.refused: OrderedDict[tuple[str, int], FailedPrecondition] = OrderedDict()
        self.sync_seconds: list[float] = []

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
            try:
                await self._install(ref)
            except FailedPrecondition:
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
        await self._install(ref)
        exported_at = float(ref.manifest.get("exported_at", 0.0))
        lag = time.time() - exported_at if exported_at else None
        if lag is not None:
            self.sync_seconds.append(lag)
        return lag

    async def _install(self, ref: WeightsRef) -> None:
        try:
            slot = await self._load(ref.tenant, ref.version, ref.object_name)
        except FailedPrecondition:
            # The tenant's current version cannot be served here: requests for it must hear
            # why, not get an older version (or the initial weights) instead.
            if ref.version >= self.current.get(ref.tenant, -1):
                self.current[ref.tenant] = ref.version
            raise
        self.cache[(ref.tenant, ref.version)] = slot
        if ref.version >= self.current.get(ref.tenant, -1):
            self.current[ref.tenant] = ref.version  # the swap: one assignment
        self._evict()

    async def get(self, tenant: str, version: int = -1) -> tuple[Any, int]:
        """(slot, version) for a request; version -1 = current (0 = initial weights if none)."""
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
            self.cache[key] = slot
            if version == 0 and tenant not in self.current:
                self.current[tenant] = 0
            self._evict()
        self.cache.move_to_end(key)
        return slot, version

    async def _load(self, tenant: str, version: int, object_name: str) -> Any:
        from models import OptimConfig, TenantSchema, TenantSlot

        cfg = await self.config(tenant)
        slot = await asyncio.to_thread(
            TenantSlot.create, tenant, TenantSchema.from_dict(cfg.schema), self.base, cfg.head,
            cfg.head_params, OptimConfig(**cfg.optim), cfg.seed, None, cfg.base_adapter or None)
        store = await js_retry(self.bus.js.object_store, self.names.obj_weights)
        try:
            payload = await get_object(store, object_name)
        except ObjectNotFoundError:
            if version == 0:
                return slot  # nothing trained yet: the initial weights, same seed as the trainer's
            raise NotFound(f"tenant {tenant!r} has no version {version}",
                           details={"tenant": tenant, "version": version}) from None
        # Never serve a payload exported for another base or schema: its manifest must name
        # this pool's base and the tenant's schema (FailedPrecondition naming both, otherwise).
        # (A missing manifest is refused too, but not remembered: an export may be mid-write.)
        manifest = await get_manifest(store, object_name)
        try:
            check_manifest(manifest, object_name, base=self.base_source, key=slot.key,
                           signature=slot.schema.signature(), adapter=cfg.base_adapter)
        except FailedPrecondition as exc:
            self.refused[(tenant, version)] = exc
            while len(self.refused) > self.max_cached:
                self.refused.popitem(last=False)
            raise
        await asyncio.to_thread(slot.load_params, payload)
        slot.head.eval()  # an adapter has no mode: its dropout runs only in a training step
        return slot

    def forget(self, tenant: str) -> None:
        """The tenant was deleted: its config, current version and cached heads go."""
        self.current.pop(tenant, None)
        self.configs.pop(tenant, None)
        for key in [k for k in self.cache if k[0] == tenant]:
            del self.cache[key]

    def _evict(self) -> None:
        keep = {(t, v) for t, v in self.current.items()}
        while len(self.cache) > self.max_cached:
            for key in self.cache:
                if key not in keep:
                    del self.cache[key]
                    break
            else:
                return
