"""The master's job part: the training queue's control plane (``reserve``, ``queue_put``,
``mark_ready``, ``lease``, ``job_update``, ``lease_renew``, ``lease_release``,
``checkpoint_get`` / ``checkpoint_commit``, ``job`` / ``jobs``, ``queue_get`` / ``queue_clear``)
and the rollout gate (``rollout_begin`` / ``rollout_end``); table in `master.service`. The
master is the only writer of job records: the scheduler in `MasterState` is authoritative and
every change is written through to the jobs KV."""

from __future__ import annotations

import time
import uuid

from opentelemetry.trace import SpanKind

from transport.bus import js_retry

from transport.layout import publish_tq
from actors.identity import current_caller
from actors.runtime import op
from actors.tracing import carrier, hop_name, messaging, nexus_attrs
from master.fairshare import clamp_priority
from master.store import store_put
from master.state import MasterState
from master.usage import UsageOps
from master.validate import validate_put
from protocol import ops
from protocol.errors import (Busy, Conflict, FailedPrecondition, InvalidField, QuotaExceeded)
from protocol.messages import (
    TERMINAL_JOB_STATES,
    starts_step,
    TERMINAL_WORKLOAD_STATES,
    CheckpointCommitRequest,
    CheckpointGetRequest,
    CheckpointRef,
    LeaseReleaseRequest,
    LeaseRenewReply,
    LeaseRenewRequest,
    JobRecord,
    JobRef,
    JobsReply,
    JobsRequest,
    JobUpdate,
    LeaseReply,
    LeaseRequest,
    Ok,
    QueueGetReply,
    QueueGetRequest,
    QueuePutReply,
    QueuePutRequest,
    ReserveRequest,
)
from protocol.subjects import check_token
from protocol.wire import encode

# Trainer-reported transitions a job may take (besides repeating its current state).
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "leased": ("trained", "failed"),
    "trained": ("exported", "failed"),
    "exported": ("synced",),
    "synced": ("cleared",),
}
EXPIRE_EVERY_S = 1.0
# Rollout gate: 1 active rollout per tenant, NEXUS_MAX_ACTIVE_ROLLOUTS across the deployment;
# a slot not released within the TTL (its workflow died) is reclaimed.
ROLLOUT_TTL_S = 600.0


def new_job_id() -> str:
    # Time-ordered (FIFO by id) and unique across master restarts.
    return f"j{int(time.time() * 1000):013d}{uuid.uuid4().hex[:6]}"




class JobOps:
    """Jobs and their leases, checkpoints and the rollout gate. Quotas come from ``usage_ops``."""

    def __init__(self, st: MasterState, *, usage_ops: UsageOps) -> None:
        self.st, self.usage_ops = st, usage_ops

    # -- training queue ------------------------------------------------------------------
    @op(ops.MASTER_RESERVE)
    async def reserve(self, req: ReserveRequest) -> JobRecord:
        async with self.st.lock:
            tenant = self.st.tenant(req.tenant)
            if req.key:
                known = self.st.keys.get((tenant.name, req.key))
                if known is not None and (tenant.name, known) in self.st.sched.jobs:
                    return self.st.sched.jobs[(tenant.name, known)]  # a retried reserve: the same job
            owner = self.st.workloads.get(req.workload) if req.workload else None
            if owner is not None and owner.state in TERMINAL_WORKLOAD_STATES:
                # Checked under the lock: a cancel sets the state first, then fails the
                # workload's jobs under this lock, so a job is either refused here or failed
                # there, never left reserved by a workflow that had not stopped yet.
                raise FailedPrecondition(f"workload {req.workload} is {owner.state}; it takes no new jobs",
                                         details={"workload": req.workload, "state": owner.state})
            priority = tenant.priority if req.priority is None else req.priority
            self.usage_ops.check_priority(priority, tenant)
            self.st.sched.check_reserve(tenant, req.task, self.usage_ops.quotas(tenant))
            now = time.time()
            job = JobRecord(
                tenant=tenant.name, job=new_job_id(), task=req.task, state="reserved",
                created_at=now, updated_at=now, auto=req.auto,
                priority=priority,
                key=req.key, workload=req.workload,
            )
            self.st.sched.put(job)
            if req.key:
                self.st.keys[(tenant.name, req.key)] = job.job
            return await self.st.save(job)

    @op(ops.MASTER_QUEUE_PUT)
    async def queue_put(self, req: QueuePutRequest) -> QueuePutReply:
        assert self.st.bus is not None
        job = self.st.job(req.tenant, req.job)
        tenant = self.st.tenant(req.tenant)
        if job.state not in ("reserved", "filling"):
            raise FailedPrecondition(f"job {job.job} is {job.state}; data can be added only before mark_ready")
        if req.seq < 0:
            raise InvalidField("seq", "must be >= 0")
        b = validate_put(req, tenant.schema, job.task)
        if job.task == "sft":
            self.st.sched.check_sft_prefetch(tenant, adding=1)
        subject = self.st.names.tq_job(req.tenant, req.job)
        # A PRODUCER span per stored micro-batch; its context goes into the message headers,
        # kept in the stream with the data (and the first one into the job record, which the
        # trainer reads at the lease): the trainer's work on the job joins this trace.
        with self.st.tracer.start_as_current_span(hop_name(subject, "publish"), kind=SpanKind.PRODUCER,
                                               attributes={**messaging(subject, "send"), **nexus_attrs(req),
                                                           "nexus.seq": req.seq}):
            context = carrier()
            ack = await publish_tq(
                self.st.bus.js, self.st.names, req.tenant, subject, encode(req),
                headers={"Nats-Msg-Id": f"{req.job}:{req.seq}", **context}, settings=self.st.deployment,
            )
        # The partition itself says how many micro-batches the job holds: right even when a
        # master died between this publish and saving the record, and the client's retry
        # came back as a duplicate.
        info = await js_retry(self.st.bus.js.stream_info, self.st.names.tq_stream(req.tenant),  # rides out a node loss
                              subjects_filter=self.st.names.tq_job(req.tenant, req.job))
        in_stream = (info.state.subjects or {}).get(self.st.names.tq_job(req.tenant, req.job), 0)
        async with self.st.lock:
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
                await self.st.save(job)
        if closed:
            if job.state in TERMINAL_JOB_STATES:
                await self.st.purge(job)  # its partition was purged before this message landed
            # A sealed job keeps the micro-batches it was sealed with: the trainer reads only
            # the first `items` of the partition, so the late one is never trained.
            raise FailedPrecondition(f"job {job.job} became {job.state} while this micro-batch was stored; "
                                     "it is not part of the job")
        return QueuePutReply(tenant=job.tenant, job=job.job, items=job.items, duplicate=bool(ack.duplicate))

    @op(ops.MASTER_MARK_READY)
    async def mark_ready(self, req: JobRef) -> JobRecord:
        assert self.st.bus is not None
        async with self.st.lock:
            job = self.st.job(req.tenant, req.job)
            if job.state == "ready":
                return job
            if job.state != "filling" or job.items == 0:
                raise FailedPrecondition(f"job {job.job} is {job.state} with {job.items} items; put data first")
            job.state = "ready"
            job.ready_at = job.updated_at = time.time()
            await self.st.save(job)
        await self.st.bus.nc.publish(self.st.names.sched_ready, b"")
        return job

    @op(ops.MASTER_LEASE)
    async def lease(self, req: LeaseRequest) -> LeaseReply:
        check_token("trainer", req.trainer)
        if not 1 <= req.max_jobs <= 256:
            raise InvalidField("max_jobs", "must be in 1..256")
        async with self.st.lock:
            now = time.time()
            for job in self.st.sched.expire_leases(now):
                await self.st.save(job)
            if req.job:
                job = self.st.job(req.tenant, req.job)
                if job.state != "ready" and not (job.state in ("trained", "exported", "synced") and not job.lease_owner):
                    raise FailedPrecondition(f"job {job.job} is {job.state}, not ready to train")
                if self.st.sched.is_stale(job):
                    self.st.sched._drop_stale(job, now)
                    await self.st.save(job)
                    return LeaseReply(jobs=[], dropped_stale=[job])
                self.st.sched.lease_one(job, req.trainer, req.lease_s, now)
                leased, stale = [job], []
            else:
                started = time.perf_counter()
                leased, stale = self.st.sched.pick(req.trainer, req.max_jobs, req.lease_s, now)
                self.st.lease_decision_s.append(time.perf_counter() - started)
            try:
                for job in (*leased, *stale):
                    await self.st.save(job)
            except Exception:
                # Not recorded, not handed out: the trainer gets the error, so nobody may hold
                # these in memory either (they would wait for the lease to run out).
                for job in leased:
                    self.st.sched.release(job, time.time(), reason="lease not recorded", count_attempt=False)
                raise
        for job in stale:
            await self.st.purge(job)
            await self.st.metric("dropped_stale", job.tenant, self.st.sched.dropped_stale.get(job.tenant, 0))
            self.st.log.warning("dropped stale job", tenant=job.tenant, job=job.job, reason=job.reason)
        return LeaseReply(jobs=leased, dropped_stale=stale)

    @op(ops.MASTER_JOB_UPDATE)
    async def job_update(self, req: JobUpdate) -> JobRecord:
        async with self.st.lock:
            job = self.st.job(req.tenant, req.job)
            if job.state == req.state and (job.lease_owner in ("", req.trainer)):
                return job  # a retried report
            if not self.st.sched.holds(job, req.trainer, req.lease_epoch):
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
                self.st.sched.observe_version(job.tenant, req.trained_version)
            if req.reason:
                job.reason = req.reason
            job.metrics.update(req.metrics)
            if req.state in TERMINAL_JOB_STATES:
                job.lease_owner, job.lease_expires_at = "", 0.0
            await self.st.save(job)
        if req.state in TERMINAL_JOB_STATES:
            await self.st.purge(job)
        return job

    @op(ops.MASTER_LEASE_RENEW)
    async def lease_renew(self, req: LeaseRenewRequest) -> LeaseRenewReply:
        check_token("trainer", req.trainer)
        if len(req.jobs) != len(req.epochs):
            raise InvalidField("epochs", f"has {len(req.epochs)} entries for {len(req.jobs)} jobs")
        if not 0 < req.lease_s <= 3600:
            raise InvalidField("lease_s", "must be in (0, 3600]")
        held, lost = [], []
        async with self.st.lock:
            now = time.time()
            for ref, epoch in zip(req.jobs, req.epochs):
                job = self.st.sched.jobs.get((ref.tenant, ref.job))
                if job is not None and self.st.sched.renew(job, req.trainer, epoch, req.lease_s, now):
                    await self.st.save(job)  # a restarted master must not expire a renewed lease
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
        async with self.st.lock:
            now = time.time()
            for ref, epoch in zip(req.jobs, req.epochs):
                job = self.st.sched.jobs.get((ref.tenant, ref.job))
                if job is not None and self.st.sched.holds(job, req.trainer, epoch):
                    self.st.sched.release(job, now, reason=f"released by {req.trainer}: {req.reason}",
                                       count_attempt=False)
                    await self.st.save(job)
                    released += 1
        if released and self.st.bus is not None:
            await self.st.bus.nc.publish(self.st.names.sched_ready, b"")
        return Ok(detail=f"released {released} of {len(req.jobs)} jobs")

    @op(ops.MASTER_CHECKPOINT_GET)
    async def checkpoint_get(self, req: CheckpointGetRequest) -> CheckpointRef:
        self.st.tenant(req.tenant)
        return self.st.ckpt_refs.get(req.tenant) or CheckpointRef(tenant=req.tenant, object_name="")

    @op(ops.MASTER_CHECKPOINT_COMMIT)
    async def checkpoint_commit(self, req: CheckpointCommitRequest) -> CheckpointRef:
        self.st.tenant(req.tenant)
        check_token("trainer", req.trainer)
        async with self.st.lock:
            ref = CheckpointRef(tenant=req.tenant, object_name=req.object_name, step=req.step,
                                version=req.version, updated_at=time.time())
            await self._move_checkpoint(req.tenant, req.base_checkpoint, ref)
        return ref

    async def _move_checkpoint(self, tenant: str, base: str, ref: CheckpointRef) -> None:
        """Compare-and-set of the tenant's checkpoint pointer (under the master's lock)."""
        current = self.st.ckpt_refs.get(tenant)
        current_name = current.object_name if current else ""
        if current_name == ref.object_name:
            return  # a retried commit
        if current_name != base:
            raise Conflict(
                f"tenant {tenant}'s checkpoint moved to {current_name or 'none'} while this state was built on "
                f"{base or 'none'}: reload and retry", details={"tenant": tenant, "checkpoint": current_name})
        await store_put(self.st.kv_ckpt, tenant, encode(ref))
        self.st.ckpt_refs[tenant] = ref

    # -- rollout gate: the tenant's max_active_rollouts quota (1) and 3 in all ---------------
    @op(ops.MASTER_ROLLOUT_BEGIN)
    async def rollout_begin(self, req: JobRef) -> Ok:
        """A workflow asks to start collecting a rollout batch (``job`` = its workload id).
        Access ``tenant``: a hosted env process (docs/hosted_envs.md) takes its own tenant's
        turns, for a workload of its tenant that runs; the platform's workflows any."""
        self.st.tenant(req.tenant)
        self._check_rollout_workload(req)
        now = time.time()
        # A workflow that died mid-rollout must not hold its slot forever.
        self.st.rollouts = {k: v for k, v in self.st.rollouts.items() if v > now}
        key = f"{req.tenant}/{req.job}"
        if key in self.st.rollouts:
            self.st.rollouts[key] = now + ROLLOUT_TTL_S
            return Ok(detail="already active")
        active_tenant = [k for k in self.st.rollouts if k.split("/", 1)[0] == req.tenant]
        limit = self.usage_ops.quotas(self.st.tenant(req.tenant)).max_active_rollouts
        if len(active_tenant) >= limit:
            raise QuotaExceeded.of("max_active_rollouts", limit,
                                   f"tenant {req.tenant!r} has {len(active_tenant)} rollouts active", 0.2,
                                   tenant=req.tenant, active=len(active_tenant))
        # Priority routes the deployment's turns (docs/scaling.md, "Priority that routes"): a
        # free turn goes to the best-ranked waiter (fair share by priority), not the fastest retry.
        cfg = self.st.tenant(req.tenant)
        priority = clamp_priority(cfg.priority, self.usage_ops.quotas(cfg).max_priority)
        holding: dict[str, int] = {}
        for k in self.st.rollouts:
            holding[k.split("/", 1)[0]] = holding.get(k.split("/", 1)[0], 0) + 1
        blocked = {t for t, n in holding.items()
                   if t in self.st.sched.tenants and n >= self.usage_ops.quotas(self.st.sched.tenants[t]).max_active_rollouts}
        free = self.st.max_active_rollouts - len(self.st.rollouts)
        ahead = self.st.gate_line.ask(key, req.tenant, priority, free, now, blocked)
        if free <= 0 or ahead >= free:
            self.st.gate_line.settle(set(holding))
            why = (f"{len(self.st.rollouts)} rollouts active (the deployment's cap is {self.st.max_active_rollouts})"
                   if free <= 0 else f"the {free} free rollout turn(s) go to {ahead} waiting rollouts ranked before "
                   f"this one (fair share by priority; this tenant's priority {priority})")
            raise Busy(why, details={"retry_after_s": 0.2, "waiting_ahead": ahead})
        self.st.rollouts[key] = now + ROLLOUT_TTL_S
        self.st.gate_line.settle(set(holding) | {req.tenant})
        return Ok(detail="granted")

    def _check_rollout_workload(self, req: JobRef) -> None:
        if current_caller().is_platform:
            return
        rec = self.st.workloads.get(req.job)
        if rec is None or rec.tenant != req.tenant or rec.state != "running":
            raise FailedPrecondition(f"tenant {req.tenant!r} has no running workload {req.job!r}: a rollout turn is "
                                     "taken for a running workload of the caller's own tenant",
                                     details={"workload": req.job})

    @op(ops.MASTER_ROLLOUT_END)
    async def rollout_end(self, req: JobRef) -> Ok:
        self.st.rollouts.pop(f"{req.tenant}/{req.job}", None)
        self.st.gate_line.settle({k.split("/", 1)[0] for k in self.st.rollouts})
        return Ok(detail="released")

    @op(ops.MASTER_JOB)
    async def job(self, req: JobRef) -> JobRecord:
        return self.st.job(req.tenant, req.job)

    @op(ops.MASTER_JOBS)
    async def jobs(self, req: JobsRequest) -> JobsReply:
        if req.tenant:
            self.st.tenant(req.tenant)
        from master.paging import name_key, page

        out = [(name_key(j.tenant, j.job), j) for j in self.st.sched.jobs.values()
               if (not req.tenant or j.tenant == req.tenant) and (not req.states or j.state in req.states)]
        jobs, cursor = page(out, req.limit, req.cursor, self.st.bus.max_payload, lambda j: len(encode(j)))
        return JobsReply(jobs=jobs, next_cursor=cursor)

    @op(ops.MASTER_QUEUE_GET)
    async def queue_get(self, req: QueueGetRequest) -> QueueGetReply:
        job = self.st.job(req.tenant, req.job)
        if req.start < 0 or req.max_items < 1:
            raise InvalidField("start", "start must be >= 0 and max_items >= 1")
        assert self.st.bus is not None
        # A reply must fit the max payload too: return a prefix of the range; the caller
        # pages on with start += len(items).
        budget = int(self.st.bus.max_payload * 0.9)
        items: list[QueuePutRequest] = []
        for item in await self.st.partitions.read(job, req.start, req.max_items):
            size = len(encode(item))
            if items and size > budget:
                break
            budget -= size
            items.append(item)
        return QueueGetReply(tenant=job.tenant, job=job.job, items=items, total=job.items)

    @op(ops.MASTER_QUEUE_CLEAR)
    async def queue_clear(self, req: JobRef) -> JobRecord:
        async with self.st.lock:
            job = self.st.job(req.tenant, req.job)
            if job.state not in TERMINAL_JOB_STATES:
                if job.state in ("trained", "exported", "synced"):
                    job.state = "cleared"
                else:
                    job.state, job.reason = "failed", f"cleared by a client while {job.state}"
                job.lease_owner, job.lease_expires_at, job.updated_at = "", 0.0, time.time()
                await self.st.save(job)
        await self.st.purge(job)
        return job

    # -- background ----------------------------------------------------------------------
    async def expire_loop(self) -> None:
        while True:
            await self.st.idle("lease-expiry", EXPIRE_EVERY_S)
            orphans: list[JobRecord] = []
            sealed = False
            async with self.st.lock:
                now = time.time()
                for job in self.st.sched.expire_leases(now):
                    self.st.log.warning("lease expired", tenant=job.tenant, job=job.job, state=job.state)
                    await self.st.save(job)
                for job in self.st.sched.orphans(now, self.st.leases.orphan_ttl_s):
                    why = f"idle for {self.st.leases.orphan_ttl_s:g} s while {job.state}: its workflow is gone"
                    if job.state == "filling" and job.items > 0:
                        self._seal(job, now, why)  # what was acknowledged is trained
                        sealed = True
                    else:
                        job.reason = why + "; it held no data"
                        job.state, job.updated_at = "failed", now
                        orphans.append(job)
                    self.st.log.warning("orphan job expired", tenant=job.tenant, job=job.job, state=job.state)
                    await self.st.save(job)
            for job in orphans:
                await self.st.purge(job)
            if sealed and self.st.bus is not None:
                await self.st.bus.nc.publish(self.st.names.sched_ready, b"")

    async def fail_unready_jobs(self, workload: str, reason: str, states: tuple[str, ...] = ("reserved", "filling"),
                                seal: bool = True) -> int:
        """A workload's workflow stopped (crash, handback; or a cancel, ``seal=False``): its
        jobs it can no longer complete leave the in-flight cap at once. With ``seal``, a job
        that already holds micro-batches is marked ready with what it has (every acknowledged
        micro-batch is trained: each is a whole optimizer step of its own); an empty one fails
        (it holds nothing). A cancel fails them all."""
        failed: list[JobRecord] = []
        sealed = 0
        async with self.st.lock:
            now = time.time()
            for job in self.st.sched.live_jobs():
                if job.workload != workload or job.state not in states:
                    continue
                if seal and job.state == "filling" and job.items > 0:
                    self._seal(job, now, reason)
                    sealed += 1
                else:
                    job.state, job.reason, job.updated_at = "failed", reason, now
                    job.lease_owner, job.lease_expires_at = "", 0.0
                    failed.append(job)
                await self.st.save(job)
        for job in failed:
            await self.st.purge(job)
        if sealed and self.st.bus is not None:
            await self.st.bus.nc.publish(self.st.names.sched_ready, b"")
        return len(failed) + sealed

    @staticmethod
    def _seal(job: JobRecord, now: float, reason: str) -> None:
        job.state, job.ready_at, job.updated_at = "ready", now, now
        job.reason = f"sealed with its {job.items} micro-batches: {reason}"

    async def release_trainer(self, instance: str, reason: str) -> None:
        released = 0
        async with self.st.lock:
            now = time.time()
            for job in self.st.sched.live_jobs():
                if job.lease_owner == instance and job.state not in TERMINAL_JOB_STATES:
                    self.st.sched.release(job, now, reason=reason)
                    self.st.log.warning("released job", tenant=job.tenant, job=job.job, state=job.state, reason=reason)
                    await self.st.save(job)
                    released += 1
        if released and self.st.bus is not None:
            await self.st.bus.nc.publish(self.st.names.sched_ready, b"")

    async def release_dead_owners(self) -> None:
        """At start: jobs leased by trainers that are gone (a `nexus down` that stopped the
        master before its trainer, a crash while no master ran) go back at once, not after
        their lease runs out."""
        owners = {j.lease_owner for j in self.st.sched.live_jobs()
                  if j.lease_owner and j.state not in TERMINAL_JOB_STATES}
        for owner in owners:
            if await self.st.alive("trainer", owner):
                continue
            await self.release_trainer(owner, f"trainer {owner} is gone (found at master start)")
