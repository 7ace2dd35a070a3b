"""Trainer (Training Model Service): resident base(s), many tenant slots, the training loop.

The loop is continuous (iteration-level scheduling, `actors.trainer.train_loop`): a running group of at
most ``group_max`` jobs (one per tenant) takes one grouped step at a time, the next micro-batch
of every job, canonicalised at that step; compatible tenants share one base forward
(`models.train_step(grouped=True)`). A job whose last micro-batch is done leaves the group at
once and, per job, in the background:
commit (a new checkpoint object with the applied job ids; the master moves the tenant's
checkpoint pointer when it accepts ``trained`` under the job's lease epoch) -> export payload +
manifest -> ``exported`` -> announce the version on ``<prefix>.weights.<tenant>`` -> ``synced``
-> purge the partition -> ``cleared``; the next ready job the master's scheduler picks joins at
the next step. Leases are renewed per job from lease to clear (a job whose lease was lost is
dropped, never committed); a job already in the slot's applied ids is not trained again (a
redelivery after a crash); a drain stops leasing at once and, past ``Leases.drain_finish_s``,
releases every job not yet trained.

An exception in one tenant's job restores that tenant's slot from its checkpoint and fails
the job with the reason; every other tenant goes on. Low-level ops for custom algorithms:
``train_batch`` (train one job now), ``export_params``, ``load_weights``.

Run: ``python -m actors.run trainer --nats-url nats://127.0.0.1:4222``
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from actors.budget import budget_bytes
from transport.bus import js_retry, retry, retry_through_outage
from actors.identity import require_tenant
from actors.metering import Meter, final_flush, flush_loop
from actors.runtime import Role, RoleConfig, device_memory_bytes, op
from actors.trainer.slots import Resident, SlotStore
from actors.trainer.torch_thread import TorchThread
from actors.tracing import JobSpans
from actors.tq_read import read_job_items
from actors.trainer.train_loop import TrainLoop, Work
from actors.trainer.ranks import RankLost
from actors.trainer.step import run_step
from protocol import ops
from protocol.errors import Busy, Conflict, FailedPrecondition, NexusError, NotFound
from protocol.messages import (
    is_slot_reset,
    CheckpointCommitRequest,
    LeaseReleaseRequest,
    LeaseRenewRequest,
    ExportRequest,
    GetTenantRequest,
    InitWeightsRequest,
    JobRecord,
    JobRef,
    JobUpdate,
    LeaseRequest,
    LoadWeightsRequest,
    Ok,
    QueuePutRequest,
    TenantConfig,
    TrainBatchReply,
    WeightsRef,
)
from protocol.policy import DRAIN_RELEASE
from protocol.settings import FAULT_POINTS, BaseImageSettings, TrainerSettings, leases_from_env, usage_flush_from_env
from protocol.subjects import check_token

# Fault injection for the exactly-once tests: SIGKILL this process at the named point of the
# first job it handles (FAULT_POINTS, in lifecycle order).
FAULT_ENV = TrainerSettings.model_fields["fault"].alias
_ENV_DEFAULTS = TrainerSettings()
# export_params / load_weights wait this long for the tenant's job on this trainer to clear.
QUIET_WAIT_S = 60.0
# Exit status after a lost data-parallel rank (actors/trainer/ranks.py): restarted like a crash.
EXIT_RANK_LOST = 75  # EX_TEMPFAIL


@dataclass
class TrainerConfig:
    # Jobs (tenants) per round, and the lease (defaults and reasons: protocol.settings).
    group_max: int = _ENV_DEFAULTS.group_max
    lease_s: float = _ENV_DEFAULTS.lease_s
    idle_poll_s: float = 1.0
    cohort_wait_s: float = _ENV_DEFAULTS.cohort_wait_s  # a new group's wait for the rest of its lease
    max_on_device: int = 16  # slots kept on the accelerator; the rest wait in CPU memory
    device: str | None = None  # None: cuda if available, else cpu
    fast: bool = _ENV_DEFAULTS.fast  # the fast engine for the base forwards on CUDA
    compile: bool = _ENV_DEFAULTS.compile  # with fast: torch.compile its blocks
    image_size: int | None = None  # the base's canonical resolution (NEXUS_BASE_IMAGE_SIZE); None: its own
    # MiB of tenant slots in memory (0: no budget); past it idle slots go back to their checkpoint.
    slot_budget_mb: float = _ENV_DEFAULTS.slot_budget_mb
    ranks: int = _ENV_DEFAULTS.ranks  # data-parallel ranks (actors/trainer/ranks.py); 1: one process
    rank_timeout_s: float = _ENV_DEFAULTS.rank_timeout_s

    @classmethod
    def from_env(cls) -> TrainerConfig:
        env = TrainerSettings.from_env()
        return cls(group_max=env.group_max, lease_s=env.lease_s, device=env.device, fast=env.fast,
                   compile=env.compile, slot_budget_mb=env.slot_budget_mb, cohort_wait_s=env.cohort_wait_s,
                   ranks=env.ranks, rank_timeout_s=env.rank_timeout_s,
                   image_size=BaseImageSettings.from_env().image_size)


class Trainer(Role):
    name = "trainer"

    def __init__(self, cfg: RoleConfig, tcfg: TrainerConfig | None = None) -> None:
        super().__init__(cfg)
        self.tcfg = tcfg or TrainerConfig.from_env()
        self.fault = TrainerSettings.from_env().fault or ""
        self.leases = leases_from_env()
        self.store: SlotStore | None = None
        # One grouped step at a time on the accelerator; export_params / load_weights go between.
        self.compute = asyncio.Lock()
        self.loop = self._new_loop()
        self._loop_done = asyncio.Event()
        self._drain_started: float | None = None
        self._held: dict[str, JobRecord] = {}  # job id -> record: the leases being renewed
        self.lost_jobs: set[str] = set()  # jobs whose lease the renewer found lost
        self.jobs_done = 0
        self.busy_s = 0.0  # seconds in grouped train steps (the device's busy time)
        self.micro_batches = 0  # tenant micro-batches trained (a step of 4 jobs is 4): the unit of work
        self.leases_lost = 0
        self.released = 0
        # Grouped steps whose one base forward held LoRA and frozen-base tenants together.
        self.mixed_lora_steps = 0
        # Grouped steps whose one base forward (and its prefix KV cache) held action-expert and
        # other tenants together.
        self.mixed_expert_steps = 0
        # Metered device time: every grouped step's busy time, charged to its tenants by rows.
        self.usage_flush = usage_flush_from_env()
        self.meter = Meter({"train": self.usage_flush.train_overhead_rows,
                            "infer": self.usage_flush.infer_overhead_rows})
        self.job_spans = JobSpans(self.tracer, self.names)  # a trace per job (actors/tracing.py)
        self.ranks: Any = None  # actors.trainer.ranks.RankGroup when tcfg.ranks > 1

    async def setup(self) -> None:
        assert self.bus is not None
        import torch

        torch.set_num_threads(1)
        self.store = SlotStore(self.bus, self.names, device=self.tcfg.device,
                               max_on_device=self.tcfg.max_on_device, fast=self.tcfg.fast,
                               compile=self.tcfg.compile, image_size=self.tcfg.image_size,
                               budget_bytes=budget_bytes(self.tcfg.slot_budget_mb),
                               in_use=lambda tenant: self.loop.busy(tenant), log=self.log,
                               torch_thread=TorchThread(log=self.log))
        if self.tcfg.ranks > 1:
            await self._start_ranks()
        await self.bus.nc.subscribe(self.names.sched_ready, cb=self._on_ready)
        await self.bus.nc.subscribe(self.names.tenant_deleted_all, cb=self._on_tenant_deleted)
        self.spawn(self._loop, "train-loop", critical=True)
        self.spawn(lambda: flush_loop(self, self.meter, self.usage_flush), "usage-flush", critical=True)

    async def _start_ranks(self) -> None:
        """This process becomes rank 0 of ``tcfg.ranks`` (actors/trainer/ranks.py): the workers
        start now and the group forms before the role says ready."""
        import torch

        from actors.trainer.ranks import RankGroup, RankSpec

        device = self.tcfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda"):
            if torch.cuda.device_count() < self.tcfg.ranks:
                raise FailedPrecondition(
                    f"NEXUS_TRAINER_RANKS={self.tcfg.ranks} needs a CUDA device per rank; this trainer sees "
                    f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
            device = "cuda:0"  # rank r on cuda:r of this trainer's visible devices
            self.tcfg.device = device
        self.ranks = RankGroup(RankSpec(world=self.tcfg.ranks, device=device, timeout_s=self.tcfg.rank_timeout_s),
                               log=self.log)
        self.ranks.spawn()
        # The group forms in a daemon thread (init_process_group blocks until every rank joins):
        # a rank that dies first fails the setup now, not at the timeout, and the blocked thread
        # does not hold the process's exit.
        loop = asyncio.get_running_loop()
        formed: asyncio.Future = loop.create_future()

        def join() -> None:
            try:
                self.ranks.join()
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop
                loop.call_soon_threadsafe(lambda e=exc: formed.done() or formed.set_exception(e))
            else:
                loop.call_soon_threadsafe(lambda: formed.done() or formed.set_result(None))

        threading.Thread(target=join, name="trainer-ranks-join", daemon=True).start()
        while not formed.done():
            dead = [(p.pid, p.returncode) for p in self.ranks.procs if p.poll() is not None]
            if dead:
                raise FailedPrecondition(f"trainer rank process(es) {dead} (pid, status) exited before the ranks "
                                         "formed their group; their lines in this log say why")
            await asyncio.wait({formed}, timeout=0.5)
        formed.result()

    def info_extra(self) -> dict[str, Any]:
        return {"jobs_done": self.jobs_done, "leases_lost": self.leases_lost, "released": self.released,
                "mixed_lora_steps": self.mixed_lora_steps, "mixed_expert_steps": self.mixed_expert_steps,
                "round": self.loop.held(), "steps": self.loop.steps, "micro_batches": self.micro_batches,
                "running": {j: w.cursor for j, w in self.loop.running.items()},  # job -> micro-batches done
                "joined_running": self.loop.joined_running,
                "slots": self.store.memory_report() if self.store else {},
                "bases": sorted(self.store.bases) if self.store else [],
                # NEXUS_TRAINER_SLOT_BUDGET_MB: bytes resident, slots evicted / restored so far.
                "slot_budget": self.store.budget_report() if self.store else {},
                "usage": self.meter.info(),
                "ranks": self.ranks.info() if self.ranks is not None else {"world": 1}}

    def heartbeat_gauges(self) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        gauges, per_tenant = super().heartbeat_gauges()
        gauges.update(busy_s=self.busy_s, group_size=float(len(self.loop.running)),
                      jobs_done=float(self.jobs_done))
        if self.store is not None:
            gauges["device_memory_bytes"] = float(device_memory_bytes(self.store.device))
            gauges.update(slot_bytes=float(self.store.resident_bytes()), slot_evictions=float(self.store.evictions),
                          slot_restores=float(self.store.restores))
        return gauges, per_tenant

    async def _on_ready(self, msg: Any) -> None:
        self.loop.poke()

    async def _on_tenant_deleted(self, msg: Any) -> None:
        tenant = msg.subject.rsplit(".", 1)[-1]
        if self.store is not None and tenant in self.store.resident:
            self.log.info("tenant slot dropped (tenant deleted)", tenant=tenant)
        if self.store is not None:
            self.store.forget(tenant)
        if not is_slot_reset(msg.data):  # a reset keeps the tenant's usage: its unsent deltas too
            self.meter.forget(tenant)

    def fault_point(self, point: str) -> None:
        assert point in FAULT_POINTS, point  # a point the settings do not list could never fire
        if self.fault == point:
            self.log.warning("fault injection: SIGKILL", point=point)
            os.kill(os.getpid(), signal.SIGKILL)

    # -- the loop (actors.trainer.train_loop) and what it calls: its `LoopHost` ----------------------
    def _new_loop(self) -> TrainLoop:
        return TrainLoop(self, group_max=self.tcfg.group_max, idle_poll_s=self.tcfg.idle_poll_s,
                         cohort_wait_s=self.tcfg.cohort_wait_s)

    async def _loop(self) -> None:
        assert self.bus is not None
        self._loop_done.clear()  # a restarted loop (critical: restarted after a failure)
        self.loop = self._new_loop()
        try:
            await self.loop.run()
        finally:
            self._loop_done.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def hold(self, job: JobRecord) -> None:
        """Renew ``job``'s lease from now until `unhold` (its clear, failure, loss or release);
        its trace span opens (a child of its queued data)."""
        self._held[job.job] = job
        self.job_spans.open([job], self.tcfg.lease_s)

    def unhold(self, job_id: str) -> None:
        job = self._held.pop(job_id, None)
        self.lost_jobs.discard(job_id)
        if job is not None:
            self.job_spans.close([job])

    async def _tenant(self, name: str) -> TenantConfig:
        assert self.bus is not None
        return await retry_through_outage(self.bus.call, ops.MASTER_TENANT_GET,
                                          GetTenantRequest(tenant=name), timeout_s=10)

    async def slot_for(self, job: JobRecord) -> Resident:
        """The job's tenant slot, brought up to its committed checkpoint."""
        assert self.store is not None
        return await self.store.slot(await self._tenant(job.tenant))

    async def reload_slot(self, tenant: str) -> None:
        """The tenant's slot back at its committed checkpoint (a job dropped, failed or released)."""
        assert self.store is not None
        await self.store.reload(tenant)

    def trim_slots(self, keep: set[str]) -> None:
        """Idle slots off the device, and past the memory budget out of memory (not ``keep``'s)."""
        assert self.store is not None
        self.store.offload_idle(keep=keep)
        self.store.enforce_budget(keep=keep)

    async def lease_jobs(self, max_jobs: int) -> list[JobRecord]:
        """Up to ``max_jobs`` ready jobs, picked by the master's scheduler, leased to this trainer."""
        assert self.bus is not None
        reply = await self.bus.call(
            ops.MASTER_LEASE,
            LeaseRequest(trainer=self.instance, max_jobs=max_jobs, lease_s=self.tcfg.lease_s), timeout_s=10)
        return reply.jobs

    async def read_items(self, job: JobRecord) -> list[QueuePutRequest]:
        """The job's micro-batches from its tenant's training-queue partition."""
        assert self.bus is not None
        return await read_job_items(self.bus, self.names, job, 0, job.items)

    def stage(self, job: JobRecord, name: str) -> Any:
        """A stage span of ``job`` (`actors.tracing.JOB_STAGES`), current inside the block."""
        return self.job_spans.stage(job, name)

    def drain_overdue(self) -> bool:
        if not self._stop.is_set():
            return False
        if self._drain_started is None:
            self._drain_started = time.monotonic()
            self.log.info("draining: finishing the running jobs", finish_s=self.leases.drain_finish_s)
        return time.monotonic() - self._drain_started > self.leases.drain_finish_s

    def count_lost(self, job: JobRecord, why: str) -> None:
        self.leases_lost += 1
        self.log.warning("commit refused; job left to its current owner", tenant=job.tenant, job=job.job, error=why)

    async def renew_loop(self) -> None:
        """Extend the leases of the held jobs every ``renew_every_s`` (at most a quarter of the
        lease); a job the master says is lost is dropped, never committed."""
        assert self.bus is not None
        every = min(self.leases.renew_every_s, self.tcfg.lease_s / 4)
        while True:
            await asyncio.sleep(every)
            held = [j for j in self._held.values() if j.job not in self.lost_jobs]
            if not held:
                continue
            req = LeaseRenewRequest(trainer=self.instance, jobs=[JobRef(tenant=j.tenant, job=j.job) for j in held],
                                    epochs=[j.lease_epoch for j in held], lease_s=self.tcfg.lease_s)
            try:
                reply = await self.bus.call(ops.MASTER_LEASE_RENEW, req, timeout_s=10)
            except NexusError as exc:
                # The master is restarting: keep training; the commit fence decides in the end.
                self.log.warning("lease renewal failed", error=exc.message)
                continue
            for job in held:
                if job.job in reply.lost and job.job in self._held:
                    self.lost_jobs.add(job.job)
                    self.leases_lost += 1
                    self.log.warning("lease lost; dropping the job", tenant=job.tenant, job=job.job)

    async def release(self, jobs: list[JobRecord], reason: str) -> None:
        """Hand jobs back (drain): nothing of them is committed by this trainer."""
        assert self.bus is not None
        for job in jobs:
            self.unhold(job.job)
        if not jobs:
            return
        req = LeaseReleaseRequest(trainer=self.instance, jobs=[JobRef(tenant=j.tenant, job=j.job) for j in jobs],
                                  epochs=[j.lease_epoch for j in jobs], reason=reason)
        try:
            await retry(self.bus.call, ops.MASTER_LEASE_RELEASE, req, timeout_s=5,
                        policy=DRAIN_RELEASE)
            self.released += len(jobs)
            self.log.info("released jobs", jobs=[j.job for j in jobs], reason=reason)
        except NexusError as exc:
            # The master is gone too: its successor releases a gone trainer's jobs at start.
            self.log.warning("could not release jobs", error=exc.message, jobs=[j.job for j in jobs])

    async def train_step(self, group: list[Work]) -> None:
        """One grouped step of the running group, off the event loop. Its `trainer.round` span
        (one per step, linked to the running jobs' spans) is the trainer's busy timeline in the
        traces (sdk/report.py); each job's trace gets a `job.step`."""
        assert self.store is not None
        bases = {w.tenant: self.store.bases[w.res.config.base] for w in group if w.res is not None}
        from opentelemetry import trace

        links = [trace.Link(self.job_spans.spans[w.job.job].get_span_context())
                 for w in group if w.job.job in self.job_spans.spans]
        with self.tracer.start_as_current_span("trainer.round", attributes={
                "nexus.tenants": ",".join(sorted(w.tenant for w in group)), "nexus.jobs": len(group)}, links=links), \
                self.job_spans.steps([w.job for w in group], self.loop.steps):
            started = time.perf_counter()
            try:
                await self.store.torch.run(run_step, self, group, bases)
            except RankLost as exc:
                # Its communicator is broken and the ranks may differ: this trainer cannot go on.
                # Exiting now is a lost trainer (its leases lapse, its jobs resume from their
                # committed checkpoints on the next one), as docs/data_parallel.md says.
                self.log.error("a trainer rank was lost; exiting", error=str(exc), exit_status=EXIT_RANK_LOST)
                os._exit(EXIT_RANK_LOST)
            self.busy_s += time.perf_counter() - started  # the device's share: nexus top, /metrics

    async def finish(self, w: Work) -> None:
        """Commit -> trained -> export -> exported -> announce -> synced -> cleared.

        A job handed over half-finished (its trainer died) resumes after its current state."""
        assert self.store is not None and self.bus is not None
        job, tenant = w.job, w.job.tenant
        metrics = w.summary()
        version = w.res.slot.policy_version
        with self.job_spans.stage(job, "job.commit"):
            if _before(job.state, "trained"):
                if not w.skip:
                    # A new object nobody points at yet; the master's acceptance below is the commit.
                    name = await self.store.write_checkpoint(tenant, f"{job.job}-e{job.lease_epoch}")
                    self.fault_point("after_commit")
                    try:
                        await self._update(job, "trained", version, metrics, checkpoint=name,
                                           base_checkpoint=w.res.checkpoint_name)
                    except NexusError:  # refused (lease lost) or its tenant is gone: nobody points at it
                        await self.store.delete_checkpoint(name)
                        raise
                    await self.store.committed_as(tenant, name)
                else:
                    await self._update(job, "trained", version, metrics)
        self.fault_point("after_trained")
        # outputs.export_every_steps: between exports a job still walks trained -> exported ->
        # synced -> cleared (its lifecycle stays whole), it just announces no new version.
        every = w.res.config.export_every_steps
        exported = await self._exported_version(tenant) if every > 0 else -1
        ref = None
        if _before(job.state, "exported"):
            if every <= 0 or version - max(exported, 0) >= every:
                with self.job_spans.stage(job, "job.export"):  # its announcement: job.announce
                    ref = await self.store.export(tenant, metrics)
                self.meter.add_bytes(tenant, job.workload, ref.size)
            else:
                self.log.debug("export skipped", tenant=tenant, job=job.job, version=version,
                               last_export=exported, export_every_steps=every)
            await self._advance(job, "exported", version)
            self.fault_point("after_export")
        elif every <= 0 or exported == version:
            # Exported by a trainer that died before announcing: announce again (same version).
            with self.job_spans.stage(job, "job.export"):
                ref = await self.store.export(tenant, metrics)
        with self.job_spans.stage(job, "job.sync"):
            if _before(job.state, "synced"):
                await self._advance(job, "synced", version)
                self.fault_point("after_synced")
            await self._advance(job, "cleared", version)
        self.jobs_done += 1  # counted when cleared, before the metrics go out
        if "loss" in metrics:
            await self.metric("loss", tenant, metrics["loss"], version=str(version))
        await self.metric("version", tenant, version)
        for name in sorted(metrics.keys() - {"loss"}):  # the head's own (policy_loss, kl_ref, ...): TensorBoard
            await self.metric("train", tenant, metrics[name], version=str(version), name=name)
        self.log.info("job done", tenant=tenant, job=job.job, version=version, step=w.res.slot.step_count,
                      items=job.items, skipped_compute=w.skip, loss=metrics.get("loss"))

    async def _exported_version(self, tenant: str) -> int:
        """The tenant's last exported version (-1: none yet), from the versions KV."""
        from nats.js.errors import KeyNotFoundError

        from protocol.wire import decode

        assert self.bus is not None
        kv = await js_retry(self.bus.js.key_value, self.names.kv_versions)
        try:
            return decode((await js_retry(kv.get, tenant)).value, WeightsRef).version
        except KeyNotFoundError:
            return -1

    async def _advance(self, job: JobRecord, state: str, version: int = -1,
                       metrics: dict[str, float] | None = None) -> None:
        if _before(job.state, state):
            await self._update(job, state, version, metrics)

    async def _update(self, job: JobRecord, state: str, version: int = -1,
                      metrics: dict[str, float] | None = None, reason: str = "", checkpoint: str = "",
                      base_checkpoint: str = "") -> JobRecord:
        assert self.bus is not None
        update = JobUpdate(tenant=job.tenant, job=job.job, state=state, trainer=self.instance,  # type: ignore[arg-type]
                           trained_version=version, reason=reason, metrics=metrics or {},
                           lease_epoch=job.lease_epoch, checkpoint=checkpoint, base_checkpoint=base_checkpoint)
        # A master restart must not strand a job we hold: updates are idempotent, so retry
        # through the outage (bounded) instead of dropping the job until its lease expires.
        rec = await retry_through_outage(
            self.bus.call, ops.MASTER_JOB_UPDATE, update, timeout_s=10,
            on_retry=lambda exc: self.log.warning("master unavailable; retrying job update", job=job.job,
                                                  state=state, error=exc.message))
        job.state = rec.state
        return rec

    async def fail(self, job: JobRecord, reason: str) -> None:
        self.log.error("job failed", tenant=job.tenant, job=job.job, reason=reason)
        try:
            await self._update(job, "failed", reason=reason)
        except Conflict as exc:
            # The fence: the job's lease went to another trainer while this one could not run
            # (e.g. it read the partition after the new owner had trained and purged it).
            self.leases_lost += 1
            self.log.warning("lease lost; the failure is not recorded", tenant=job.tenant, job=job.job,
                             error=str(exc))
        except NexusError as exc:
            self.log.error("could not report failure", tenant=job.tenant, job=job.job, error=str(exc))
        finally:
            self.unhold(job.job)  # after the report: its span closes with the failed state

    # -- low-level ops -------------------------------------------------------------------
    @op(ops.TRAINER_TRAIN_BATCH)
    async def train_batch(self, req: JobRef) -> TrainBatchReply:
        """Train one ready job now (a custom algorithm's step), then export it."""
        assert self.bus is not None
        check_token("job", req.job)  # an empty job would make the lease pick any ready jobs
        reply = await self.bus.call(
            ops.MASTER_LEASE,
            LeaseRequest(trainer=self.instance, job=req.job, tenant=req.tenant, lease_s=self.tcfg.lease_s),
            timeout_s=10)
        if not reply.jobs:
            raise FailedPrecondition(f"job {req.job} was dropped as stale: {reply.dropped_stale[0].reason}")
        # It joins the running group at the next step (after its tenant's job here, if any).
        w = await self.loop.submit(reply.jobs[0])
        if w.error or w.lost or w.released or w.job.state != "cleared":
            reason = w.error or ("its lease was lost" if w.lost else "released by a drain" if w.released else "")
            raise FailedPrecondition(f"job {req.job} failed: {reason or 'see the job record'}")
        slot = w.res.slot
        return TrainBatchReply(tenant=req.tenant, job=req.job, version=slot.policy_version,
                               step=slot.step_count, metrics=w.summary())

    @contextlib.asynccontextmanager
    async def _quiet(self, tenant: str) -> AsyncIterator[None]:
        """Between steps, with no job of ``tenant`` on this trainer: its slot is nobody's but
        the caller's (a job mid-training would otherwise export, or be overwritten, half-way)."""
        deadline = time.monotonic() + QUIET_WAIT_S
        while True:
            if not await self.loop.wait_idle(tenant, max(0.0, deadline - time.monotonic())):
                raise Busy(f"tenant {tenant} has a job training on this trainer; retry when it is cleared",
                           details={"retry_after_s": 1.0})
            await self.compute.acquire()
            if not self.loop.busy(tenant):
                break
            self.compute.release()  # a job of the tenant joined meanwhile
        try:
            with self.store.pinned(tenant):  # not dropped under the memory budget meanwhile
                yield
        finally:
            self.compute.release()

    @op(ops.TRAINER_EXPORT_PARAMS)
    async def export_params(self, req: ExportRequest) -> WeightsRef:
        assert self.store is not None
        async with self._quiet(req.tenant):
            await self.store.slot(await self._tenant(req.tenant))
            return await self.store.export(req.tenant, {})

    @op(ops.TRAINER_INIT_WEIGHTS)
    async def init_weights(self, req: InitWeightsRequest) -> Ok:
        """The master at submit: a new tenant starts from weights it uploaded (master/uploads.py)."""
        assert self.store is not None
        ref = await self.store.start_from(req.config, req.weights, req.adapter)
        return Ok(detail=f"{req.config.name} starts from {req.weights}"
                         + (f" and {req.adapter}" if req.adapter else "") + f" as version {ref.version}")

    @op(ops.TRAINER_LOAD_WEIGHTS)
    async def load_weights(self, req: LoadWeightsRequest) -> Ok:
        assert self.store is not None
        # The runtime checked the slot is the caller's; the object read must be too
        # (objects are named <tenant>/v<version>: transport.weights.weights_name).
        require_tenant(req.object_name.split("/", 1)[0], "load_weights from")
        async with self._quiet(req.tenant):
            await self.store.slot(await self._tenant(req.tenant))
            try:
                meta = await self.store.load_weights(req.tenant, req.object_name)
            except Exception as exc:
                from nats.js.errors import ObjectNotFoundError

                if isinstance(exc, ObjectNotFoundError):
                    raise NotFound(f"no weights object {req.object_name!r}") from None
                raise
            res = self.store.resident[req.tenant]
            name = await self.store.write_checkpoint(req.tenant, f"w{time.time_ns()}")
            try:
                await self.bus.call(ops.MASTER_CHECKPOINT_COMMIT, CheckpointCommitRequest(
                    tenant=req.tenant, object_name=name, base_checkpoint=res.checkpoint_name, trainer=self.instance,
                    step=res.slot.step_count, version=res.slot.policy_version), timeout_s=10)
            except NexusError:
                await self.store.delete_checkpoint(name)
                await self.store.reload(req.tenant)
                raise
            await self.store.committed_as(req.tenant, name)
        return Ok(detail=f"{req.tenant} loaded {req.object_name} (version {meta.get('policy_version')})")

    async def on_drain(self) -> None:
        # The loop stopped leasing when the drain began; wait for its jobs to finish or be
        # released (bounded: drain_finish_s of training, then commit/export or release).
        try:
            await asyncio.wait_for(self._loop_done.wait(), timeout=self.leases.drain_finish_s + 60.0)
        except asyncio.TimeoutError:
            self.log.error("train loop did not stop in time; its jobs go back when the master sees this trainer gone")
        await final_flush(self, self.meter, self.usage_flush)
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.close)
        self.log.info("trainer drained", jobs_done=self.jobs_done, released=self.released)


_ORDER = ("leased", "trained", "exported", "synced", "cleared")


def _before(current: str, target: str) -> bool:
    """True if a job in ``current`` has yet to reach ``target`` on the success path."""
    return _ORDER.index(current) < _ORDER.index(target)
