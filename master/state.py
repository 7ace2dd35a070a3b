"""The master's shared context: what its parts (tenants, jobs, workloads, usage, bases,
hosted, uploads) all read and write.

`master.service.Master` builds one `MasterState` and hands it to each part's constructor;
a part reaches the bus, the KV buckets, the scheduler and the records through it, and
another part only through a reference it was given. Nothing here imports a part.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Awaitable, Callable

from nats.js.errors import NotFoundError

from transport.bus import Bus, js_retry
from transport.layout import read_deployment_settings
from actors.runtime import RoleConfig
from actors.tq_read import PartitionReader
from master.fairshare import GateLine
from master.scheduler import Scheduler
from master.store import store_put
from protocol import ops
from protocol.errors import NexusError, NotFound, Unavailable
from protocol.messages import CheckpointRef, InfoRequest, JobRecord, TenantConfig, WorkloadRecord
from protocol.settings import MasterSettings, WorkflowSettings, default_quotas, leases_from_env, retention_from_env
from protocol.subjects import Names, check_token
from protocol.wire import encode

# Lease decisions whose duration `info` summarises (the latest ones).
LEASE_TIMES_KEPT = 4096


class MasterState:
    """Settings, connections, the scheduler and the in-memory records of one master.

    ``spawn``, ``idle``, ``tick`` and ``metric`` are the role's (`actors.runtime.Role`):
    a part starts its loops and reports through them. The bus and the KV handles exist
    once `open` ran (the role's setup)."""

    def __init__(self, cfg: RoleConfig, names: Names, log: Any, tracer: Any, *,
                 spawn: Callable[..., Any], idle: Callable[[str, float], Awaitable[None]],
                 tick: Callable[[str], None], metric: Callable[..., Awaitable[None]]) -> None:
        self.cfg, self.names, self.log, self.tracer = cfg, names, log, tracer
        self.spawn, self.idle, self.tick, self.metric = spawn, idle, tick, metric
        self.bus: Bus | None = None
        self.sched = Scheduler()
        self.lock = asyncio.Lock()  # one job-state change at a time: records stay consistent
        self.leases = leases_from_env()
        self.retention = retention_from_env()
        settings = MasterSettings.from_env()
        self.max_active_rollouts = settings.max_active_rollouts
        self.max_tenants, self.max_active_workloads = settings.max_tenants, settings.max_active_workloads
        self.hosted_wait_s, self.hosted_lease_s = settings.hosted_wait_s, settings.hosted_lease_s  # master/hosted.py
        self.default_quotas = default_quotas()  # a tenant's quotas when the operator set none
        # The modules that register recipes (`Master.setup` imports them): a spec's task may be
        # any kind they declare, as on the env workers that run it.
        self.workflow_modules = WorkflowSettings.from_env().modules
        self.rollouts: dict[str, float] = {}  # "<tenant>/<workload>" -> expiry (unix s)
        self.gate_line = GateLine()  # who takes a free turn when turns are short (by priority)
        self.hosted: dict[str, dict[str, float]] = {}  # hosted env processes' leases (master/hosted.py)
        self.partitions: PartitionReader | None = None  # queue_get's reader (remembers item sequences)
        self.ckpt_refs: dict[str, CheckpointRef] = {}
        self.keys: dict[tuple[str, str], str] = {}  # (tenant, idempotency key) -> job id
        self.workloads: dict[str, WorkloadRecord] = {}
        self.unsaved: dict[str, tuple[str, str]] = {}  # workload -> (state, message) KV refused
        self.starting: set[str] = set()  # workloads whose workflow start is under way (workloads.py)
        # How long the decisions and the start-up took (`info`: bench/scale.py reads them).
        self.lease_decision_s: deque[float] = deque(maxlen=LEASE_TIMES_KEPT)
        self.startup_s: dict[str, float] = {}
        self.deployment: Any = None
        self.kv_tenants: Any = None
        self.kv_workloads: Any = None
        self.kv_jobs: Any = None
        self.kv_versions: Any = None
        self.kv_ckpt: Any = None

    async def open(self, bus: Bus) -> None:
        """Bind the connected bus and open the buckets the parts share."""
        self.bus = bus
        js = bus.js
        self.partitions = PartitionReader(bus, self.names)
        self.kv_tenants = await js_retry(js.key_value, self.names.kv_tenants)
        self.kv_workloads = await js_retry(js.key_value, self.names.kv_workloads)
        self.kv_jobs = await js_retry(js.key_value, self.names.kv_jobs)
        self.kv_versions = await js_retry(js.key_value, self.names.kv_versions)
        self.kv_ckpt = await js_retry(js.key_value, self.names.kv_ckpt_refs)
        self.deployment = await read_deployment_settings(js, self.names)

    # -- lookups and writes every part uses ------------------------------------------------
    def tenant(self, name: str) -> TenantConfig:
        check_token("tenant", name)
        cfg = self.sched.tenants.get(name)
        if cfg is None:
            raise NotFound(f"unknown tenant {name!r}", details={"tenant": name})
        return cfg

    def workload(self, workload: str) -> WorkloadRecord:
        rec = self.workloads.get(workload)
        if rec is None:
            raise NotFound(f"unknown workload {workload!r}", details={"workload": workload})
        return rec

    def job(self, tenant: str, job: str) -> JobRecord:
        self.tenant(tenant)
        check_token("job", job)
        rec = self.sched.jobs.get((tenant, job))
        if rec is None:
            raise NotFound(f"unknown job {job!r} of tenant {tenant!r}", details={"tenant": tenant, "job": job})
        return rec

    async def save(self, job: JobRecord) -> JobRecord:
        self.sched.touch(job)  # before the await: the next lease decision sees the change
        await store_put(self.kv_jobs, f"{job.tenant}.{job.job}", encode(job))
        return job

    async def purge(self, job: JobRecord) -> None:
        assert self.bus is not None
        try:
            # Safe to repeat (a purge of an empty subject is a no-op): rides out a node loss.
            await js_retry(self.bus.js.purge_stream, self.names.tq_stream(job.tenant),
                           subject=self.names.tq_job(job.tenant, job.job))
        except NotFoundError:
            pass  # stream already gone with its tenant: nothing left to purge

    async def alive(self, role: str, instance: str) -> bool:
        """Does this role instance answer? No responder: gone. A timeout counts as alive
        (busy or hung: the health manager's watch decides that)."""
        assert self.bus is not None
        try:
            await self.bus.call(ops.INFO.of(role), InfoRequest(), instance=instance, timeout_s=3)
            return True
        except NexusError as exc:
            return not isinstance(exc, Unavailable)
