"""Master: tenant registry, training-queue control plane and scheduler.

Serves ``<prefix>.master.<op>``:

| op | request | reply | what |
|---|---|---|---|
| tenant_create | CreateTenantRequest | TenantConfig | validate, derive the schema signature, store in KV, create the tenant's queue stream |
| tenant_get | GetTenantRequest | TenantConfig | |
| tenant_show | GetTenantRequest | TenantShow | a tenant's own view: config, newest version, quotas in force, workload ids (a tenant: itself only) |
| tenant_reset | TenantResetRequest | TenantDeleted | drop the slot (config, versions, checkpoints, jobs, queue), keep account, workload records, usage; refused while a workload of it runs (a tenant: itself only) |
| tenant_delete | TenantDeleteRequest | TenantDeleted | the operator removes everything of a tenant (refused while a workload of it runs) |
| list | ListRequest | ListReply | tenant and workload names |
| reserve | ReserveRequest | JobRecord | new job id (caps: in-flight per tenant-task, SFT prefetch) |
| queue_put | QueuePutRequest | QueuePutReply | validate one micro-batch against the schema, append to the job's partition |
| mark_ready | JobRef | JobRecord | the job may be leased |
| lease | LeaseRequest | LeaseReply | the scheduler hands ready jobs to a trainer |
| job_update | JobUpdate | JobRecord | a trainer reports trained / exported / synced / cleared / failed; fenced by the lease epoch; ``trained`` moves the tenant's checkpoint pointer (compare-and-set) |
| lease_renew | LeaseRenewRequest | LeaseRenewReply | a training trainer extends its leases; lost ones are named |
| lease_release | LeaseReleaseRequest | Ok | a draining trainer hands its jobs back |
| checkpoint_get, checkpoint_commit | CheckpointGetRequest, CheckpointCommitRequest | CheckpointRef | the tenant's committed checkpoint; move it outside a job (load_weights) |
| job, jobs | JobRef, JobsRequest | JobRecord, JobsReply | records |
| queue_get | QueueGetRequest | QueueGetReply | read a job's micro-batches back |
| queue_clear | JobRef | JobRecord | purge a job's partition |
| rollout_begin, rollout_end | JobRef | Ok | the rollout gate: 1 active per tenant, 3 in all; a freed turn goes by fair share by priority (`master.fairshare.GateLine`) (a tenant: its own running workloads) |
| hosted_claim, hosted_event | HostedClaimRequest, HostedEventRequest | HostedClaimReply, Ok | a tenant's hosted env processes: lease, claim, events (see `master/hosted.py`) |
| submit, workload, workloads, tenants, cancel | see `master/workloads.py` | | workload specs in, lifecycle out |
| usage_report, usage, tenant_quotas | see `master/usage.py` | | metered usage in and out; a tenant's quotas |

The master is the only writer of job records: its in-memory scheduler is authoritative and
every change is written through to the jobs KV, from which a restarted master rebuilds. Run
one master per deployment.

Run: ``python -m actors.run master --nats-url nats://127.0.0.1:4222``
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from typing import Any

from opentelemetry.trace import SpanKind
from nats.js.errors import NotFoundError, ObjectNotFoundError

from transport.bus import js_retry

from transport.layout import ensure_tq_stream, publish_tq, read_deployment_settings
from actors.identity import current_caller, require_tenant
from actors.runtime import Role, RoleConfig, op
from actors.tracing import carrier, hop_name, messaging, nexus_attrs
from actors.tq_read import PartitionReader
from master.fairshare import GateLine, clamp_priority
from master.scheduler import Scheduler
from master.bases import BaseOps
from master.hosted import HostedOps
from master.records import is_hosted_worker, policy_pin_tenant
from master.store import kv_keys, kv_values, store_put
from master.tenant_checks import base_fit_errors, check_config, schema_signature
from master.usage import UsageOps
from master.uploads import UploadOps
from master.tenant_files import remove_tenant_files
from master.workloads import WorkloadOps, report_file
from master.validate import validate_put
from protocol import ops
from protocol.errors import Unavailable
from protocol.errors import (Busy, CapacityExceeded, Conflict, FailedPrecondition, InvalidField, NexusError, NotFound,
                             QuotaExceeded)
from protocol.messages import (
    WeightsChunk,
    WeightsReadRequest,
    TERMINAL_JOB_STATES,
    starts_step,
    TERMINAL_WORKLOAD_STATES,
    CheckpointCommitRequest,
    CheckpointGetRequest,
    CheckpointRef,
    InfoRequest,
    LeaseReleaseRequest,
    LeaseRenewReply,
    LeaseRenewRequest,
    CreateTenantRequest,
    GetTenantRequest,
    HealthEvent,
    JobRecord,
    JobRef,
    JobsReply,
    JobsRequest,
    JobUpdate,
    LeaseReply,
    LeaseRequest,
    ListReply,
    Ok,
    ListRequest,
    QueueGetReply,
    QueueGetRequest,
    QueuePutReply,
    QueuePutRequest,
    ReserveRequest,
    TenantConfig,
    TenantDeleted,
    TenantDeleteRequest,
    TenantResetRequest,
    TenantShow,
    WeightsRef,
)
from protocol.policy import OWNER_CHECK_EVERY_S
from protocol.settings import MasterSettings, default_quotas, leases_from_env, retention_from_env
from protocol.subjects import check_token
from protocol.wire import decode, encode

# Trainer-reported transitions a job may take (besides repeating its current state).
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "leased": ("trained", "failed"),
    "trained": ("exported", "failed"),
    "exported": ("synced",),
    "synced": ("cleared",),
}
EXPIRE_EVERY_S = 1.0
# Tenants in one heartbeat's gauges (about 30 bytes per tenant and signal: 256 keep a beat
# near 40 KB, far under NATS's 1 MB payload); the rest ride as "other".
BEAT_TENANTS_MAX = 256
# Rollout gate: 1 active rollout per tenant, NEXUS_MAX_ACTIVE_ROLLOUTS across the deployment;
# a slot not released within the TTL (its workflow died) is reclaimed.
ROLLOUT_TTL_S = 600.0
# Whole objects `weights_read` keeps between slices (a payload and its manifest, twice over).
WEIGHTS_READ_CACHE = 4


# Lease decisions whose duration `info` summarises (the latest ones).
LEASE_TIMES_KEPT = 4096


def decision_summary(durations_s: Any) -> dict[str, float]:
    """n, p50, p99 and max (ms) of the scheduler's recent lease decisions."""
    ms = sorted(d * 1000.0 for d in durations_s)
    if not ms:
        return {"n": 0}
    p50, p99 = (ms[min(len(ms) - 1, int(q * len(ms)))] for q in (0.50, 0.99))
    return {"n": len(ms), "p50": p50, "p99": p99, "max": ms[-1]}


def new_job_id() -> str:
    # Time-ordered (FIFO by id) and unique across master restarts.
    return f"j{int(time.time() * 1000):013d}{uuid.uuid4().hex[:6]}"


class Master(WorkloadOps, HostedOps, UsageOps, BaseOps, UploadOps, Role):
    name = "master"

    def __init__(self, cfg: RoleConfig) -> None:
        super().__init__(cfg)
        self.sched = Scheduler()
        self._read_cache: dict[str, bytes] = {}  # object name -> bytes, oldest first (weights_read)
        self._lock = asyncio.Lock()  # one job-state change at a time: records stay consistent
        self.rollouts: dict[str, float] = {}  # "<tenant>/<workload>" -> expiry (unix s)
        self.gate_line = GateLine()  # who takes a free turn when turns are short (by priority)
        self.leases = leases_from_env()
        self.retention = retention_from_env()
        settings = MasterSettings.from_env()
        self.max_active_rollouts = settings.max_active_rollouts
        self.max_tenants, self.max_active_workloads = settings.max_tenants, settings.max_active_workloads
        self.hosted_wait_s, self.hosted_lease_s = settings.hosted_wait_s, settings.hosted_lease_s  # master/hosted.py
        self.hosted: dict[str, dict[str, float]] = {}  # hosted env processes' leases (master/hosted.py)
        self.default_quotas = default_quotas()  # a tenant's quotas when the operator set none
        self.partitions: PartitionReader | None = None  # queue_get's reader (remembers item sequences)
        # How long the decisions and the start-up took (`info`: bench/scale.py reads them).
        self.lease_decision_s: deque[float] = deque(maxlen=LEASE_TIMES_KEPT)
        self.startup_s: dict[str, float] = {}
        self._starting: set[str] = set()  # workloads whose workflow start is under way (workloads.py)

    async def setup(self) -> None:
        assert self.bus is not None
        # Validating a tenant needs the model core (torch): import it now, off the event
        # loop. Imported on the first submit instead, it blocked heartbeats for seconds on a
        # loaded host, and the health manager restarted a live master.
        await asyncio.to_thread(_import_model_core)
        js = self.bus.js
        self.partitions = PartitionReader(self.bus, self.names)
        self.kv_tenants = await js_retry(js.key_value, self.names.kv_tenants)
        self.kv_workloads = await js_retry(js.key_value, self.names.kv_workloads)
        self.kv_jobs = await js_retry(js.key_value, self.names.kv_jobs)
        self.kv_versions = await js_retry(js.key_value, self.names.kv_versions)
        self.kv_ckpt = await js_retry(js.key_value, self.names.kv_ckpt_refs)
        self.ckpt_refs: dict[str, CheckpointRef] = {}
        self._keys: dict[tuple[str, str], str] = {}  # (tenant, idempotency key) -> job id
        self.deployment = await read_deployment_settings(js, self.names)
        started = time.perf_counter()
        await self._load_state()
        self.startup_s["load_state"] = time.perf_counter() - started
        await self.bus.nc.subscribe(self.names.health_events_all, cb=self._on_health_event)
        await self.bus.nc.subscribe(self.names.weights_all, cb=self._on_weights)
        self.spawn(self._expire_loop, "lease-expiry", critical=True, max_quiet_s=30.0)
        self.spawn(self._compact_loop, "compaction", critical=True)
        self.spawn(self._owner_check_loop, "owner-check", critical=True)
        await self.setup_usage()
        await self.setup_bases()
        started = time.perf_counter()
        await self.setup_workloads()
        self.setup_hosted()
        self.startup_s["load_workloads"] = time.perf_counter() - started
        await self._release_dead_owners()

    def info_extra(self) -> dict[str, Any]:
        states: dict[str, int] = {}
        for j in self.sched.jobs.values():
            states[j.state] = states.get(j.state, 0) + 1
        return {"tenants": len(self.sched.tenants), "jobs": states,
                "dropped_stale": dict(self.sched.dropped_stale),
                "scale": {"lease_decision_ms": decision_summary(self.lease_decision_s),
                          "startup_s": dict(self.startup_s), "job_records": len(self.sched.jobs),
                          "live_jobs": len(self.sched.live_jobs()),
                          "workloads": len(self.workloads)}}

    def heartbeat_gauges(self) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """The monitor's control signals per tenant (docs/observability.md): queued jobs (and of
        them the ready ones), jobs on a trainer, how stale the oldest ready rollout is, stale
        drops, active rollouts, rollouts waiting for a turn of the gate, and the priority that
        routes the tenant's gate turns (the scaler weighs its backlog by it, docs/scaling.md).
        At most `BEAT_TENANTS_MAX` tenants, busiest first (then by name); the rest are folded into
        ``other`` (summed; staleness: the max; priority: the min), so a beat stays small with any
        tenant count."""
        gauges, _ = super().heartbeat_gauges()
        rows: dict[str, dict[str, float]] = {
            t: {"queue_depth": 0.0, "ready_jobs": 0.0, "jobs_in_flight": 0.0, "staleness_versions": 0.0,
                "dropped_stale": float(self.sched.dropped_stale.get(t, 0)), "active_rollouts": 0.0,
                "waiting_rollouts": 0.0, "priority": self._routing_priority(t)}
            for t in set(self.sched.tenants) | set(self.sched.dropped_stale)}
        for j in self.sched.live_jobs():
            row = rows.get(j.tenant)
            if row is None:
                continue
            if j.state in ("reserved", "filling", "ready"):
                row["queue_depth"] += 1
                row["ready_jobs"] += j.state == "ready"
                if j.state == "ready" and j.task == "rl" and j.behaviour_version >= 0:
                    lag = self.sched.versions.get(j.tenant, 0) - j.behaviour_version
                    row["staleness_versions"] = max(row["staleness_versions"], float(lag))
            elif j.state in ("leased", "trained", "exported", "synced"):
                row["jobs_in_flight"] += 1
        now = time.time()
        for key, expiry in self.rollouts.items():
            row = rows.get(key.split("/", 1)[0])
            if expiry > now and row is not None:
                row["active_rollouts"] += 1
        for tenant, n in self.gate_line.waiting_by_tenant(now).items():
            if tenant in rows:
                rows[tenant]["waiting_rollouts"] = float(n)
        order = sorted(rows, key=lambda t: (-(rows[t]["queue_depth"] + rows[t]["jobs_in_flight"]
                                              + rows[t]["active_rollouts"] + rows[t]["waiting_rollouts"]), t))
        per_tenant: dict[str, dict[str, float]] = {name: {} for name in next(iter(rows.values()), {})}
        for i, tenant in enumerate(order):
            label = tenant if i < BEAT_TENANTS_MAX else "other"
            for name, value in rows[tenant].items():
                have = per_tenant[name].get(label)
                per_tenant[name][label] = value if have is None else (
                    max(have, value) if name == "staleness_versions" else
                    min(have, value) if name == "priority" else have + value)
        return gauges, per_tenant

    def _routing_priority(self, tenant: str) -> float:
        """The tenant's priority as the rollout gate routes it (its spec's, within its
        ``max_priority`` quota); a tenant gone from the table (stale drops only): the default."""
        cfg = self.sched.tenants.get(tenant)
        return float(clamp_priority(cfg.priority, self.quotas(cfg).max_priority)) if cfg is not None else 0.0

    # -- state ---------------------------------------------------------------------------
    async def _load_state(self) -> None:
        for value in await kv_values(self.kv_tenants):
            cfg = decode(value, TenantConfig)
            self.sched.tenants[cfg.name] = cfg
        for value in await kv_values(self.kv_jobs):
            self.sched.put(decode(value, JobRecord))
        for value in await kv_values(self.kv_versions):
            ref = decode(value, WeightsRef)
            self.sched.observe_version(ref.tenant, ref.version)
        for job in self.sched.jobs.values():
            if job.state == "leased" or job.trained_version >= 0:
                self.sched.observe_version(job.tenant, job.trained_version)
            if job.key:
                self._keys[(job.tenant, job.key)] = job.job
        for value in await kv_values(self.kv_ckpt):
            ref = decode(value, CheckpointRef)
            self.ckpt_refs[ref.tenant] = ref
        self.log.info("state loaded", tenants=len(self.sched.tenants), jobs=len(self.sched.jobs))

    async def alive(self, role: str, instance: str) -> bool:
        """Does this role instance answer? No responder: gone. A timeout counts as alive
        (busy or hung: the health manager's watch decides that)."""
        assert self.bus is not None
        try:
            await self.bus.call(ops.INFO.of(role), InfoRequest(), instance=instance, timeout_s=3)
            return True
        except NexusError as exc:
            return not isinstance(exc, Unavailable)

    async def _release_dead_owners(self) -> None:
        """At start: jobs leased by trainers that are gone (a `nexus down` that stopped the
        master before its trainer, a crash while no master ran) go back at once, not after
        their lease runs out."""
        owners = {j.lease_owner for j in self.sched.live_jobs()
                  if j.lease_owner and j.state not in TERMINAL_JOB_STATES}
        for owner in owners:
            if await self.alive("trainer", owner):
                continue
            await self._release_trainer(owner, f"trainer {owner} is gone (found at master start)")

    async def _save(self, job: JobRecord) -> JobRecord:
        self.sched.touch(job)  # before the await: the next lease decision sees the change
        await store_put(self.kv_jobs, f"{job.tenant}.{job.job}", encode(job))
        return job

    def _tenant(self, name: str) -> TenantConfig:
        check_token("tenant", name)
        cfg = self.sched.tenants.get(name)
        if cfg is None:
            raise NotFound(f"unknown tenant {name!r}", details={"tenant": name})
        return cfg

    def _job(self, tenant: str, job: str) -> JobRecord:
        self._tenant(tenant)
        check_token("job", job)
        rec = self.sched.jobs.get((tenant, job))
        if rec is None:
            raise NotFound(f"unknown job {job!r} of tenant {tenant!r}", details={"tenant": tenant, "job": job})
        return rec

    # -- tenants -------------------------------------------------------------------------
    @op(ops.MASTER_TENANT_CREATE)
    async def tenant_create(self, req: CreateTenantRequest) -> TenantConfig:
        cfg = req.config
        check_token("config.name", cfg.name)
        require_tenant(cfg.name, "tenant_create")
        # A tenant names a preset or a registered base, never a host path (master/bases.py).
        cfg.base = await self.resolve_base(cfg.base, "config.base")
        by_operator = current_caller().is_platform
        if not by_operator and cfg.quotas is not None:
            # docs/security.md: quotas, priority ceilings and in-flight caps are the operator's.
            raise InvalidField("config.quotas", "quotas are set by the operator (`nexus tenant quotas`), never in "
                                                "a tenant's own request; leave it unset (null)")
        cfg.signature = schema_signature(cfg.schema)
        check_config(cfg)
        # Bounded by the stored tenant's quotas when it exists (a tenant's re-create brings
        # none), else by the request's (the platform's own, or the defaults).
        existing = self.sched.tenants.get(cfg.name)
        if not by_operator and existing is not None:
            cfg.quotas = existing.quotas
        self.check_schedule(cfg, existing or cfg, "config")
        if cfg.base_adapter or cfg.head == "expert":
            # Off the loop: the first check imports transformers (seconds) to read the base's layers.
            errors = await asyncio.to_thread(base_fit_errors, cfg, "head_params")
            if errors:
                raise InvalidField(f"config.{errors[0][0]}", errors[0][1])
        async with self._lock:
            existing = self.sched.tenants.get(cfg.name)
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
            await store_put(self.kv_tenants, cfg.name, encode(cfg))
            self.sched.tenants[cfg.name] = cfg
        self.log.info("tenant created", tenant=cfg.name, signature=cfg.signature, head=cfg.head)
        return cfg

    def check_tenant_capacity(self) -> None:
        """A new tenant past NEXUS_MAX_TENANTS is refused before anything of it exists."""
        if len(self.sched.tenants) >= self.max_tenants:
            raise CapacityExceeded.of("max_tenants", self.max_tenants, "NEXUS_MAX_TENANTS",
                                      f"{len(self.sched.tenants)} tenants are registered (or delete one)",
                                      tenants=len(self.sched.tenants))

    def check_workload_capacity(self) -> None:
        """A new workload past NEXUS_MAX_ACTIVE_WORKLOADS (pending + running) is refused at submit."""
        active = sum(1 for w in self.workloads.values() if w.state in ("pending", "running"))
        if active >= self.max_active_workloads:
            raise CapacityExceeded.of("max_active_workloads", self.max_active_workloads, "NEXUS_MAX_ACTIVE_WORKLOADS",
                                      f"{active} workloads are pending or running (or wait for one to end)",
                                      active=active)

    async def _ensure_queue_stream(self, tenant: str) -> None:
        assert self.bus is not None
        # Replicas, byte limit and dedup window come from the deployment (actors/layout.py).
        await ensure_tq_stream(self.bus.js, self.names, tenant, self.deployment)

    @op(ops.MASTER_TENANT_DELETE)
    async def tenant_delete(self, req: TenantDeleteRequest) -> TenantDeleted:
        """Remove everything of a tenant; trainers and inferencers drop it on the announcement."""
        assert self.bus is not None
        self._tenant(req.tenant)
        active = [w.workload for w in self.workloads.values()
                  if w.tenant == req.tenant and w.state in ("pending", "running")]
        if active:
            raise FailedPrecondition(f"tenant {req.tenant!r} has workload {active[0]} {self.workloads[active[0]].state}; "
                                     "cancel it first", details={"tenant": req.tenant, "workload": active[0]})
        self._check_no_held_jobs(req.tenant)
        removed = {"jobs": 0, "workloads": 0, "objects": 0}
        reports = []  # the report files of its workloads, found before their records go
        for rec in [w for w in self.workloads.values() if w.tenant == req.tenant]:
            try:
                reports.append(report_file(self.cfg.data_dir, rec))
            except ValueError:  # a path that leaves the data dir was never written
                pass
        async with self._lock:
            self._tenant(req.tenant)  # again under the lock: a concurrent delete got here first
            await self._drop_slot_records(req.tenant, removed)
            for workload in [w.workload for w in self.workloads.values() if w.tenant == req.tenant]:
                del self.workloads[workload]
                self._unsaved.pop(workload, None)
                await self.kv_workloads.purge(workload)
                removed["workloads"] += 1
        removed["usage"] = await self.delete_usage(req.tenant)
        removed.update(await asyncio.to_thread(remove_tenant_files, self.cfg.data_dir, req.tenant, reports))
        await self._drop_slot_storage(req.tenant, removed)
        event = TenantDeleted(tenant=req.tenant, at=time.time(), removed=removed)
        await self.bus.publish(self.names.tenant_deleted(req.tenant), event)
        self.log.info("tenant deleted", tenant=req.tenant, **removed)
        return event

    @op(ops.MASTER_TENANT_RESET)
    async def tenant_reset(self, req: TenantResetRequest) -> TenantDeleted:
        """Drop a tenant's slot (config, versions, checkpoints, job records, queue stream) so
        its next submit registers a new schema. Its account and credentials (the CLI's), its
        workload records, reports and usage stay. Access ``tenant``: a tenant resets itself
        only (an empty name is the caller's); the operator names any. Refused, changing
        nothing, while a workload of the tenant (or one scoring its policy) is pending or
        running, or a trainer still holds one of its jobs."""
        assert self.bus is not None
        if not req.tenant:
            raise InvalidField("tenant", "name the tenant to reset (a tenant's own credentials reset their own)")
        tenant = check_token("tenant", req.tenant)
        known = tenant in self.sched.tenants or any(w.tenant == tenant for w in self.workloads.values())
        if not known:
            raise NotFound(f"unknown tenant {tenant!r}: nothing to reset", details={"tenant": tenant})
        removed = {"jobs": 0, "objects": 0}
        async with self._lock:  # checked under the lock: a submit cannot slip in between
            self._check_no_active(tenant)
            self._check_no_held_jobs(tenant)
            removed["slot"] = int(tenant in self.sched.tenants)
            await self._drop_slot_records(tenant, removed)
        await self._drop_slot_storage(tenant, removed)
        event = TenantDeleted(tenant=tenant, at=time.time(), removed=removed, reset=True)
        # Trainers and inferencers drop the slot and heads they hold, as for a delete.
        await self.bus.publish(self.names.tenant_deleted(tenant), event)
        self.log.info("tenant reset", tenant=tenant, **removed)
        return event

    def _check_no_active(self, tenant: str) -> None:
        """FailedPrecondition naming every pending / running workload that trains ``tenant``'s
        slot or scores its policy (an eval of another tenant's may pin it)."""
        active = [w for w in self.workloads.values() if w.state in ("pending", "running")
                  and (w.tenant == tenant or policy_pin_tenant(w) == tenant)]
        if active:
            ids = ", ".join(f"{w.workload} ({w.state})" for w in active)
            raise FailedPrecondition(
                f"tenant {tenant!r} cannot be reset while its workloads run: {ids}; wait for them to end, or "
                f"cancel them (`nexus cancel {active[0].workload}`), then reset",
                details={"tenant": tenant, "workloads": [w.workload for w in active]})

    def _check_no_held_jobs(self, tenant: str) -> None:
        held = [j.job for j in self.sched.jobs.values()
                if j.tenant == tenant and j.lease_owner and j.state not in TERMINAL_JOB_STATES]
        if held:
            # A trainer is still on it (a cancel makes it drop the job at its next renewal):
            # dropping the slot under it would leave the checkpoint it is about to write.
            raise Busy(f"tenant {tenant!r} has {len(held)} job(s) still held by a trainer; retry in a moment",
                       details={"tenant": tenant, "jobs": held, "retry_after_s": 1.0})

    async def _drop_slot_records(self, tenant: str, removed: dict[str, int]) -> None:
        """Under the lock: the tenant's job records, versions, checkpoint pointer and config,
        from memory and KV (delete and reset)."""
        for key in [k for k in self.sched.jobs if k[0] == tenant]:
            self.sched.remove(*key)
            await self.kv_jobs.purge(f"{key[0]}.{key[1]}")
            removed["jobs"] += 1
        self._keys = {k: v for k, v in self._keys.items() if k[0] != tenant}
        for d in (self.sched.versions, self.sched.dropped_stale, self.ckpt_refs):
            d.pop(tenant, None)
        self.sched.tenants.pop(tenant, None)
        for kv in (self.kv_tenants, self.kv_versions, self.kv_ckpt):
            try:
                await kv.purge(tenant)
            except NotFoundError:
                pass

    async def _drop_slot_storage(self, tenant: str, removed: dict[str, int]) -> None:
        """The tenant's training-queue stream and its objects (exported versions,
        checkpoints): ``<tenant>/...`` in the weights and checkpoints buckets."""
        assert self.bus is not None
        try:
            await self.bus.js.delete_stream(self.names.tq_stream(tenant))
        except NotFoundError:
            pass
        for bucket in (self.names.obj_weights, self.names.obj_checkpoints):
            store = await js_retry(self.bus.js.object_store, bucket)
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
        cfg = self.sched.tenants.get(tenant)
        history = [w.workload for w in sorted(self.workloads.values(), key=lambda w: w.created_at)
                   if w.tenant == tenant]
        if cfg is None and not history:
            raise NotFound(f"unknown tenant {tenant!r} (no slot and no workloads: submit an sft or rl spec to "
                           "register it)", details={"tenant": tenant})
        quotas = self.quotas(cfg) if cfg is not None else self.default_quotas
        return TenantShow(tenant=tenant, config=cfg, version=max(0, self.sched.versions.get(tenant, 0)),
                          quotas=quotas, quotas_default=cfg is None or cfg.quotas is None, workloads=history)

    @op(ops.MASTER_TENANT_GET)
    async def tenant_get(self, req: GetTenantRequest) -> TenantConfig:
        return self._tenant(req.tenant)

    @op(ops.MASTER_WEIGHTS_READ)
    async def weights_read(self, req: WeightsReadRequest) -> WeightsChunk:
        """A slice of a tenant's exported policy (or its manifest): the download path of a
        client without JetStream. The whole object is read, and the last few kept, so a
        download in slices reads it from the store once."""
        from transport.weights import manifest_name, weights_name

        assert self.bus is not None
        version = self.sched.versions.get(req.tenant, 0) if req.version < 0 else req.version
        if version <= 0:
            raise NotFound(f"tenant {req.tenant!r} has no exported version yet", details={"tenant": req.tenant})
        name = weights_name(req.tenant, version)
        name = manifest_name(name) if req.manifest else name
        data = self._read_cache.get(name)
        if data is None:
            store = await js_retry(self.bus.js.object_store, self.names.obj_weights)
            try:
                data = (await store.get(name)).data or b""
            except ObjectNotFoundError:
                raise NotFound(f"tenant {req.tenant!r} has no version {version}",
                               details={"tenant": req.tenant, "version": version}) from None
            self._read_cache[name] = data
            while len(self._read_cache) > WEIGHTS_READ_CACHE:
                self._read_cache.pop(next(iter(self._read_cache)))
        return WeightsChunk(tenant=req.tenant, version=version, object_name=name, offset=req.offset,
                            total=len(data), data=data[req.offset:req.offset + req.max_bytes])

    @op(ops.MASTER_LIST)
    async def list(self, req: ListRequest) -> ListReply:
        """Tenant names (at most NEXUS_MAX_TENANTS) and one page of workload ids (KV's keys)."""
        from master.paging import page

        ids, cursor = page(((k, k) for k in await kv_keys(self.kv_workloads)), req.limit, req.cursor,
                           self.bus.max_payload, lambda k: len(k) + 4)
        return ListReply(tenants=sorted(self.sched.tenants), workloads=ids, next_cursor=cursor)

    # -- training queue ------------------------------------------------------------------
    @op(ops.MASTER_RESERVE)
    async def reserve(self, req: ReserveRequest) -> JobRecord:
        async with self._lock:
            tenant = self._tenant(req.tenant)
            if req.key:
                known = self._keys.get((tenant.name, req.key))
                if known is not None and (tenant.name, known) in self.sched.jobs:
                    return self.sched.jobs[(tenant.name, known)]  # a retried reserve: the same job
            owner = self.workloads.get(req.workload) if req.workload else None
            if owner is not None and owner.state in TERMINAL_WORKLOAD_STATES:
                # Checked under the lock: a cancel sets the state first, then fails the
                # workload's jobs under this lock, so a job is either refused here or failed
                # there, never left reserved by a workflow that had not stopped yet.
                raise FailedPrecondition(f"workload {req.workload} is {owner.state}; it takes no new jobs",
                                         details={"workload": req.workload, "state": owner.state})
            priority = tenant.priority if req.priority is None else req.priority
            self.check_priority(priority, tenant)
            self.sched.check_reserve(tenant, req.task, self.quotas(tenant))
            now = time.time()
            job = JobRecord(
                tenant=tenant.name, job=new_job_id(), task=req.task, state="reserved",
                created_at=now, updated_at=now, auto=req.auto,
                priority=priority,
                key=req.key, workload=req.workload,
            )
            self.sched.put(job)
            if req.key:
                self._keys[(tenant.name, req.key)] = job.job
            return await self._save(job)

    @op(ops.MASTER_QUEUE_PUT)
    async def queue_put(self, req: QueuePutRequest) -> QueuePutReply:
        assert self.bus is not None
        job = self._job(req.tenant, req.job)
        tenant = self._tenant(req.tenant)
        if job.state not in ("reserved", "filling"):
            raise FailedPrecondition(f"job {job.job} is {job.state}; data can be added only before mark_ready")
        if req.seq < 0:
            raise InvalidField("seq", "must be >= 0")
        b = validate_put(req, tenant.schema, job.task)
        if job.task == "sft":
            self.sched.check_sft_prefetch(tenant, adding=1)
        subject = self.names.tq_job(req.tenant, req.job)
        # A PRODUCER span per stored micro-batch; its context goes into the message headers,
        # kept in the stream with the data (and the first one into the job record, which the
        # trainer reads at the lease): the trainer's work on the job joins this trace.
        with self.tracer.start_as_current_span(hop_name(subject, "publish"), kind=SpanKind.PRODUCER,
                                               attributes={**messaging(subject, "send"), **nexus_attrs(req),
                                                           "nexus.seq": req.seq}):
            context = carrier()
            ack = await publish_tq(
                self.bus.js, self.names, req.tenant, subject, encode(req),
                headers={"Nats-Msg-Id": f"{req.job}:{req.seq}", **context}, settings=self.deployment,
            )
        # The partition itself says how many micro-batches the job holds: right even when a
        # master died between this publish and saving the record, and the client's retry
        # came back as a duplicate.
        info = await js_retry(self.bus.js.stream_info, self.names.tq_stream(req.tenant),  # rides out a node loss
                              subjects_filter=self.names.tq_job(req.tenant, req.job))
        in_stream = (info.state.subjects or {}).get(self.names.tq_job(req.tenant, req.job), 0)
        async with self._lock:
            # Checked again after the awaits: a handback or a cancel may have sealed or failed
            # the job while this micro-batch was being stored (its workflow stopped mid-put).
            # Setting it back to filling would strand it (a sealed job would never be leased).
            closed = job.state not in ("reserved", "filling")
            if not closed:
                job.items = max(job.items, in_stream)
                if not ack.duplicate:
                    job.samples += b
                    if starts_step(req.seq):  # a split item's parts are one step (docs/training_queue.md)
                        job.steps += 1
                    if job.task == "rl":
                        # Staleness is judged by the oldest data in the job.
                        job.behaviour_version = (req.behaviour_version if job.behaviour_version < 0
                                                 else min(job.behaviour_version, req.behaviour_version))
                if not job.trace and context:
                    job.trace = context
                job.state, job.updated_at = "filling", time.time()
                await self._save(job)
        if closed:
            if job.state in TERMINAL_JOB_STATES:
                await self._purge(job)  # its partition was purged before this message landed
            # A sealed job keeps the micro-batches it was sealed with: the trainer reads only
            # the first `items` of the partition, so the late one is never trained.
            raise FailedPrecondition(f"job {job.job} became {job.state} while this micro-batch was stored; "
                                     "it is not part of the job")
        return QueuePutReply(tenant=job.tenant, job=job.job, items=job.items, duplicate=bool(ack.duplicate))

    @op(ops.MASTER_MARK_READY)
    async def mark_ready(self, req: JobRef) -> JobRecord:
        assert self.bus is not None
        async with self._lock:
            job = self._job(req.tenant, req.job)
            if job.state == "ready":
                return job
            if job.state != "filling" or job.items == 0:
                raise FailedPrecondition(f"job {job.job} is {job.state} with {job.items} items; put data first")
            job.state = "ready"
            job.ready_at = job.updated_at = time.time()
            await self._save(job)
        await self.bus.nc.publish(self.names.sched_ready, b"")
        return job

    @op(ops.MASTER_LEASE)
    async def lease(self, req: LeaseRequest) -> LeaseReply:
        check_token("trainer", req.trainer)
        if not 1 <= req.max_jobs <= 256:
            raise InvalidField("max_jobs", "must be in 1..256")
        async with self._lock:
            now = time.time()
            for job in self.sched.expire_leases(now):
                await self._save(job)
            if req.job:
                job = self._job(req.tenant, req.job)
                if job.state != "ready" and not (job.state in ("trained", "exported", "synced") and not job.lease_owner):
                    raise FailedPrecondition(f"job {job.job} is {job.state}, not ready to train")
                if self.sched.is_stale(job):
                    self.sched._drop_stale(job, now)
                    await self._save(job)
                    return LeaseReply(jobs=[], dropped_stale=[job])
                self.sched.lease_one(job, req.trainer, req.lease_s, now)
                leased, stale = [job], []
            else:
                started = time.perf_counter()
                leased, stale = self.sched.pick(req.trainer, req.max_jobs, req.lease_s, now)
                self.lease_decision_s.append(time.perf_counter() - started)
            try:
                for job in (*leased, *stale):
                    await self._save(job)
            except Exception:
                # Not recorded, not handed out: the trainer gets the error, so nobody may hold
                # these in memory either (they would wait for the lease to run out).
                for job in leased:
                    self.sched.release(job, time.time(), reason="lease not recorded", count_attempt=False)
                raise
        for job in stale:
            await self._purge(job)
            await self.metric("dropped_stale", job.tenant, self.sched.dropped_stale.get(job.tenant, 0))
            self.log.warning("dropped stale job", tenant=job.tenant, job=job.job, reason=job.reason)
        return LeaseReply(jobs=leased, dropped_stale=stale)

    @op(ops.MASTER_JOB_UPDATE)
    async def job_update(self, req: JobUpdate) -> JobRecord:
        async with self._lock:
            job = self._job(req.tenant, req.job)
            if job.state == req.state and (job.lease_owner in ("", req.trainer)):
                return job  # a retried report
            if not self.sched.holds(job, req.trainer, req.lease_epoch):
                raise Conflict(
                    f"job {job.job} is held by {job.lease_owner or 'nobody'} (lease epoch {job.lease_epoch}), "
                    f"not {req.trainer} (epoch {req.lease_epoch}): its lease was lost; nothing was recorded",
                    details={"job": job.job, "lease_owner": job.lease_owner, "lease_epoch": job.lease_epoch})
            allowed = TRANSITIONS.get(job.state, ())
            if req.state not in allowed:
                raise FailedPrecondition(f"job {job.job}: {job.state} -> {req.state} is not allowed; allowed: {list(allowed)}")
            if req.state == "trained" and req.checkpoint:
                # The commit point: the tenant's checkpoint pointer moves to the state after
                # this job, only if it still names the state the trainer started from.
                await self._move_checkpoint(job.tenant, req.base_checkpoint, CheckpointRef(
                    tenant=job.tenant, object_name=req.checkpoint, job=job.job,
                    version=max(req.trained_version, 0), updated_at=time.time()))
            job.state, job.updated_at = req.state, time.time()
            if req.trained_version >= 0:
                job.trained_version = req.trained_version
                self.sched.observe_version(job.tenant, req.trained_version)
            if req.reason:
                job.reason = req.reason
            job.metrics.update(req.metrics)
            if req.state in TERMINAL_JOB_STATES:
                job.lease_owner, job.lease_expires_at = "", 0.0
            await self._save(job)
        if req.state in TERMINAL_JOB_STATES:
            await self._purge(job)
        return job

    @op(ops.MASTER_LEASE_RENEW)
    async def lease_renew(self, req: LeaseRenewRequest) -> LeaseRenewReply:
        check_token("trainer", req.trainer)
        if len(req.jobs) != len(req.epochs):
            raise InvalidField("epochs", f"has {len(req.epochs)} entries for {len(req.jobs)} jobs")
        if not 0 < req.lease_s <= 3600:
            raise InvalidField("lease_s", "must be in (0, 3600]")
        held, lost = [], []
        async with self._lock:
            now = time.time()
            for ref, epoch in zip(req.jobs, req.epochs):
                job = self.sched.jobs.get((ref.tenant, ref.job))
                if job is not None and self.sched.renew(job, req.trainer, epoch, req.lease_s, now):
                    await self._save(job)  # a restarted master must not expire a renewed lease
                    held.append(ref.job)
                elif job is not None and job.state == "cleared" and job.lease_epoch == epoch:
                    # This lease's own commit cleared it while the renewal was on its way: done, not
                    # lost (another trainer's lease would carry a higher epoch).
                    held.append(ref.job)
                else:
                    lost.append(ref.job)
        return LeaseRenewReply(held=held, lost=lost)

    @op(ops.MASTER_LEASE_RELEASE)
    async def lease_release(self, req: LeaseReleaseRequest) -> Ok:
        check_token("trainer", req.trainer)
        if len(req.jobs) != len(req.epochs):
            raise InvalidField("epochs", f"has {len(req.epochs)} entries for {len(req.jobs)} jobs")
        released = 0
        async with self._lock:
            now = time.time()
            for ref, epoch in zip(req.jobs, req.epochs):
                job = self.sched.jobs.get((ref.tenant, ref.job))
                if job is not None and self.sched.holds(job, req.trainer, epoch):
                    self.sched.release(job, now, reason=f"released by {req.trainer}: {req.reason}",
                                       count_attempt=False)
                    await self._save(job)
                    released += 1
        if released and self.bus is not None:
            await self.bus.nc.publish(self.names.sched_ready, b"")
        return Ok(detail=f"released {released} of {len(req.jobs)} jobs")

    @op(ops.MASTER_CHECKPOINT_GET)
    async def checkpoint_get(self, req: CheckpointGetRequest) -> CheckpointRef:
        self._tenant(req.tenant)
        return self.ckpt_refs.get(req.tenant) or CheckpointRef(tenant=req.tenant, object_name="")

    @op(ops.MASTER_CHECKPOINT_COMMIT)
    async def checkpoint_commit(self, req: CheckpointCommitRequest) -> CheckpointRef:
        self._tenant(req.tenant)
        check_token("trainer", req.trainer)
        async with self._lock:
            ref = CheckpointRef(tenant=req.tenant, object_name=req.object_name, step=req.step,
                                version=req.version, updated_at=time.time())
            await self._move_checkpoint(req.tenant, req.base_checkpoint, ref)
        return ref

    async def _move_checkpoint(self, tenant: str, base: str, ref: CheckpointRef) -> None:
        """Compare-and-set of the tenant's checkpoint pointer (under the master's lock)."""
        current = self.ckpt_refs.get(tenant)
        current_name = current.object_name if current else ""
        if current_name == ref.object_name:
            return  # a retried commit
        if current_name != base:
            raise Conflict(
                f"tenant {tenant}'s checkpoint moved to {current_name or 'none'} while this state was built on "
                f"{base or 'none'}: reload and retry", details={"tenant": tenant, "checkpoint": current_name})
        await store_put(self.kv_ckpt, tenant, encode(ref))
        self.ckpt_refs[tenant] = ref

    # -- rollout gate: the tenant's max_active_rollouts quota (1) and 3 in all ---------------
    @op(ops.MASTER_ROLLOUT_BEGIN)
    async def rollout_begin(self, req: JobRef) -> Ok:
        """A workflow asks to start collecting a rollout batch (``job`` = its workload id).
        Access ``tenant``: a hosted env process (docs/hosted_envs.md) takes its own tenant's
        turns, for a workload of its tenant that runs; the platform's workflows any."""
        self._tenant(req.tenant)
        self._check_rollout_workload(req)
        now = time.time()
        # A workflow that died mid-rollout must not hold its slot forever.
        self.rollouts = {k: v for k, v in self.rollouts.items() if v > now}
        key = f"{req.tenant}/{req.job}"
        if key in self.rollouts:
            self.rollouts[key] = now + ROLLOUT_TTL_S
            return Ok(detail="already active")
        active_tenant = [k for k in self.rollouts if k.split("/", 1)[0] == req.tenant]
        limit = self.quotas(self._tenant(req.tenant)).max_active_rollouts
        if len(active_tenant) >= limit:
            raise QuotaExceeded.of("max_active_rollouts", limit,
                                   f"tenant {req.tenant!r} has {len(active_tenant)} rollouts active", 0.2,
                                   tenant=req.tenant, active=len(active_tenant))
        # Priority routes the deployment's turns (docs/scaling.md, "Priority that routes"): a
        # free turn goes to the best-ranked waiter (fair share by priority), not the fastest retry.
        cfg = self._tenant(req.tenant)
        priority = clamp_priority(cfg.priority, self.quotas(cfg).max_priority)
        holding: dict[str, int] = {}
        for k in self.rollouts:
            holding[k.split("/", 1)[0]] = holding.get(k.split("/", 1)[0], 0) + 1
        blocked = {t for t, n in holding.items()
                   if t in self.sched.tenants and n >= self.quotas(self.sched.tenants[t]).max_active_rollouts}
        free = self.max_active_rollouts - len(self.rollouts)
        ahead = self.gate_line.ask(key, req.tenant, priority, free, now, blocked)
        if free <= 0 or ahead >= free:
            self.gate_line.settle(set(holding))
            why = (f"{len(self.rollouts)} rollouts active (the deployment's cap is {self.max_active_rollouts})"
                   if free <= 0 else f"the {free} free rollout turn(s) go to {ahead} waiting rollouts ranked before "
                   f"this one (fair share by priority; this tenant's priority {priority})")
            raise Busy(why, details={"retry_after_s": 0.2, "waiting_ahead": ahead})
        self.rollouts[key] = now + ROLLOUT_TTL_S
        self.gate_line.settle(set(holding) | {req.tenant})
        return Ok(detail="granted")

    def _check_rollout_workload(self, req: JobRef) -> None:
        if current_caller().is_platform:
            return
        rec = self.workloads.get(req.job)
        if rec is None or rec.tenant != req.tenant or rec.state != "running":
            raise FailedPrecondition(f"tenant {req.tenant!r} has no running workload {req.job!r}: a rollout turn is "
                                     "taken for a running workload of the caller's own tenant",
                                     details={"workload": req.job})

    @op(ops.MASTER_ROLLOUT_END)
    async def rollout_end(self, req: JobRef) -> Ok:
        self.rollouts.pop(f"{req.tenant}/{req.job}", None)
        self.gate_line.settle({k.split("/", 1)[0] for k in self.rollouts})
        return Ok(detail="released")

    @op(ops.MASTER_JOB)
    async def job(self, req: JobRef) -> JobRecord:
        return self._job(req.tenant, req.job)

    @op(ops.MASTER_JOBS)
    async def jobs(self, req: JobsRequest) -> JobsReply:
        if req.tenant:
            self._tenant(req.tenant)
        from master.paging import name_key, page

        out = [(name_key(j.tenant, j.job), j) for j in self.sched.jobs.values()
               if (not req.tenant or j.tenant == req.tenant) and (not req.states or j.state in req.states)]
        jobs, cursor = page(out, req.limit, req.cursor, self.bus.max_payload, lambda j: len(encode(j)))
        return JobsReply(jobs=jobs, next_cursor=cursor)

    @op(ops.MASTER_QUEUE_GET)
    async def queue_get(self, req: QueueGetRequest) -> QueueGetReply:
        job = self._job(req.tenant, req.job)
        if req.start < 0 or req.max_items < 1:
            raise InvalidField("start", "start must be >= 0 and max_items >= 1")
        assert self.bus is not None
        # A reply must fit the max payload too: return a prefix of the range; the caller
        # pages on with start += len(items).
        budget = int(self.bus.max_payload * 0.9)
        items: list[QueuePutRequest] = []
        for item in await self.partitions.read(job, req.start, req.max_items):
            size = len(encode(item))
            if items and size > budget:
                break
            budget -= size
            items.append(item)
        return QueueGetReply(tenant=job.tenant, job=job.job, items=items, total=job.items)

    @op(ops.MASTER_QUEUE_CLEAR)
    async def queue_clear(self, req: JobRef) -> JobRecord:
        async with self._lock:
            job = self._job(req.tenant, req.job)
            if job.state not in TERMINAL_JOB_STATES:
                if job.state in ("trained", "exported", "synced"):
                    job.state = "cleared"
                else:
                    job.state, job.reason = "failed", f"cleared by a client while {job.state}"
                job.lease_owner, job.lease_expires_at, job.updated_at = "", 0.0, time.time()
                await self._save(job)
        await self._purge(job)
        return job

    async def _purge(self, job: JobRecord) -> None:
        assert self.bus is not None
        try:
            # Safe to repeat (a purge of an empty subject is a no-op): rides out a node loss.
            await js_retry(self.bus.js.purge_stream, self.names.tq_stream(job.tenant),
                           subject=self.names.tq_job(job.tenant, job.job))
        except NotFoundError:
            pass  # stream already gone with its tenant: nothing left to purge

    # -- background ----------------------------------------------------------------------
    async def _expire_loop(self) -> None:
        while True:
            await self.idle("lease-expiry", EXPIRE_EVERY_S)
            orphans: list[JobRecord] = []
            sealed = False
            async with self._lock:
                now = time.time()
                for job in self.sched.expire_leases(now):
                    self.log.warning("lease expired", tenant=job.tenant, job=job.job, state=job.state)
                    await self._save(job)
                for job in self.sched.orphans(now, self.leases.orphan_ttl_s):
                    why = f"idle for {self.leases.orphan_ttl_s:g} s while {job.state}: its workflow is gone"
                    if job.state == "filling" and job.items > 0:
                        self._seal(job, now, why)  # what was acknowledged is trained
                        sealed = True
                    else:
                        job.reason = why + "; it held no data"
                        job.state, job.updated_at = "failed", now
                        orphans.append(job)
                    self.log.warning("orphan job expired", tenant=job.tenant, job=job.job, state=job.state)
                    await self._save(job)
            for job in orphans:
                await self._purge(job)
            if sealed and self.bus is not None:
                await self.bus.nc.publish(self.names.sched_ready, b"")

    async def fail_unready_jobs(self, workload: str, reason: str, states: tuple[str, ...] = ("reserved", "filling"),
                                seal: bool = True) -> int:
        """A workload's workflow stopped (crash, handback; or a cancel, ``seal=False``): its
        jobs it can no longer complete leave the in-flight cap at once. With ``seal``, a job
        that already holds micro-batches is marked ready with what it has (every acknowledged
        micro-batch is trained: each is a whole optimizer step of its own); an empty one fails
        (it holds nothing). A cancel fails them all."""
        failed: list[JobRecord] = []
        sealed = 0
        async with self._lock:
            now = time.time()
            for job in self.sched.live_jobs():
                if job.workload != workload or job.state not in states:
                    continue
                if seal and job.state == "filling" and job.items > 0:
                    self._seal(job, now, reason)
                    sealed += 1
                else:
                    job.state, job.reason, job.updated_at = "failed", reason, now
                    job.lease_owner, job.lease_expires_at = "", 0.0
                    failed.append(job)
                await self._save(job)
        for job in failed:
            await self._purge(job)
        if sealed and self.bus is not None:
            await self.bus.nc.publish(self.names.sched_ready, b"")
        return len(failed) + sealed

    @staticmethod
    def _seal(job: JobRecord, now: float, reason: str) -> None:
        job.state, job.ready_at, job.updated_at = "ready", now, now
        job.reason = f"sealed with its {job.items} micro-batches: {reason}"

    async def _owner_check_loop(self) -> None:
        """Leases and workloads held by roles that no longer answer go back without waiting
        for a lease to run out: the health manager only reports roles it saw beat, and one
        restarted after a role died never saw it."""
        while True:
            await asyncio.sleep(OWNER_CHECK_EVERY_S)
            await self._release_dead_owners()
            for rec in list(self.workloads.values()):
                if (rec.state == "running" and rec.worker and not is_hosted_worker(rec.worker)  # leased: hosted.py
                        and not await self.alive("env", rec.worker)):
                    await self._repend(rec, f"env worker {rec.worker} no longer answers")

    async def _compact_loop(self) -> None:
        """Finished job records and old policy versions go after their retention, so neither
        the scheduler's scans nor the object store grow with history."""
        while True:
            await asyncio.sleep(self.retention.every_s)
            await self.compact()

    async def compact(self, now: float | None = None) -> dict[str, int]:
        now = time.time() if now is None else now
        removed = 0
        async with self._lock:
            for job in self.sched.compactable(now, self.retention.job_records_s):
                self.sched.remove(job.tenant, job.job)
                if job.key:
                    self._keys.pop((job.tenant, job.key), None)
                try:
                    await self.kv_jobs.purge(f"{job.tenant}.{job.job}")
                except NexusError as exc:
                    self.log.warning("job record purge failed", job=job.job, error=str(exc))
                removed += 1
        versions = await self._compact_versions()
        workloads, usage = await self.compact_workloads(now)
        if removed or versions or workloads or usage:
            self.log.info("compacted", job_records=removed, versions=versions, workload_records=workloads,
                          usage_records=usage)
        return {"job_records": removed, "versions": versions, "workload_records": workloads, "usage_records": usage}

    async def _compact_versions(self) -> int:
        """Delete policy versions older than the newest `self.retention.versions_kept` of each
        tenant, except versions a live workload pins (an eval) and an uploaded start (version 0)."""
        assert self.bus is not None
        store = await js_retry(self.bus.js.object_store, self.names.obj_weights)
        try:
            infos = await store.list(ignore_deletes=True)
        except NotFoundError:
            return 0
        by_tenant: dict[str, list[tuple[int, str]]] = {}
        for info in infos:
            tenant, _, rest = info.name.partition("/v")
            digits = rest.removesuffix(".manifest.json")
            if digits.isdigit():
                by_tenant.setdefault(tenant, []).append((int(digits), info.name))
        pinned = self.pinned_versions()
        deleted = 0
        for tenant, objs in by_tenant.items():
            versions = sorted({v for v, _ in objs})
            # Version 0 exists only for a tenant that started from uploaded weights (master/
            # uploads.py): its start, which a version-0 pin must get (never the seed's init).
            keep = set(versions[-self.retention.versions_kept:]) | pinned.get(tenant, set()) | {0}
            for version, name in objs:
                if version not in keep:
                    try:
                        await store.delete(name)
                        deleted += 1
                    except ObjectNotFoundError:
                        pass
        return deleted

    async def _on_health_event(self, msg: Any) -> None:
        try:
            ev = decode(msg.data, HealthEvent)
        except Exception as exc:
            self.log.warning("bad health event", error=str(exc))
            return
        # A role that drained is gone just as a dead one is: what it held goes back at once.
        if ev.event not in ("role_down", "role_stopped"):
            return
        how = "died" if ev.event == "role_down" else "stopped"
        if ev.role in ("env", "trainer") and ev.event == "role_down" and await self.alive(ev.role, ev.instance):
            # Reported down but still serving (beats late on a loaded host): taking its work
            # away would run it twice. A hung one is restarted by the health manager, and then
            # no longer answers: the owner check releases what it held within seconds.
            self.log.warning("role reported down still answers; its work stays", target_role=ev.role,
                             target_instance=ev.instance)
            return
        if ev.role == "env":
            await self.on_env_worker_down(ev.instance, how)
            return
        if ev.role == "trainer":
            await self._release_trainer(ev.instance, f"trainer {ev.instance} {how}")

    async def _release_trainer(self, instance: str, reason: str) -> None:
        released = 0
        async with self._lock:
            now = time.time()
            for job in self.sched.live_jobs():
                if job.lease_owner == instance and job.state not in TERMINAL_JOB_STATES:
                    self.sched.release(job, now, reason=reason)
                    self.log.warning("released job", tenant=job.tenant, job=job.job, state=job.state, reason=reason)
                    await self._save(job)
                    released += 1
        if released and self.bus is not None:
            await self.bus.nc.publish(self.names.sched_ready, b"")

    async def _on_weights(self, msg: Any) -> None:
        try:
            ref = decode(msg.data, WeightsRef)
        except Exception as exc:
            self.log.warning("bad weights announcement", error=str(exc))
            return
        self.sched.observe_version(ref.tenant, ref.version)


def _import_model_core() -> None:
    import models.heads  # noqa: F401
    import models.presets  # noqa: F401
    import models.schema  # noqa: F401
    import models.slot  # noqa: F401
