"""The trainer's continuous (iteration-level) scheduling loop: a running group refilled per step.

    loop = TrainLoop(trainer, group_max=4, idle_poll_s=1.0, cohort_wait_s=0.5)  # a LoopHost
    await loop.run()                     # until the trainer drains
    work = await loop.submit(job)        # train_batch: a leased job joins at the next step

Jobs do not train in rounds. The running group holds at most ``group_max`` jobs (one per
tenant); each iteration, in order:

  1. refill: when the group has room and something may be ready (a job left, the master
     published ``sched.ready``, or ``idle_poll_s`` passed), lease that many jobs; the master's
     scheduler picks them (priority, fairness, caps, staleness). Each is prepared in the
     background (slot brought to its committed checkpoint, partition read) and joins the group
     when ready; a job already applied before a crash goes straight to step 4. A group that
     has not stepped yet waits (at most ``TrainerConfig.cohort_wait_s``) for the other jobs
     of its lease, so jobs leased together share every step;
  2. jobs whose lease was lost (the renewer) leave without committing; a drain is noticed
     (past ``Leases.drain_finish_s`` every job not yet done is released to the master);
  3. one grouped step (`Trainer.train_step`): the next micro-batch of every running job,
     canonicalised now, not up front; compatible tenants share one base forward;
  4. a job whose last micro-batch is done leaves the group at once: it commits, exports and
     announces in the background (`Trainer.finish`) while the group steps on without it, and
     its place is offered to the next ready job.

Exactly-once does not depend on the grouping: a job's commit is still one checkpoint object
accepted by the master under the job's lease epoch (docs/reliability.md), and a tenant never
has two jobs on one trainer at once (the master leases one per tenant; a `train_batch` job of a
tenant already in the group waits its turn here).

The loop schedules; its host (`LoopHost`, the trainer) does the I/O and the compute: it sees
the trainer only through that interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from transport.bus import is_broker_outage
from actors.trainer.slots import Resident
from actors.tq_read import join_parts
from protocol.errors import Conflict, FailedPrecondition, NexusError
from protocol.messages import JobRecord, QueuePutRequest

# How often `wait_idle` (export_params / load_weights) looks whether a tenant's job is done.
IDLE_POLL_S = 0.05


@dataclass
class Work:
    """One leased job on this trainer, from lease to clear."""

    job: JobRecord
    phase: str = "parked"  # parked -> preparing -> running -> finishing (then gone)
    res: Resident | None = None  # set once prepared
    items: list[QueuePutRequest] = field(default_factory=list)  # one per step: split parts joined
    cursor: int = 0  # the next micro-batch to train
    batch: Any = None  # this step's models.TenantBatch (micro-batch ``cursor``, canonicalised now)
    losses: list[float] = field(default_factory=list)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    skip: bool = False  # already applied before a crash: no compute, just finish
    error: str = ""
    lost: bool = False  # the lease went to another trainer: drop the work, commit nothing
    released: bool = False  # handed back by a drain

    @property
    def tenant(self) -> str:
        return self.job.tenant

    @property
    def trained(self) -> bool:
        return self.cursor >= len(self.items)

    def summary(self) -> dict[str, float]:
        """Mean of each step metric over the job, plus its mean loss."""
        out = {k: float(np.nanmean(v)) for k, v in self.metrics.items()}
        if self.losses:
            out["loss"] = float(np.mean(self.losses))
        return out


class LoopHost(Protocol):
    """What `TrainLoop` needs of its trainer, and nothing more (`actors.trainer.trainer.Trainer` is
    the host): the leases, the slots, the data and the compute."""

    compute: asyncio.Lock  # held for one grouped step (export_params / load_weights go between)
    lost_jobs: set[str]  # jobs whose lease the renewer found lost: dropped, never committed
    log: Any  # the role's structlog logger

    @property
    def stopping(self) -> bool:
        """A drain began: lease no more."""
        ...

    def drain_overdue(self) -> bool:
        """Draining for longer than ``Leases.drain_finish_s``: release what is not done."""
        ...

    async def renew_loop(self) -> None:
        """Renew the held jobs' leases until cancelled; add the lost ones to `lost_jobs`."""
        ...

    def hold(self, job: JobRecord) -> None:
        """Renew ``job``'s lease (and open its trace span) until `unhold`."""
        ...

    def unhold(self, job_id: str) -> None: ...

    async def lease_jobs(self, max_jobs: int) -> list[JobRecord]:
        """Up to ``max_jobs`` jobs the master's scheduler picks; raises `NexusError`."""
        ...

    async def release(self, jobs: list[JobRecord], reason: str) -> None:
        """Hand ``jobs`` back to the master uncommitted (and `unhold` them)."""
        ...

    def fault_point(self, point: str) -> None: ...

    def stage(self, job: JobRecord, name: str) -> contextlib.AbstractContextManager[Any]:
        """A stage span of ``job``'s trace, current inside the block."""
        ...

    async def slot_for(self, job: JobRecord) -> Resident:
        """The job's tenant slot at its committed checkpoint."""
        ...

    async def read_items(self, job: JobRecord) -> list[QueuePutRequest]:
        """The job's queued micro-batches (split parts not yet joined)."""
        ...

    async def reload_slot(self, tenant: str) -> None:
        """Put ``tenant``'s slot back to its committed checkpoint (what trained since is dropped)."""
        ...

    def trim_slots(self, keep: set[str]) -> None:
        """Offload idle slots and enforce the memory budget, sparing the tenants in ``keep``."""
        ...

    async def train_step(self, group: list[Work]) -> None:
        """One grouped step: the next micro-batch of every job (a failing job gets ``error``)."""
        ...

    async def finish(self, w: Work) -> None:
        """Commit -> export -> announce -> clear; raises `Conflict` when the lease was lost."""
        ...

    async def fail(self, job: JobRecord, reason: str) -> None:
        """Record the job failed (and `unhold` it)."""
        ...

    def count_lost(self, job: JobRecord, why: str) -> None: ...


class TrainLoop:
    def __init__(self, host: LoopHost, *, group_max: int, idle_poll_s: float, cohort_wait_s: float) -> None:
        self.t = host
        # TrainerConfig's knobs of the loop (defaults and reasons: there).
        self.group_max = group_max
        self.idle_poll_s = idle_poll_s
        self.cohort_wait_s = cohort_wait_s
        self.jobs: dict[str, Work] = {}  # every job on this trainer, lease to done
        self.running: dict[str, Work] = {}  # the running group, in join order
        self._tasks: dict[str, asyncio.Task] = {}  # a job's prepare or finish task
        self._waiters: dict[str, asyncio.Future] = {}  # job id -> its Work once done (train_batch)
        self._changed = asyncio.Event()  # a job joined, left, or was submitted
        self._want_lease = True
        self._leased_at = 0.0
        self._cohort_until = 0.0  # a starting group waits for its cohort until then
        self.steps = 0  # grouped steps taken
        self.joined_running = 0  # jobs that joined while others were training (continuous joins)

    # -- views -----------------------------------------------------------------------------
    def held(self) -> list[str]:
        """Job ids being prepared or trained (the trainer's ``round`` in its info)."""
        return sorted(j for j, w in self.jobs.items() if w.phase in ("preparing", "running"))

    def busy(self, tenant: str, phases: tuple[str, ...] = ("parked", "preparing", "running", "finishing")) -> bool:
        """Does ``tenant`` have a job on this trainer (in one of ``phases``)?"""
        return any(w.tenant == tenant and w.phase in phases for w in self.jobs.values())

    def _count(self, phase: str) -> int:
        return sum(w.phase == phase for w in self.jobs.values())

    async def wait_idle(self, tenant: str, timeout_s: float) -> bool:
        """Wait until ``tenant`` has no job here; False if it still has one after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.busy(tenant):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(IDLE_POLL_S)
        return True

    def poke(self) -> None:
        """Something may be ready (``sched.ready``): lease at the next iteration."""
        self._want_lease = True
        self._changed.set()

    # -- entry points ------------------------------------------------------------------------
    async def submit(self, job: JobRecord) -> Work:
        """A job leased by `train_batch`: it joins the group (after its tenant's job here, if
        any) and this returns its Work once it is cleared, failed, lost or released."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters[job.job] = fut
        self._add(Work(job=job))
        self._changed.set()
        return await fut

    async def run(self) -> None:
        renewer = asyncio.ensure_future(self.t.renew_loop())
        try:
            await self._iterate()
        except Exception:
            # A bug in the loop: hand back what it held (the restarted loop starts empty) rather
            # than leave the leases renewed by nobody until they expire.
            await self._release_all("trainer loop failed")
            raise
        finally:
            if self._tasks:  # jobs finishing their commit: their leases stay renewed meanwhile
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
            for job_id, fut in list(self._waiters.items()):
                if not fut.done():
                    fut.set_exception(FailedPrecondition(f"job {job_id}: the trainer's loop stopped"))
            self._waiters.clear()

    async def _iterate(self) -> None:
        t = self.t
        while True:
            self._promote_parked()
            if not t.stopping:
                await self._refill()
            elif (self.running or self._count("preparing") or self._count("parked")) and t.drain_overdue():
                await self._release_all("trainer draining: its jobs did not finish in time")
                return
            if self.running and self._cohort_waiting():
                await self._idle()
                continue
            if self.running:
                async with t.compute:
                    await self._step()
                continue
            if t.stopping and not self._count("preparing") and not self._count("parked"):
                return  # drained: what is finishing completes in run()
            await self._idle()

    # -- 1. refill ---------------------------------------------------------------------------
    def _add(self, w: Work) -> None:
        self.jobs[w.job.job] = w
        self.t.hold(w.job)

    def _promote_parked(self) -> None:
        for w in [w for w in self.jobs.values() if w.phase == "parked"]:
            if not self.busy(w.tenant, ("preparing", "running", "finishing")):
                self._prepare(w)  # a train_batch job whose tenant is free now

    async def _refill(self) -> None:
        t = self.t
        room = self.group_max - len(self.running) - self._count("preparing")
        if time.monotonic() - self._leased_at > self.idle_poll_s:
            self._want_lease = True  # a fallback for a wake-up that never came
        if room <= 0 or not self._want_lease:
            return
        self._want_lease = False
        self._leased_at = time.monotonic()
        try:
            jobs = await t.lease_jobs(room)
        except NexusError as exc:
            t.log.warning("lease failed", error=str(exc))
            return
        if len(jobs) == room:
            self._want_lease = True  # the master may hold more: ask again when there is room
        if jobs and not self.running:
            self._cohort_until = time.monotonic() + self.cohort_wait_s
        for job in jobs:
            w = Work(job=job)
            self._add(w)
            self._prepare(w)

    def _cohort_waiting(self) -> bool:
        """A group that has not stepped yet waits (bounded) for jobs leased with it that are
        still being prepared; once it steps, later jobs join at the next step as usual."""
        if self._count("preparing") == 0 or time.monotonic() >= self._cohort_until:
            self._cohort_until = 0.0
            return False
        return True

    def _prepare(self, w: Work) -> None:
        w.phase = "preparing"
        self._tasks[w.job.job] = asyncio.ensure_future(self._prepared(w))

    async def _prepared(self, w: Work) -> None:
        """Slot and data of a newly leased job; it joins the group at the next step."""
        t = self.t
        try:
            t.fault_point("after_lease")
            # The trace's job.canonicalise stage: slot and data made ready (each micro-batch is
            # canonicalised at its own step, inside job.step).
            with t.stage(w.job, "job.canonicalise"):
                w.res = await t.slot_for(w.job)
                w.skip = w.job.job in w.res.applied or w.job.state != "leased"
                if not w.skip:
                    w.items = await t.read_items(w.job)
                    if len(w.items) != w.job.items:
                        raise FailedPrecondition(f"partition holds {len(w.items)} of {w.job.items} micro-batches")
                    # The parts of a micro-batch split to fit the max payload are one step.
                    w.items = join_parts(w.items)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._tasks.pop(w.job.job, None)
            if is_broker_outage(exc):
                # The broker, not the job: a node lost past the retries' deadline. Nothing of
                # the job was trained here, so it goes back to the master for another lease
                # instead of failing for good.
                t.log.warning("preparing a job hit a broker outage; handing it back",
                              tenant=w.tenant, job=w.job.job, error=f"{type(exc).__name__}: {exc}")
                await t.reload_slot(w.tenant)  # a restore cut short leaves no half-loaded slot
                await t.release([w.job], f"preparing hit {type(exc).__name__}")
                self._done(w)
                return
            w.error = f"{type(exc).__name__}: {exc}"
            await t.fail(w.job, w.error)
            self._done(w)
            return
        self._tasks.pop(w.job.job, None)
        if w.job.job in t.lost_jobs:
            await self._drop_lost(w)
        elif w.skip:
            self._finish(w)
        else:
            if self.running:
                self.joined_running += 1
            w.phase = "running"
            self.running[w.job.job] = w
        self._changed.set()

    async def _idle(self) -> None:
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout=self.idle_poll_s)
        except asyncio.TimeoutError:
            self._want_lease = True

    # -- 2-4. one step -------------------------------------------------------------------------
    async def _drop_lost(self, w: Work) -> None:
        """Another trainer holds the job now: our in-memory state of its tenant is not committed."""
        w.lost = True
        self.running.pop(w.job.job, None)
        await self.t.reload_slot(w.tenant)
        self._done(w)

    async def _step(self) -> None:
        t = self.t
        for w in [w for w in self.running.values() if w.job.job in t.lost_jobs]:
            await self._drop_lost(w)
        group = list(self.running.values())
        if not group:
            return
        await t.train_step(group)
        self.steps += 1
        self._cohort_until = 0.0  # stepped: later jobs join at the next step, no waiting
        for w in group:
            if w.job.job in t.lost_jobs:
                await self._drop_lost(w)
            elif w.error:
                self.running.pop(w.job.job)
                await t.reload_slot(w.tenant)
                await t.fail(w.job, w.error)
                self._done(w)
            elif w.trained:
                self.running.pop(w.job.job)
                assert w.res is not None
                w.res.applied[w.job.job] = None
                t.fault_point("after_train")
                self._finish(w)

    def _finish(self, w: Work) -> None:
        w.phase = "finishing"
        self._tasks[w.job.job] = asyncio.ensure_future(self._finished(w))
        self._want_lease = True  # a place in the group is free

    async def _finished(self, w: Work) -> None:
        """Commit -> export -> announce -> clear, beside the running group's steps."""
        t = self.t
        try:
            if w.job.job in t.lost_jobs:
                w.lost = True
                await t.reload_slot(w.tenant)
                return
            await t.finish(w)
        except Conflict as exc:
            # The fence: the lease was lost (or the checkpoint moved) before the commit.
            w.lost = True
            t.count_lost(w.job, exc.message)
            await t.reload_slot(w.tenant)
        except Exception as exc:
            w.error = f"finishing failed: {type(exc).__name__}: {exc}"
            t.log.error("finishing job failed", tenant=w.tenant, job=w.job.job, exc_info=exc)
            await t.reload_slot(w.tenant)
        finally:
            self._tasks.pop(w.job.job, None)
            self._want_lease = True  # the tenant is free: its next job may be leased
            self._done(w)
            busy = {x.tenant for x in self.jobs.values()}
            t.trim_slots(busy)  # past the memory budget, idle slots go

    def _done(self, w: Work) -> None:
        self.jobs.pop(w.job.job, None)
        self.t.unhold(w.job.job)
        fut = self._waiters.pop(w.job.job, None)
        if fut is not None and not fut.done():
            fut.set_result(w)
        self._changed.set()

    async def _release_all(self, reason: str) -> None:
        """A drain past its deadline: every job not yet trained goes back to the master,
        uncommitted (jobs already finishing complete their commit)."""
        preparing = [j for j, w in self.jobs.items() if w.phase == "preparing"]
        for j in preparing:
            self._tasks[j].cancel()
        await asyncio.gather(*(self._tasks.pop(j) for j in preparing), return_exceptions=True)
        work = [w for w in self.jobs.values() if w.phase in ("parked", "preparing", "running")]
        self.running.clear()
        for w in work:
            await self.t.reload_slot(w.tenant)
        await self.t.release([w.job for w in work if w.job.job not in self.t.lost_jobs], reason)
        for w in work:
            w.released = True
            self._done(w)
