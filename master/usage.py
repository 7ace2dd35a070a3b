"""The metering half of the master: usage reports in, usage records out, and tenant quotas.

Ops (mixed into `master.service.Master`):

| op | request | reply | what |
|---|---|---|---|
| usage_report | UsageReport | Ok | a trainer / inferencer's batch of usage deltas; applied once per (instance, boot, seq) |
| usage | UsageRequest | UsageReply | cumulative usage per (tenant, workload), and the bytes each tenant stores now |
| tenant_quotas | TenantQuotasRequest | TenantConfig | set (or clear) a tenant's quotas (an operator op) |

Why reports to the master, not each role writing the KV bucket itself: the master is then the
bucket's only writer (no compare-and-set races between N trainers and M inferencers on one
tenant's key), it knows which workload a tenant is running (an inferencer does not: predicts
that name none are charged to the tenant's active workload, and a tenant runs one workload at
a time), and it is where reads go anyway (a tenant gets no JetStream API under auth). A
report is retried unchanged until acknowledged; each record remembers the last report seq of
every instance applied to it, so a retry after a lost reply is not counted twice.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.js.errors import NotFoundError

from transport.bus import js_retry
from actors.runtime import op
from protocol import ops
from protocol.errors import InvalidField
from protocol.messages import (
    Ok,
    TenantConfig,
    TenantQuotas,
    TenantQuotasRequest,
    UsageCounters,
    UsageRecord,
    UsageReply,
    UsageReport,
    UsageRequest,
)
from protocol.policy import (COMPACTED_LABEL, MAX_INFLIGHT_JOBS_PER_TASK, OTHER_LABEL, PRIORITY_MAX, PRIORITY_MIN,
                             SFT_PREFETCH_ITEMS_MAX, STALENESS_BOUND_MAX)
from protocol.subjects import Names, check_token
from protocol.wire import decode, encode
from master.state import MasterState
from master.store import kv_items, store_put

# Instances remembered per usage record (their last report seq): a role instance that
# restarted under a new id no longer retries its old reports, so the oldest can go.
APPLIED_KEEP = 64
ACTIVE_STATES = ("pending", "running")


def _changed_quotas(base: TenantQuotas, changes: dict[str, Any]) -> TenantQuotas:
    """``base`` with ``changes`` applied; an unknown field or a bad value names its field."""
    import msgspec

    known = {f.name for f in msgspec.structs.fields(TenantQuotas)}
    for name in changes:
        if name not in known:
            raise InvalidField(f"changes.{name}", f"not a quota; allowed: {', '.join(sorted(known))}")
    try:
        return msgspec.structs.replace(base, **changes)
    except TypeError as exc:
        raise InvalidField("changes", str(exc)) from None


class UsageOps:
    """The master's part for usage and quotas: ``usage_report``, ``usage``, ``tenant_quotas``,
    and the quota checks the other parts call."""

    def __init__(self, st: MasterState) -> None:
        self.st = st
        self.usage: dict[str, UsageRecord] = {}

    async def setup_usage(self) -> None:
        self._usage_lock = asyncio.Lock()
        self.kv_usage = await js_retry(self.st.bus.js.key_value, self.st.names.kv_usage)
        self.usage = {}
        for key, value in await kv_items(self.kv_usage):
            self.usage[key] = decode(value, UsageRecord)

    # -- quotas --------------------------------------------------------------------------
    def quotas(self, cfg: TenantConfig) -> TenantQuotas:
        return cfg.quotas or self.st.default_quotas

    def check_priority(self, priority: int, cfg: TenantConfig, field: str = "priority") -> None:
        """Priority within PRIORITY_MIN..the tenant's max_priority quota (its tier's bound)."""
        top = min(PRIORITY_MAX, self.quotas(cfg).max_priority)
        if not PRIORITY_MIN <= priority <= top:
            raise InvalidField(field, f"{priority} is outside {PRIORITY_MIN}..{top} (tenant {cfg.name!r}: "
                                      f"quota max_priority={self.quotas(cfg).max_priority})",
                               details={"quota": "max_priority", "limit": top})

    def check_schedule(self, cfg: TenantConfig, bound_by: TenantConfig, prefix: str) -> None:
        """A tenant's own scheduling fields within what the operator gives: priority in
        PRIORITY_MIN..its max_priority quota, max_inflight_jobs up to its max_inflight_jobs
        quota (and MAX_INFLIGHT_JOBS_PER_TASK), sft_prefetch_items and staleness_bound up to
        their documented bounds. ``bound_by``: whose quotas hold (the stored tenant's when it
        exists: a request never brings its own); ``prefix``: ``config`` or ``schedule``."""
        self.check_priority(cfg.priority, bound_by, f"{prefix}.priority")
        quota = self.quotas(bound_by).max_inflight_jobs
        ceilings = {"max_inflight_jobs": (min(MAX_INFLIGHT_JOBS_PER_TASK, quota),
                                          f"tenant {bound_by.name!r}: quota max_inflight_jobs={quota}"),
                    "sft_prefetch_items": (SFT_PREFETCH_ITEMS_MAX, "SFT_PREFETCH_ITEMS_MAX"),
                    "staleness_bound": (STALENESS_BOUND_MAX, "STALENESS_BOUND_MAX")}
        for name, (top, why) in ceilings.items():
            value = getattr(cfg, name)
            if not (isinstance(value, int) and 1 <= value <= top):
                raise InvalidField(f"{prefix}.{name}", f"{value!r} is outside 1..{top} ({why}; the operator "
                                                      "sets quotas with `nexus tenant quotas`)",
                                   details={"limit": top})

    @op(ops.MASTER_TENANT_QUOTAS)
    async def tenant_quotas(self, req: TenantQuotasRequest) -> TenantConfig:
        async with self.st.lock:
            cfg = self.st.tenant(req.tenant)
            quotas = _changed_quotas(self.quotas(cfg), req.changes) if req.changes else req.quotas
            if quotas is not None and quotas.max_priority > PRIORITY_MAX:
                raise InvalidField("quotas.max_priority", f"{quotas.max_priority}: at most {PRIORITY_MAX}")
            cfg.quotas = quotas
            await store_put(self.st.kv_tenants, cfg.name, encode(cfg))
        # Inferencers cache tenant configs (the predict rate is read from them): drop it.
        await self.st.bus.publish(self.st.names.tenant_updated(cfg.name), cfg)
        self.st.log.info("tenant quotas set", tenant=cfg.name, quotas=str(cfg.quotas or "defaults"))
        return cfg

    # -- usage ---------------------------------------------------------------------------
    def active_workload(self, tenant: str) -> str:
        """The workload a tenant runs now ("" if none): it runs one at a time."""
        for rec in self.st.workloads.values():
            if rec.tenant == tenant and rec.state in ACTIVE_STATES:
                return rec.workload
        return ""

    @op(ops.MASTER_USAGE_REPORT)
    async def usage_report(self, req: UsageReport) -> Ok:
        check_token("instance", req.instance)
        writer = f"{req.instance}.{check_token('boot', req.boot)}" if req.boot else req.instance
        if req.seq < 1:
            raise InvalidField("seq", f"{req.seq}: reports are numbered from 1")
        # Entries that land on one record are summed first: the record's applied seq then
        # covers all of them at once.
        merged: dict[str, tuple[str, str, UsageCounters]] = {}
        labels: dict[str, set[str]] = {}  # tenant -> its labels (computed once per report)
        for e in req.entries:
            workload = e.workload or self.active_workload(e.tenant)
            try:
                key = Names.usage_key(e.tenant, workload)
                if self._is_label(e.tenant, workload) and key not in self.usage and key not in merged:
                    # A new label: past the tenant's bound it is charged to `other` (docs/usage.md).
                    known = labels.get(e.tenant)
                    if known is None:
                        known = labels[e.tenant] = {r.workload for r in self.usage.values()
                                                    if r.tenant == e.tenant and self._is_label(r.tenant, r.workload)}
                    if len(known) >= self.st.retention.usage_labels_max:
                        workload, key = OTHER_LABEL, Names.usage_key(e.tenant, OTHER_LABEL)
                    else:
                        known.add(workload)
            except InvalidField as exc:
                # One bad name must not block the rest of the report (it would be resent forever).
                self.st.log.error("usage entry with a bad name dropped", instance=req.instance, error=exc.message)
                continue
            _, _, counters = merged.setdefault(key, (e.tenant, workload, UsageCounters()))
            counters.add(e.usage)
        applied = 0
        async with self._usage_lock:
            for key, (tenant, workload, counters) in merged.items():
                rec = self.usage.get(key) or UsageRecord(tenant=tenant, workload=workload, usage=UsageCounters())
                if rec.applied.get(writer, 0) >= req.seq:
                    continue  # a resent report: this record has it already
                rec.usage.add(counters)
                rec.applied.pop(writer, None)
                rec.applied[writer] = req.seq  # most recent last
                while len(rec.applied) > APPLIED_KEEP:
                    rec.applied.pop(next(iter(rec.applied)))
                rec.updated_at = time.time()
                await store_put(self.kv_usage, key, encode(rec))
                self.usage[key] = rec
                applied += 1
        return Ok(detail=f"report {req.seq} of {req.instance}: {applied} of {len(merged)} records updated")

    def _is_label(self, tenant: str, workload: str) -> bool:
        """A usage key a client chose (a predict's workload) rather than one of the tenant's
        workloads or the master's own labels: the ones `usage_labels_max` bounds."""
        if not workload or workload in (COMPACTED_LABEL, OTHER_LABEL):
            return False
        rec = self.st.workloads.get(workload)
        return rec is None or rec.tenant != tenant

    async def compact_usage(self, now: float, workloads: list[tuple[str, str]]) -> int:
        """Fold usage records into their tenant's `COMPACTED_LABEL` record: those of the
        (tenant, workload)s given (their workload records are being compacted) and those of
        labels not written to for the retention. Per-tenant totals stay what they were."""
        gone = {Names.usage_key(t, w) for t, w in workloads}
        folded = 0
        async with self._usage_lock:
            keys = [k for k, r in self.usage.items() if r.workload != COMPACTED_LABEL and (
                k in gone or (self._is_label(r.tenant, r.workload) or r.workload in ("_", OTHER_LABEL))
                and now - r.updated_at > self.st.retention.records_s)]
            by_tenant: dict[str, list[str]] = {}
            for k in keys:
                by_tenant.setdefault(self.usage[k].tenant, []).append(k)
            for tenant, ks in by_tenant.items():
                target_key = Names.usage_key(tenant, COMPACTED_LABEL)
                target = self.usage.get(target_key) or UsageRecord(tenant=tenant, workload=COMPACTED_LABEL,
                                                                   usage=UsageCounters())
                for k in ks:
                    target.usage.add(self.usage[k].usage)
                target.updated_at = now
                # The total first, then the parts: a master dying in between over-counts once,
                # never loses usage.
                await store_put(self.kv_usage, target_key, encode(target))
                self.usage[target_key] = target
                for k in ks:
                    await js_retry(self.kv_usage.purge, k)
                    del self.usage[k]
                    folded += 1
        return folded

    async def delete_usage(self, tenant: str) -> int:
        """Every usage record of a deleted tenant, from KV and memory."""
        n = 0
        async with self._usage_lock:
            for k in [k for k, r in self.usage.items() if r.tenant == tenant]:
                await js_retry(self.kv_usage.purge, k)
                del self.usage[k]
                n += 1
        return n

    def usage_records(self, tenant: str = "", workload: str = "") -> list[UsageRecord]:
        return sorted((r for r in self.usage.values()
                       if (not tenant or r.tenant == tenant) and (not workload or r.workload == workload)),
                      key=lambda r: (r.tenant, r.workload))

    def workload_usage(self, workload: str) -> dict[str, Any]:
        """The usage charged to one workload so far (for its report)."""
        import msgspec

        total = UsageCounters()
        for r in self.usage_records(workload=workload):
            total.add(r.usage)
        return msgspec.structs.asdict(total)

    @op(ops.MASTER_USAGE)
    async def usage_op(self, req: UsageRequest) -> UsageReply:
        if req.tenant:
            check_token("tenant", req.tenant)
        from master.paging import name_key, page

        records, cursor = page(((name_key(r.tenant, r.workload), r) for r in self.usage_records(req.tenant, req.workload)),
                               req.limit, req.cursor, self.st.bus.max_payload, lambda r: len(encode(r)) + 32)
        tenants = {r.tenant for r in records} | ({req.tenant} if req.tenant else set())
        return UsageReply(records=records, stored_now=await self.stored_bytes(tenants), next_cursor=cursor)

    async def stored_bytes(self, tenants: set[str]) -> dict[str, int]:
        """Bytes each tenant's objects (checkpoints, exported versions) hold now."""
        out = {t: 0 for t in tenants}
        if not tenants:
            return out
        for bucket in (self.st.names.obj_weights, self.st.names.obj_checkpoints):
            store = await js_retry(self.st.bus.js.object_store, bucket)
            try:
                infos = await store.list(ignore_deletes=True)
            except NotFoundError:
                continue
            for info in infos:
                tenant = info.name.partition("/")[0]
                if tenant in out:
                    out[tenant] += int(info.size or 0)
        return out
