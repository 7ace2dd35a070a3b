"""Trainer (Training Model Service): resident base(s), many tenant slots, the training loop.

The loop, in order (one round):
  1. lease up to ``group_max`` jobs from the master's scheduler (one per tenant); when none is
     ready, wait for ``<prefix>.sched.ready`` or ``idle_poll_s``;
  2. bring each tenant's slot up to its committed checkpoint (idle slots live in CPU memory);
  3. read each job's micro-batches from its partition and canonicalise them; a job whose
     data cannot be used fails alone;
  4. train: step i takes micro-batch i of every job, compatible tenants share one base forward
     (`models.train_step(grouped=True)`); a job already in the slot's applied ids is not
     trained again (a redelivery after a crash). Between steps the round's leases are renewed
     (a job whose lease was lost is dropped from the round, never committed) and a drain is
     noticed (past ``Leases.drain_finish_s`` the round stops and its jobs are released);
  5. per tenant: commit (a new checkpoint object with the applied job ids; the master moves
     the tenant's checkpoint pointer when it accepts ``trained`` under the job's lease epoch)
     -> export payload + manifest -> ``exported`` -> announce the version on
     ``<prefix>.weights.<tenant>`` -> ``synced`` -> purge the partition -> ``cleared``.

An exception in one tenant's job restores that tenant's slot from its checkpoint and fails
the job with the reason; every other tenant goes on. Low-level ops for custom algorithms:
``train_batch`` (train one job now), ``export_params``, ``load_weights``.

Run: ``python -m actors.run trainer --nats-url nats://127.0.0.1:4222``
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.bus import retry, retry_through_outage
from actors.identity import require_tenant
from actors.metering import Meter, final_flush, flush_loop
from actors.runtime import Role, RoleConfig, device_memory_bytes, op
from actors.slots import Resident, SlotStore
from actors.tq_read import read_job_items
from actors.tracing import JobSpans
from protocol.errors import Conflict, FailedPrecondition, NexusError, NotFound
from protocol.messages import (
    CheckpointCommitRequest,
    CheckpointRef,
    LeaseReleaseRequest,
    LeaseRenewReply,
    LeaseRenewRequest,
    ExportRequest,
    GetTenantRequest,
    JobRecord,
    JobRef,
    JobUpdate,
    LeaseReply,
    LeaseRequest,
    LoadWeightsRequest,
    Ok,
    QueuePutRequest,
    TenantConfig,
    TrainBatchReply,
    WeightsRef,
)
from protocol.policy import DRAIN_RELEASE, usage_flush_from_env
from protocol.settings import FAULT_POINTS, TrainerSettings, leases_from_env
from protocol.subjects import check_token

# Fault injection for the exactly-once tests: SIGKILL this process at the named point of the
# first job it handles (FAULT_POINTS, in lifecycle order).
FAULT_ENV = TrainerSettings.model_fields["fault"].alias
_ENV_DEFAULTS = TrainerSettings()


@dataclass
class TrainerConfig:
    # Jobs (tenants) per round, and the lease (defaults and reasons: protocol.settings).
    group_max: int = _ENV_DEFAULTS.group_max
    lease_s: float = _ENV_DEFAULTS.lease_s
    idle_poll_s: float = 1.0
    max_on_device: int = 16  # slots kept on the accelerator; the rest wait in CPU memory
    device: str | None = None  # None: cuda if available, else cpu

    @classmethod
    def from_env(cls) -> TrainerConfig:
        env = TrainerSettings.from_env()
        return cls(group_max=env.group_max, lease_s=env.lease_s, device=env.device)


@dataclass
class _Work:
    job: JobRecord
    res: Resident
    items: list[QueuePutRequest] = field(default_factory=list)
    batches: list[Any] = field(default_factory=list)  # models.TenantBatch per micro-batch
    losses: list[float] = field(default_factory=list)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    skip: bool = False  # already applied before a crash: no compute, just finish
    error: str = ""
    lost: bool = False  # the lease went to another trainer: drop the work, commit nothing

    def summary(self) -> dict[str, float]:
        """Mean of each step metric over the job, plus its mean loss."""
        out = {k: float(np.nanmean(v)) for k, v in self.metrics.items()}
        if self.losses:
            out["loss"] = float(np.mean(self.losses))
        return out


class Trainer(Role):
    name = "trainer"

    def __init__(self, cfg: RoleConfig, tcfg: TrainerConfig | None = None) -> None:
        super().__init__(cfg)
        self.tcfg = tcfg or TrainerConfig.from_env()
        self.fault = TrainerSettings.from_env().fault or ""
        self.leases = leases_from_env()
        self.store: SlotStore | None = None
        self._compute = asyncio.Lock()  # one round at a time on the accelerator
        self._wake = asyncio.Event()
        self._loop_done = asyncio.Event()
        self._drain_started: float | None = None
        self._round: dict[str, JobRecord] = {}  # job id -> record: the leases being renewed
        self._lost: set[str] = set()
        self.jobs_done = 0
        self.busy_s = 0.0  # seconds in grouped train steps (the device's busy time)
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

    async def setup(self) -> None:
        assert self.bus is not None
        import torch

        torch.set_num_threads(1)
        self.store = SlotStore(self.bus, self.names, device=self.tcfg.device,
                               max_on_device=self.tcfg.max_on_device)
        await self.bus.nc.subscribe(self.names.sched_ready, cb=self._on_ready)
        await self.bus.nc.subscribe(self.names.tenant_deleted_all, cb=self._on_tenant_deleted)
        self.spawn(self._loop, "train-loop", critical=True)
        self.spawn(lambda: flush_loop(self, self.meter, self.usage_flush), "usage-flush", critical=True)

    def info_extra(self) -> dict[str, Any]:
        return {"jobs_done": self.jobs_done, "leases_lost": self.leases_lost, "released": self.released,
                "mixed_lora_steps": self.mixed_lora_steps, "mixed_expert_steps": self.mixed_expert_steps,
                "round": sorted(self._round),
                "slots": self.store.memory_report() if self.store else {},
                "bases": sorted(self.store.bases) if self.store else [],
                "usage": self.meter.info()}

    def heartbeat_gauges(self) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        gauges, per_tenant = super().heartbeat_gauges()
        gauges.update(busy_s=self.busy_s, group_size=float(len(self._round)), jobs_done=float(self.jobs_done))
        if self.store is not None:
            gauges["device_memory_bytes"] = float(device_memory_bytes(self.store.device))
        return gauges, per_tenant

    async def _on_ready(self, msg: Any) -> None:
        self._wake.set()

    async def _on_tenant_deleted(self, msg: Any) -> None:
        tenant = msg.subject.rsplit(".", 1)[-1]
        if self.store is not None and self.store.resident.pop(tenant, None) is not None:
            self.log.info("tenant slot dropped (tenant deleted)", tenant=tenant)
        self.meter.forget(tenant)

    def _maybe_fault(self, point: str) -> None:
        assert point in FAULT_POINTS, point  # a point the settings do not list could never fire
        if self.fault == point:
            self.log.warning("fault injection: SIGKILL", point=point)
            os.kill(os.getpid(), signal.SIGKILL)

    # -- the loop ------------------------------------------------------------------------
    async def _loop(self) -> None:
        assert self.bus is not None
        self._loop_done.clear()  # a restarted loop (critical: restarted after a failure)
        try:
            await self._lease_loop()
        finally:
            self._loop_done.set()

    async def _lease_loop(self) -> None:
        assert self.bus is not None
        # A drain stops leasing at once; the round in progress finishes or is released.
        while not self._stop.is_set():
            try:
                async with self._compute:
                    reply = await self.bus.request(
                        self.names.master("lease"),
                        LeaseRequest(trainer=self.instance, max_jobs=self.tcfg.group_max, lease_s=self.tcfg.lease_s),
                        LeaseReply, timeout_s=10)
                    if reply.jobs:
                        await self._run(reply.jobs)
                        continue
            except NexusError as exc:
                self.log.warning("lease failed", error=str(exc))
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.tcfg.idle_poll_s)
            except asyncio.TimeoutError:
                pass

    async def _tenant(self, name: str) -> TenantConfig:
        assert self.bus is not None
        return await retry_through_outage(self.bus.request, self.names.master("tenant_get"),
                                          GetTenantRequest(tenant=name), TenantConfig, timeout_s=10)

    async def _run(self, jobs: list[JobRecord]) -> list[_Work]:
        """Steps 2-5 for a set of leased jobs (at most one per tenant). One span per round:
        the busy timeline of the trainer in the traces (see examples/report.py)."""
        links = self.job_spans.open(jobs, self.tcfg.lease_s)  # each job's span: child of its queued data
        try:
            with self.tracer.start_as_current_span("trainer.round", attributes={
                    "nexus.tenants": ",".join(sorted(j.tenant for j in jobs)), "nexus.jobs": len(jobs)}, links=links):
                return await self._run_round(jobs)
        finally:
            self.job_spans.close(jobs)

    async def _run_round(self, jobs: list[JobRecord]) -> list[_Work]:
        # The round's leases are renewed in the background from lease to clear: slot loads,
        # canonicalisation, every step and the commit all stay inside a live lease.
        self._round = {j.job: j for j in jobs}
        self._lost = set()
        renewer = asyncio.ensure_future(self._renew_loop())
        try:
            return await self._round_body(jobs)
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
            self._round = {}

    async def _round_body(self, jobs: list[JobRecord]) -> list[_Work]:
        assert self.store is not None
        self._maybe_fault("after_lease")
        work: list[_Work] = []
        # 2-3. slots and data; failures stay with their job
        for job in jobs:
            try:
                with self.job_spans.stage(job, "job.canonicalise"):
                    res = await self.store.slot(await self._tenant(job.tenant))
                    w = _Work(job=job, res=res, skip=job.job in res.applied or job.state != "leased")
                    if not w.skip:
                        w.items = await read_job_items(self.bus, self.names, job, 0, job.items)
                        if len(w.items) != job.items:
                            raise FailedPrecondition(f"partition holds {len(w.items)} of {job.items} micro-batches")
                        w.batches = await asyncio.to_thread(self._canonicalise, res, job, w.items)
                work.append(w)
            except Exception as exc:
                await self._fail(job, f"{type(exc).__name__}: {exc}")
        # 4. grouped training, a step at a time: leases renewed, drains noticed in between
        todo = [w for w in work if not w.skip]
        if todo:
            base_by_tenant = {w.job.tenant: self.store.bases[w.res.config.base] for w in todo}
            for i in range(max(len(w.batches) for w in todo)):
                if self._drain_overdue():
                    await self._release(work, "trainer draining: the round did not finish in time")
                    return work
                self._mark_lost(work)
                started = time.perf_counter()
                with self.job_spans.steps([w.job for w in todo if i < len(w.batches)], i):
                    await asyncio.to_thread(self._train_step, todo, i, base_by_tenant)
                self.busy_s += time.perf_counter() - started  # the device's share: nexus top, /metrics
            self._mark_lost(work)
            for w in todo:
                if not w.error and not w.lost:
                    w.res.applied[w.job.job] = None
        self._maybe_fault("after_train")
        # 5. commit, export, announce, clear
        for w in work:
            self._mark_lost([w])
            if w.lost:
                # Another trainer holds the job now: our in-memory state is not committed.
                await self.store.reload(w.job.tenant)
                continue
            if w.error:
                await self.store.reload(w.job.tenant)
                await self._fail(w.job, w.error)
                continue
            try:
                await self._finish(w)
                self._round.pop(w.job.job, None)
                self.jobs_done += 1
            except Conflict as exc:
                # The fence: the lease was lost (or the checkpoint moved) before the commit.
                self._round.pop(w.job.job, None)
                self.leases_lost += 1
                self.log.warning("commit refused; job left to its current owner", tenant=w.job.tenant,
                                 job=w.job.job, error=exc.message)
                await self.store.reload(w.job.tenant)
            except Exception as exc:
                self.log.error("finishing job failed", tenant=w.job.tenant, job=w.job.job, exc_info=exc)
                await self.store.reload(w.job.tenant)
        self.store.offload_idle(keep={w.job.tenant for w in work})
        return work

    def _canonicalise(self, res: Resident, job: JobRecord, items: list[QueuePutRequest]) -> list[Any]:
        return [item_to_batch(res.slot, item) for item in items]

    def _drain_overdue(self) -> bool:
        if not self._stop.is_set():
            return False
        if self._drain_started is None:
            self._drain_started = time.monotonic()
            self.log.info("draining: finishing the round", finish_s=self.leases.drain_finish_s)
        return time.monotonic() - self._drain_started > self.leases.drain_finish_s

    def _mark_lost(self, work: list[_Work]) -> None:
        for w in work:
            if w.job.job in self._lost:
                w.lost = True

    async def _renew_loop(self) -> None:
        """Extend the leases of the round's unfinished jobs every ``renew_every_s`` (at most a
        quarter of the lease); a job the master says is lost is dropped, never committed."""
        assert self.bus is not None
        every = min(self.leases.renew_every_s, self.tcfg.lease_s / 4)
        while True:
            await asyncio.sleep(every)
            held = list(self._round.values())
            if not held:
                continue
            req = LeaseRenewRequest(trainer=self.instance, jobs=[JobRef(tenant=j.tenant, job=j.job) for j in held],
                                    epochs=[j.lease_epoch for j in held], lease_s=self.tcfg.lease_s)
            try:
                reply = await self.bus.request(self.names.master("lease_renew"), req, LeaseRenewReply, timeout_s=10)
            except NexusError as exc:
                # The master is restarting: keep training; the commit fence decides in the end.
                self.log.warning("lease renewal failed", error=exc.message)
                continue
            for job in held:
                if job.job in reply.lost and self._round.pop(job.job, None) is not None:
                    self._lost.add(job.job)
                    self.leases_lost += 1
                    self.log.warning("lease lost mid-round; dropping the job", tenant=job.tenant, job=job.job)

    async def _release(self, work: list[_Work], reason: str) -> None:
        """Hand the round's jobs back (drain): nothing of them is committed by this trainer."""
        assert self.bus is not None and self.store is not None
        mine = [w for w in work if not w.lost]
        for w in mine:
            self._round.pop(w.job.job, None)
            await self.store.reload(w.job.tenant)
        if not mine:
            return
        req = LeaseReleaseRequest(trainer=self.instance, jobs=[JobRef(tenant=w.job.tenant, job=w.job.job) for w in mine],
                                  epochs=[w.job.lease_epoch for w in mine], reason=reason)
        try:
            await retry(self.bus.request, self.names.master("lease_release"), req, Ok, timeout_s=5,
                        policy=DRAIN_RELEASE)
            self.released += len(mine)
            self.log.info("released the round's jobs", jobs=[w.job.job for w in mine], reason=reason)
        except NexusError as exc:
            # The master is gone too: its successor releases a gone trainer's jobs at start.
            self.log.warning("could not release jobs", error=exc.message, jobs=[w.job.job for w in mine])

    def _train_step(self, todo: list[_Work], i: int, base_by_tenant: dict[str, Any]) -> None:
        """Micro-batch i of every job in one grouped step; a failing tenant is isolated."""
        live = [w for w in todo if i < len(w.batches) and not w.error and not w.lost]
        by_base: dict[int, list[_Work]] = {}
        for w in live:
            by_base.setdefault(id(base_by_tenant[w.job.tenant]), []).append(w)
        for group in by_base.values():
            base = base_by_tenant[group[0].job.tenant]
            try:
                results = self._metered_step(base, group, i, grouped=True)
                if len({w.res.slot.adapter is None for w in group}) == 2:
                    self.mixed_lora_steps += 1
                if len({w.res.slot.head.needs_prefix_kv for w in group}) == 2:
                    self.mixed_expert_steps += 1
            except Exception:
                # Find the culprit: run the tenants one by one; only the failing one fails.
                results = []
                for w in group:
                    try:
                        results.extend(self._metered_step(base, [w], i, grouped=False))
                    except Exception as exc:  # noqa: BLE001 - reported as the job's failure reason
                        w.error = f"training step {i} failed: {type(exc).__name__}: {exc}"
                        results.append(None)
            for w, r in zip(group, results):
                if r is None:
                    continue
                w.losses.append(r.loss)
                for k, v in r.metrics.items():
                    w.metrics.setdefault(k, []).append(float(v))

    def _metered_step(self, base: Any, group: list[_Work], i: int, grouped: bool) -> list[Any]:
        """One `models.train_step`, timed (wall time ending in a device synchronize) and charged
        to the group's tenants by their rows (`actors.metering`); a step that raises is charged
        too: the device time was spent."""
        from models import train_step

        t0 = time.perf_counter()
        try:
            return train_step(base, [(w.res.slot, w.batches[i]) for w in group], grouped=grouped)
        finally:
            _sync(base)
            self.meter.charge("train", time.perf_counter() - t0,
                              {(w.job.tenant, w.job.workload): len(w.batches[i].features) for w in group})

    async def _finish(self, w: _Work) -> None:
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
                    self._maybe_fault("after_commit")
                    try:
                        await self._update(job, "trained", version, metrics, checkpoint=name,
                                           base_checkpoint=w.res.checkpoint_name)
                    except NexusError:  # refused (lease lost) or its tenant is gone: nobody points at it
                        await self.store.delete_checkpoint(name)
                        raise
                    await self.store.committed_as(tenant, name)
                else:
                    await self._update(job, "trained", version, metrics)
        self._maybe_fault("after_trained")
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
            self._maybe_fault("after_export")
        elif every <= 0 or exported == version:
            # Exported by a trainer that died before announcing: announce again (same version).
            with self.job_spans.stage(job, "job.export"):
                ref = await self.store.export(tenant, metrics)
        with self.job_spans.stage(job, "job.sync"):
            if _before(job.state, "synced"):
                await self._advance(job, "synced", version)
                self._maybe_fault("after_synced")
            await self._advance(job, "cleared", version)
        if "loss" in metrics:
            await self.metric("loss", tenant, metrics["loss"], version=str(version))
        await self.metric("version", tenant, version)
        self.log.info("job done", tenant=tenant, job=job.job, version=version, step=w.res.slot.step_count,
                      items=job.items, skipped_compute=w.skip, loss=metrics.get("loss"))

    async def _exported_version(self, tenant: str) -> int:
        """The tenant's last exported version (-1: none yet), from the versions KV."""
        from nats.js.errors import KeyNotFoundError

        from protocol.wire import decode

        assert self.bus is not None
        kv = await self.bus.js.key_value(self.names.kv_versions)
        try:
            return decode((await kv.get(tenant)).value, WeightsRef).version
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
            self.bus.request, self.names.master("job_update"), update, JobRecord, timeout_s=10,
            on_retry=lambda exc: self.log.warning("master unavailable; retrying job update", job=job.job,
                                                  state=state, error=exc.message))
        job.state = rec.state
        return rec

    async def _fail(self, job: JobRecord, reason: str) -> None:
        self._round.pop(job.job, None)
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

    # -- low-level ops -------------------------------------------------------------------
    @op("train_batch", JobRef)
    async def train_batch(self, req: JobRef) -> TrainBatchReply:
        """Train one ready job now (a custom algorithm's step), then export it."""
        assert self.bus is not None
        check_token("job", req.job)  # an empty job would make the lease pick any ready jobs
        async with self._compute:
            reply = await self.bus.request(
                self.names.master("lease"),
                LeaseRequest(trainer=self.instance, job=req.job, tenant=req.tenant, lease_s=self.tcfg.lease_s),
                LeaseReply, timeout_s=10)
            if not reply.jobs:
                raise FailedPrecondition(f"job {req.job} was dropped as stale: {reply.dropped_stale[0].reason}")
            (w,) = await self._run(reply.jobs) or [None]
        if w is None or w.error or w.job.state != "cleared":
            reason = (w.error if w else "") or "see the job record"
            raise FailedPrecondition(f"job {req.job} failed: {reason}")
        slot = w.res.slot
        return TrainBatchReply(tenant=req.tenant, job=req.job, version=slot.policy_version,
                               step=slot.step_count, metrics=w.summary())

    @op("export_params", ExportRequest)
    async def export_params(self, req: ExportRequest) -> WeightsRef:
        assert self.store is not None
        async with self._compute:
            await self.store.slot(await self._tenant(req.tenant))
            return await self.store.export(req.tenant, {})

    @op("load_weights", LoadWeightsRequest)
    async def load_weights(self, req: LoadWeightsRequest) -> Ok:
        assert self.store is not None
        # The runtime checked the slot is the caller's; the object read must be too
        # (objects are named <tenant>/v<version>: actors.weights.weights_name).
        require_tenant(req.object_name.split("/", 1)[0], "load_weights from")
        async with self._compute:
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
                await self.bus.request(self.names.master("checkpoint_commit"), CheckpointCommitRequest(
                    tenant=req.tenant, object_name=name, base_checkpoint=res.checkpoint_name, trainer=self.instance,
                    step=res.slot.step_count, version=res.slot.policy_version), CheckpointRef, timeout_s=10)
            except NexusError:
                await self.store.delete_checkpoint(name)
                await self.store.reload(req.tenant)
                raise
            await self.store.committed_as(req.tenant, name)
        return Ok(detail=f"{req.tenant} loaded {req.object_name} (version {meta.get('policy_version')})")

    async def on_drain(self) -> None:
        # The loop stopped leasing when the drain began; wait for its round to finish or be
        # released (bounded: drain_finish_s of training, then commit/export or release).
        try:
            await asyncio.wait_for(self._loop_done.wait(), timeout=self.leases.drain_finish_s + 60.0)
        except asyncio.TimeoutError:
            self.log.error("train loop did not stop in time; its jobs go back when the master sees this trainer gone")
        await final_flush(self, self.meter, self.usage_flush)
        self.log.info("trainer drained", jobs_done=self.jobs_done, released=self.released)


_ORDER = ("leased", "trained", "exported", "synced", "cleared")


def _sync(base: Any) -> None:
    """Wait for the device: a step's wall time then covers its kernels, not just their launch."""
    if base.device.type == "cuda":
        import torch

        torch.cuda.synchronize(base.device)


def _before(current: str, target: str) -> bool:
    """True if a job in ``current`` has yet to reach ``target`` on the success path."""
    return _ORDER.index(current) < _ORDER.index(target)


def item_to_batch(slot: Any, item: QueuePutRequest) -> Any:
    """One queued micro-batch (tenant schema) -> `models.TenantBatch` (canonical VLAFeature)."""
    import torch
    from models import Observation, TenantBatch

    cams = slot.schema.camera_names
    obs = [Observation(images={c: np.asarray(item.images[c][i]) for c in cams},
                       state=np.asarray(item.state[i]), instruction=item.instructions[i])
           for i in range(len(item.instructions))]
    vla = slot.preprocessor(obs).to(slot.device)

    def t(x: Any) -> Any:
        return None if x is None else torch.tensor(np.asarray(x), dtype=torch.float32)

    return TenantBatch(vla, t(item.actions), t(item.old_log_prob), t(item.advantages), t(item.returns))
