"""The master's tenant part: ``tenant_create``, ``tenant_get``, ``tenant_show``,
``tenant_reset``, ``tenant_delete`` and ``list`` (table in `master.service`), and the
capacity checks a new tenant or workload passes."""

from __future__ import annotations

import asyncio
import time

from nats.js.errors import NotFoundError, ObjectNotFoundError

from transport.bus import js_retry

from transport.layout import ensure_tq_stream
from actors.identity import current_caller, require_tenant
from actors.runtime import op
from master.records import policy_pin_tenant
from master.store import kv_keys, store_put
from master.tenant_checks import base_fit_errors, check_config, schema_signature
from master.tenant_files import remove_tenant_files
from master.reports import report_file
from master.state import MasterState
from master.usage import UsageOps
from master.bases import BaseOps
from protocol import ops
from protocol.errors import (Busy, CapacityExceeded, Conflict, FailedPrecondition, InvalidField, NotFound)
from protocol.messages import (
    TERMINAL_JOB_STATES,
    CreateTenantRequest,
    GetTenantRequest,
    ListReply,
    ListRequest,
    TenantConfig,
    TenantDeleted,
    TenantDeleteRequest,
    TenantResetRequest,
    TenantShow,
)
from protocol.subjects import check_token
from protocol.wire import encode



class TenantOps:
    """Tenant slots: created, shown, reset and deleted. Quotas and schedules are checked
    through ``usage_ops``, base names resolved through ``base_ops``."""

    def __init__(self, st: MasterState, *, base_ops: BaseOps, usage_ops: UsageOps) -> None:
        self.st, self.base_ops, self.usage_ops = st, base_ops, usage_ops

    # -- tenants -------------------------------------------------------------------------
    @op(ops.MASTER_TENANT_CREATE)
    async def tenant_create(self, req: CreateTenantRequest) -> TenantConfig:
        cfg = req.config
        check_token("config.name", cfg.name)
        require_tenant(cfg.name, "tenant_create")
        # A tenant names a preset or a registered base, never a host path (master/bases.py).
        cfg.base = await self.base_ops.resolve_base(cfg.base, "config.base")
        by_operator = current_caller().is_platform
        if not by_operator and cfg.quotas is not None:
            # docs/security.md: quotas, priority ceilings and in-flight caps are the operator's.
            raise InvalidField("config.quotas", "quotas are set by the operator (`nexus tenant quotas`), never in "
                                                "a tenant's own request; leave it unset (null)")
        cfg.signature = schema_signature(cfg.schema)
        check_config(cfg)
        # Bounded by the stored tenant's quotas when it exists (a tenant's re-create brings
        # none), else by the request's (the platform's own, or the defaults).
        existing = self.st.sched.tenants.get(cfg.name)
        if not by_operator and existing is not None:
            cfg.quotas = existing.quotas
        self.usage_ops.check_schedule(cfg, existing or cfg, "config")
        if cfg.base_adapter or cfg.head == "expert":
            # Off the loop: the first check imports transformers (seconds) to read the base's layers.
            errors = await asyncio.to_thread(base_fit_errors, cfg, "head_params")
            if errors:
                raise InvalidField(f"config.{errors[0][0]}", errors[0][1])
        async with self.st.lock:
            existing = self.st.sched.tenants.get(cfg.name)
            if existing is not None:
                if not by_operator:
                    cfg.quotas = existing.quotas  # the operator's, kept (and compared) as they are
                cfg.created_at = existing.created_at
                if req.exist_ok and encode(existing) == encode(cfg):
                    return existing
                raise Conflict(f"tenant {cfg.name!r} already exists", details={"tenant": cfg.name})
            self.check_tenant_capacity()
            cfg.created_at = time.time()
            await self._ensure_queue_stream(cfg.name)
            await store_put(self.st.kv_tenants, cfg.name, encode(cfg))
            self.st.sched.tenants[cfg.name] = cfg
        self.st.log.info("tenant created", tenant=cfg.name, signature=cfg.signature, head=cfg.head)
        return cfg

    def check_tenant_capacity(self) -> None:
        """A new tenant past NEXUS_MAX_TENANTS is refused before anything of it exists."""
        if len(self.st.sched.tenants) >= self.st.max_tenants:
            raise CapacityExceeded.of("max_tenants", self.st.max_tenants, "NEXUS_MAX_TENANTS",
                                      f"{len(self.st.sched.tenants)} tenants are registered (or delete one)",
                                      tenants=len(self.st.sched.tenants))

    def check_workload_capacity(self) -> None:
        """A new workload past NEXUS_MAX_ACTIVE_WORKLOADS (pending + running) is refused at submit."""
        active = sum(1 for w in self.st.workloads.values() if w.state in ("pending", "running"))
        if active >= self.st.max_active_workloads:
            raise CapacityExceeded.of("max_active_workloads", self.st.max_active_workloads, "NEXUS_MAX_ACTIVE_WORKLOADS",
                                      f"{active} workloads are pending or running (or wait for one to end)",
                                      active=active)

    async def _ensure_queue_stream(self, tenant: str) -> None:
        assert self.st.bus is not None
        # Replicas, byte limit and dedup window come from the deployment (transport/layout.py).
        await ensure_tq_stream(self.st.bus.js, self.st.names, tenant, self.st.deployment)

    @op(ops.MASTER_TENANT_DELETE)
    async def tenant_delete(self, req: TenantDeleteRequest) -> TenantDeleted:
        """Remove everything of a tenant; trainers and inferencers drop it on the announcement."""
        assert self.st.bus is not None
        self.st.tenant(req.tenant)
        active = [w.workload for w in self.st.workloads.values()
                  if w.tenant == req.tenant and w.state in ("pending", "running")]
        if active:
            raise FailedPrecondition(f"tenant {req.tenant!r} has workload {active[0]} {self.st.workloads[active[0]].state}; "
                                     "cancel it first", details={"tenant": req.tenant, "workload": active[0]})
        self._check_no_held_jobs(req.tenant)
        removed = {"jobs": 0, "workloads": 0, "objects": 0}
        reports = []  # the report files of its workloads, found before their records go
        for rec in [w for w in self.st.workloads.values() if w.tenant == req.tenant]:
            try:
                reports.append(report_file(self.st.cfg.data_dir, rec))
            except ValueError:  # a path that leaves the data dir was never written
                pass
        async with self.st.lock:
            self.st.tenant(req.tenant)  # again under the lock: a concurrent delete got here first
            await self._drop_slot_records(req.tenant, removed)
            for workload in [w.workload for w in self.st.workloads.values() if w.tenant == req.tenant]:
                del self.st.workloads[workload]
                self.st.unsaved.pop(workload, None)
                await self.st.kv_workloads.purge(workload)
                removed["workloads"] += 1
        removed["usage"] = await self.usage_ops.delete_usage(req.tenant)
        removed.update(await asyncio.to_thread(remove_tenant_files, self.st.cfg.data_dir, req.tenant, reports))
        await self._drop_slot_storage(req.tenant, removed)
        event = TenantDeleted(tenant=req.tenant, at=time.time(), removed=removed)
        await self.st.bus.publish(self.st.names.tenant_deleted(req.tenant), event)
        self.st.log.info("tenant deleted", tenant=req.tenant, **removed)
        return event

    @op(ops.MASTER_TENANT_RESET)
    async def tenant_reset(self, req: TenantResetRequest) -> TenantDeleted:
        """Drop a tenant's slot (config, versions, checkpoints, job records, queue stream) so
        its next submit registers a new schema. Its account and credentials (the CLI's), its
        workload records, reports and usage stay. Access ``tenant``: a tenant resets itself
        only (an empty name is the caller's); the operator names any. Refused, changing
        nothing, while a workload of the tenant (or one scoring its policy) is pending or
        running, or a trainer still holds one of its jobs."""
        assert self.st.bus is not None
        if not req.tenant:
            raise InvalidField("tenant", "name the tenant to reset (a tenant's own credentials reset their own)")
        tenant = check_token("tenant", req.tenant)
        known = tenant in self.st.sched.tenants or any(w.tenant == tenant for w in self.st.workloads.values())
        if not known:
            raise NotFound(f"unknown tenant {tenant!r}: nothing to reset", details={"tenant": tenant})
        removed = {"jobs": 0, "objects": 0}
        async with self.st.lock:  # checked under the lock: a submit cannot slip in between
            self._check_no_active(tenant)
            self._check_no_held_jobs(tenant)
            removed["slot"] = int(tenant in self.st.sched.tenants)
            await self._drop_slot_records(tenant, removed)
        await self._drop_slot_storage(tenant, removed)
        event = TenantDeleted(tenant=tenant, at=time.time(), removed=removed, reset=True)
        # Trainers and inferencers drop the slot and heads they hold, as for a delete.
        await self.st.bus.publish(self.st.names.tenant_deleted(tenant), event)
        self.st.log.info("tenant reset", tenant=tenant, **removed)
        return event

    def _check_no_active(self, tenant: str) -> None:
        """FailedPrecondition naming every pending / running workload that trains ``tenant``'s
        slot or scores its policy (an eval of another tenant's may pin it)."""
        active = [w for w in self.st.workloads.values() if w.state in ("pending", "running")
                  and (w.tenant == tenant or policy_pin_tenant(w) == tenant)]
        if active:
            ids = ", ".join(f"{w.workload} ({w.state})" for w in active)
            raise FailedPrecondition(
                f"tenant {tenant!r} cannot be reset while its workloads run: {ids}; wait for them to end, or "
                f"cancel them (`nexus cancel {active[0].workload}`), then reset",
                details={"tenant": tenant, "workloads": [w.workload for w in active]})

    def _check_no_held_jobs(self, tenant: str) -> None:
        held = [j.job for j in self.st.sched.jobs.values()
                if j.tenant == tenant and j.lease_owner and j.state not in TERMINAL_JOB_STATES]
        if held:
            # A trainer is still on it (a cancel makes it drop the job at its next renewal):
            # dropping the slot under it would leave the checkpoint it is about to write.
            raise Busy(f"tenant {tenant!r} has {len(held)} job(s) still held by a trainer; retry in a moment",
                       details={"tenant": tenant, "jobs": held, "retry_after_s": 1.0})

    async def _drop_slot_records(self, tenant: str, removed: dict[str, int]) -> None:
        """Under the lock: the tenant's job records, versions, checkpoint pointer and config,
        from memory and KV (delete and reset)."""
        for key in [k for k in self.st.sched.jobs if k[0] == tenant]:
            self.st.sched.remove(*key)
            await self.st.kv_jobs.purge(f"{key[0]}.{key[1]}")
            removed["jobs"] += 1
        self.st.keys = {k: v for k, v in self.st.keys.items() if k[0] != tenant}
        for d in (self.st.sched.versions, self.st.sched.dropped_stale, self.st.ckpt_refs):
            d.pop(tenant, None)
        self.st.sched.tenants.pop(tenant, None)
        for kv in (self.st.kv_tenants, self.st.kv_versions, self.st.kv_ckpt):
            try:
                await kv.purge(tenant)
            except NotFoundError:
                pass

    async def _drop_slot_storage(self, tenant: str, removed: dict[str, int]) -> None:
        """The tenant's training-queue stream and its objects (exported versions,
        checkpoints): ``<tenant>/...`` in the weights and checkpoints buckets."""
        assert self.st.bus is not None
        try:
            await self.st.bus.js.delete_stream(self.st.names.tq_stream(tenant))
        except NotFoundError:
            pass
        for bucket in (self.st.names.obj_weights, self.st.names.obj_checkpoints):
            store = await js_retry(self.st.bus.js.object_store, bucket)
            try:
                infos = await store.list(ignore_deletes=True)
            except NotFoundError:
                infos = []
            for info in infos:
                if info.name.startswith(f"{tenant}/"):
                    try:
                        await store.delete(info.name)
                        removed["objects"] += 1
                    except ObjectNotFoundError:
                        pass

    @op(ops.MASTER_TENANT_SHOW)
    async def tenant_show(self, req: GetTenantRequest) -> TenantShow:
        """One tenant as its owner sees it: config (schema, head, base), newest version,
        quotas in force, workload ids. Access ``tenant``: a tenant sees itself (an empty name
        is the caller's); the operator names any."""
        if not req.tenant:
            raise InvalidField("tenant", "name the tenant to show")
        tenant = check_token("tenant", req.tenant)
        cfg = self.st.sched.tenants.get(tenant)
        history = [w.workload for w in sorted(self.st.workloads.values(), key=lambda w: w.created_at)
                   if w.tenant == tenant]
        if cfg is None and not history:
            raise NotFound(f"unknown tenant {tenant!r} (no slot and no workloads: submit an sft or rl spec to "
                           "register it)", details={"tenant": tenant})
        quotas = self.usage_ops.quotas(cfg) if cfg is not None else self.st.default_quotas
        return TenantShow(tenant=tenant, config=cfg, version=max(0, self.st.sched.versions.get(tenant, 0)),
                          quotas=quotas, quotas_default=cfg is None or cfg.quotas is None, workloads=history)

    @op(ops.MASTER_TENANT_GET)
    async def tenant_get(self, req: GetTenantRequest) -> TenantConfig:
        return self.st.tenant(req.tenant)

    @op(ops.MASTER_LIST)
    async def list(self, req: ListRequest) -> ListReply:
        """Tenant names (at most NEXUS_MAX_TENANTS) and one page of workload ids (KV's keys)."""
        from master.paging import page

        ids, cursor = page(((k, k) for k in await kv_keys(self.st.kv_workloads)), req.limit, req.cursor,
                           self.st.bus.max_payload, lambda k: len(k) + 4)
        return ListReply(tenants=sorted(self.st.sched.tenants), workloads=ids, next_cursor=cursor)
