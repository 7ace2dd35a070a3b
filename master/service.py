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
from typing import Any

from nats.js.errors import NotFoundError, ObjectNotFoundError

from transport.bus import js_retry

from actors.runtime import Role, RoleConfig
from master.fairshare import clamp_priority
from master.bases import BaseOps
from master.hosted import HostedOps
from master.records import is_hosted_worker
from master.store import kv_values
from master.usage import UsageOps
from master.uploads import UploadOps
from master.jobs import JobOps
from master.state import MasterState
from master.tenants import TenantOps
from master.workload_views import WorkloadViews
from master.workloads import WorkloadOps
from protocol import recipes
from protocol.errors import (NexusError)
from protocol.messages import (
    CheckpointRef,
    HealthEvent,
    JobRecord,
    TenantConfig,
    WeightsRef,
)
from protocol.policy import OWNER_CHECK_EVERY_S
from protocol.wire import decode

# Tenants in one heartbeat's gauges (about 30 bytes per tenant and signal: 256 keep a beat
# near 40 KB, far under NATS's 1 MB payload); the rest ride as "other".
BEAT_TENANTS_MAX = 256


def decision_summary(durations_s: Any) -> dict[str, float]:
    """n, p50, p99 and max (ms) of the scheduler's recent lease decisions."""
    ms = sorted(d * 1000.0 for d in durations_s)
    if not ms:
        return {"n": 0}
    p50, p99 = (ms[min(len(ms) - 1, int(q * len(ms)))] for q in (0.50, 0.99))
    return {"n": len(ms), "p50": p50, "p99": p99, "max": ms[-1]}


class Master(Role):
    """The master role, composed of parts (`master.state.MasterState` is what they share);
    each part serves its own ops (`Role.part_types`)."""

    name = "master"
    part_types = (TenantOps, JobOps, WorkloadOps, WorkloadViews, UsageOps, BaseOps, HostedOps, UploadOps)

    def __init__(self, cfg: RoleConfig) -> None:
        super().__init__(cfg)
        self.st = MasterState(cfg, self.names, self.log, self.tracer, spawn=self.spawn, idle=self.idle,
                              tick=self.tick, metric=self.metric)
        self.usage_ops = UsageOps(self.st)
        self.base_ops = BaseOps(self.st)
        self.upload_ops = UploadOps(self.st)
        self.hosted_ops = HostedOps(self.st)
        self.tenant_ops = TenantOps(self.st, base_ops=self.base_ops, usage_ops=self.usage_ops)
        self.job_ops = JobOps(self.st, usage_ops=self.usage_ops)
        self.workload_ops = WorkloadOps(self.st, tenant_ops=self.tenant_ops, job_ops=self.job_ops,
                                        usage_ops=self.usage_ops, base_ops=self.base_ops,
                                        upload_ops=self.upload_ops, hosted_ops=self.hosted_ops)
        self.hosted_ops.bind(self.workload_ops)  # the two call each other
        self.workload_views = WorkloadViews(self.st)

    def parts(self) -> tuple[object, ...]:
        return (self.tenant_ops, self.job_ops, self.workload_ops, self.workload_views, self.usage_ops, self.base_ops,
                self.hosted_ops, self.upload_ops)

    async def setup(self) -> None:
        assert self.bus is not None
        # The recipes' declarations (kind -> family, config) by module name, as the env worker
        # loads them: a spec may then name their kinds. A module that does not import stops the
        # start naming it (RecipeModuleError). Off the event loop: a recipe may import much.
        await asyncio.to_thread(recipes.load_modules, self.st.workflow_modules)
        # Validating a tenant needs the model core (torch): import it now, off the event
        # loop. Imported on the first submit instead, it blocked heartbeats for seconds on a
        # loaded host, and the health manager restarted a live master.
        await asyncio.to_thread(_import_model_core)
        await self.st.open(self.bus)
        started = time.perf_counter()
        await self._load_state()
        self.st.startup_s["load_state"] = time.perf_counter() - started
        await self.bus.nc.subscribe(self.names.health_events_all, cb=self._on_health_event)
        await self.bus.nc.subscribe(self.names.weights_all, cb=self._on_weights)
        self.spawn(self.job_ops.expire_loop, "lease-expiry", critical=True, max_quiet_s=30.0)
        self.spawn(self._compact_loop, "compaction", critical=True)
        self.spawn(self._owner_check_loop, "owner-check", critical=True)
        await self.usage_ops.setup_usage()
        await self.base_ops.setup_bases()
        started = time.perf_counter()
        await self.workload_ops.setup_workloads()
        self.hosted_ops.setup_hosted()
        self.st.startup_s["load_workloads"] = time.perf_counter() - started
        await self.job_ops.release_dead_owners()

    def info_extra(self) -> dict[str, Any]:
        states: dict[str, int] = {}
        for j in self.st.sched.jobs.values():
            states[j.state] = states.get(j.state, 0) + 1
        return {"tenants": len(self.st.sched.tenants), "jobs": states,
                "dropped_stale": dict(self.st.sched.dropped_stale),
                "scale": {"lease_decision_ms": decision_summary(self.st.lease_decision_s),
                          "startup_s": dict(self.st.startup_s), "job_records": len(self.st.sched.jobs),
                          "live_jobs": len(self.st.sched.live_jobs()),
                          "workloads": len(self.st.workloads)}}

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
                "dropped_stale": float(self.st.sched.dropped_stale.get(t, 0)), "active_rollouts": 0.0,
                "waiting_rollouts": 0.0, "priority": self._routing_priority(t)}
            for t in set(self.st.sched.tenants) | set(self.st.sched.dropped_stale)}
        for j in self.st.sched.live_jobs():
            row = rows.get(j.tenant)
            if row is None:
                continue
            if j.state in ("reserved", "filling", "ready"):
                row["queue_depth"] += 1
                row["ready_jobs"] += j.state == "ready"
                if j.state == "ready" and j.task == "rl" and j.behaviour_version >= 0:
                    lag = self.st.sched.versions.get(j.tenant, 0) - j.behaviour_version
                    row["staleness_versions"] = max(row["staleness_versions"], float(lag))
            elif j.state in ("leased", "trained", "exported", "synced"):
                row["jobs_in_flight"] += 1
        now = time.time()
        for key, expiry in self.st.rollouts.items():
            row = rows.get(key.split("/", 1)[0])
            if expiry > now and row is not None:
                row["active_rollouts"] += 1
        for tenant, n in self.st.gate_line.waiting_by_tenant(now).items():
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
        cfg = self.st.sched.tenants.get(tenant)
        return float(clamp_priority(cfg.priority, self.usage_ops.quotas(cfg).max_priority)) if cfg is not None else 0.0

    # -- state ---------------------------------------------------------------------------
    async def _load_state(self) -> None:
        for value in await kv_values(self.st.kv_tenants):
            cfg = decode(value, TenantConfig)
            self.st.sched.tenants[cfg.name] = cfg
        for value in await kv_values(self.st.kv_jobs):
            self.st.sched.put(decode(value, JobRecord))
        for value in await kv_values(self.st.kv_versions):
            ref = decode(value, WeightsRef)
            self.st.sched.observe_version(ref.tenant, ref.version)
        for job in self.st.sched.jobs.values():
            if job.state == "leased" or job.trained_version >= 0:
                self.st.sched.observe_version(job.tenant, job.trained_version)
            if job.key:
                self.st.keys[(job.tenant, job.key)] = job.job
        for value in await kv_values(self.st.kv_ckpt):
            ref = decode(value, CheckpointRef)
            self.st.ckpt_refs[ref.tenant] = ref
        self.log.info("state loaded", tenants=len(self.st.sched.tenants), jobs=len(self.st.sched.jobs))

    async def _owner_check_loop(self) -> None:
        """Leases and workloads held by roles that no longer answer go back without waiting
        for a lease to run out: the health manager only reports roles it saw beat, and one
        restarted after a role died never saw it."""
        while True:
            await asyncio.sleep(OWNER_CHECK_EVERY_S)
            await self.job_ops.release_dead_owners()
            for rec in list(self.st.workloads.values()):
                if (rec.state == "running" and rec.worker and not is_hosted_worker(rec.worker)  # leased: hosted.py
                        and not await self.st.alive("env", rec.worker)):
                    await self.workload_ops.repend(rec, f"env worker {rec.worker} no longer answers")

    async def _compact_loop(self) -> None:
        """Finished job records and old policy versions go after their retention, so neither
        the scheduler's scans nor the object store grow with history."""
        while True:
            await asyncio.sleep(self.st.retention.every_s)
            await self.compact()

    async def compact(self, now: float | None = None) -> dict[str, int]:
        now = time.time() if now is None else now
        removed = 0
        async with self.st.lock:
            for job in self.st.sched.compactable(now, self.st.retention.job_records_s):
                self.st.sched.remove(job.tenant, job.job)
                if job.key:
                    self.st.keys.pop((job.tenant, job.key), None)
                try:
                    await self.st.kv_jobs.purge(f"{job.tenant}.{job.job}")
                except NexusError as exc:
                    self.log.warning("job record purge failed", job=job.job, error=str(exc))
                removed += 1
        versions = await self._compact_versions()
        workloads, usage = await self.workload_ops.compact_workloads(now)
        if removed or versions or workloads or usage:
            self.log.info("compacted", job_records=removed, versions=versions, workload_records=workloads,
                          usage_records=usage)
        return {"job_records": removed, "versions": versions, "workload_records": workloads, "usage_records": usage}

    async def _compact_versions(self) -> int:
        """Delete policy versions older than the newest `self.st.retention.versions_kept` of each
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
        pinned = self.workload_ops.pinned_versions()
        deleted = 0
        for tenant, objs in by_tenant.items():
            versions = sorted({v for v, _ in objs})
            # Version 0 exists only for a tenant that started from uploaded weights (master/
            # uploads.py): its start, which a version-0 pin must get (never the seed's init).
            keep = set(versions[-self.st.retention.versions_kept:]) | pinned.get(tenant, set()) | {0}
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
        if ev.role in ("env", "trainer") and ev.event == "role_down" and await self.st.alive(ev.role, ev.instance):
            # Reported down but still serving (beats late on a loaded host): taking its work
            # away would run it twice. A hung one is restarted by the health manager, and then
            # no longer answers: the owner check releases what it held within seconds.
            self.log.warning("role reported down still answers; its work stays", target_role=ev.role,
                             target_instance=ev.instance)
            return
        if ev.role == "env":
            await self.workload_ops.on_env_worker_down(ev.instance, how)
            return
        if ev.role == "trainer":
            await self.job_ops.release_trainer(ev.instance, f"trainer {ev.instance} {how}")

    async def _on_weights(self, msg: Any) -> None:
        try:
            ref = decode(msg.data, WeightsRef)
        except Exception as exc:
            self.log.warning("bad weights announcement", error=str(exc))
            return
        self.st.sched.observe_version(ref.tenant, ref.version)



def _import_model_core() -> None:
    import models.heads  # noqa: F401
    import models.presets  # noqa: F401
    import models.schema  # noqa: F401
    import models.slot  # noqa: F401
