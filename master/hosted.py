"""The master's half of tenant-hosted envs (docs/hosted_envs.md).

A workload whose spec says ``env: {hosted: tenant}`` is never started on the platform's env
workers. Its tenant runs `nexus env serve --creds T.creds MODULE:FACTORY` on its own machine;
each such process calls ``hosted_claim`` about once a second with the tenant's credentials:

* the claim is its heartbeat: the master holds a lease per (tenant, process) of
  NEXUS_HOSTED_LEASE_S; a process that stops claiming loses its workloads (back to pending:
  half-filled jobs sealed, so nothing queued is lost; the episodes it had in flight are);
* the reply names the workloads it said it runs that are no longer its own (cancelled,
  finished, moved after a lapsed lease): it stops them;
* with room, it gets one pending hosted workload of its tenant (the compiled `WorkflowSpec`),
  and runs the platform's own workflow (workflows/) on it against its local env, through the
  ops a tenant account may call; its events come back through ``hosted_event``.

Fencing: both ops have access ``tenant`` (`actors.identity`): the request's tenant must be
the one the broker asserts for the caller's credentials, so a process with tenant B's
credentials can neither claim, renew nor report for tenant A. An event is taken only from the
process the workload runs on. A pending hosted workload that no process takes within
NEXUS_HOSTED_WAIT_S fails, naming why.
"""

from __future__ import annotations

import time
from typing import Protocol

from actors.runtime import op
from protocol import ops
from protocol.errors import FailedPrecondition, NotFound, QuotaExceeded
from protocol.messages import (
    HostedClaimReply,
    HostedClaimRequest,
    HostedEventRequest,
    Ok,
    WorkflowSpec,
    WorkloadEvent,
    WorkloadRecord,
)
from protocol.subjects import check_token
from master.state import MasterState
from master.records import HOSTED_WORKER_PREFIX, hosted_worker, is_hosted, is_hosted_worker, policy_pin_tenant

# Hosted processes of one tenant at once: each claim is a lease entry (a bound on the map).
MAX_HOSTED_PROCESSES_PER_TENANT = 64
HOSTED_SWEEP_S = 1.0


def serve_hint(tenant: str) -> str:
    return f"`nexus env serve --creds {tenant}.creds MODULE:FACTORY` with tenant {tenant!r}'s credentials"


class WorkloadMoves(Protocol):
    """What the hosted part asks of the workloads part (`master.workloads.WorkloadOps`)."""

    async def set_state(self, rec: WorkloadRecord, state: str, message: str) -> bool: ...
    async def repend(self, rec: WorkloadRecord, message: str) -> None: ...
    async def apply_event(self, ev: WorkloadEvent) -> None: ...
    async def compile_start(self, rec: WorkloadRecord) -> tuple[WorkflowSpec, int] | None: ...


class HostedOps:
    """The master's part for hosted env processes: their leases and claims. It moves
    workloads through ``workload_ops`` (`bind`: the two parts call each other)."""

    def __init__(self, st: MasterState) -> None:
        self.st = st
        self.workload_ops: WorkloadMoves | None = None

    def _moves(self) -> WorkloadMoves:
        if self.workload_ops is None:
            raise RuntimeError("HostedOps.bind was not called: the master binds its workloads part at construction")
        return self.workload_ops

    def bind(self, workload_ops: WorkloadMoves) -> None:
        self.workload_ops = workload_ops

    hosted: dict[str, dict[str, float]]  # tenant -> process -> lease expiry (monotonic s); made in __init__

    hosted_wait_s: float  # NEXUS_HOSTED_WAIT_S, NEXUS_HOSTED_LEASE_S (set by the master from its settings)
    hosted_lease_s: float

    def setup_hosted(self) -> None:
        lease_s = self.st.hosted_lease_s
        # Workloads running on hosted processes when this master started: their processes get
        # one lease to claim again (they keep running through a master restart).
        now = time.monotonic()
        for rec in self.st.workloads.values():
            if rec.state == "running" and is_hosted_worker(rec.worker):
                process = rec.worker[len(HOSTED_WORKER_PREFIX):]
                self.st.hosted.setdefault(rec.tenant, {})[process] = now + lease_s
        self.st.spawn(self._hosted_sweep_loop, "hosted-leases", critical=True, max_quiet_s=60.0)

    def hosted_processes(self, tenant: str) -> int:
        now = time.monotonic()
        return sum(1 for expiry in self.st.hosted.get(tenant, {}).values() if expiry > now)

    def hosted_note(self, tenant: str) -> str:
        """What a submit of a hosted workload says about the processes that will run it."""
        n = self.hosted_processes(tenant)
        if n:
            return f"; {n} hosted env process{'es' if n > 1 else ''} of tenant {tenant!r} connected"
        return (f"; NO hosted env process of tenant {tenant!r} is connected: the workload waits up to "
                f"{self.st.hosted_wait_s:g} s (NEXUS_HOSTED_WAIT_S) for one, then fails; start {serve_hint(tenant)}")

    @op(ops.MASTER_HOSTED_CLAIM)
    async def hosted_claim(self, req: HostedClaimRequest) -> HostedClaimReply:
        tenant = check_token("tenant", req.tenant)
        process = check_token("process", req.process)
        for w in req.running:
            check_token("running", w)
        now = time.monotonic()
        if req.leaving:
            self.st.hosted.get(tenant, {}).pop(process, None)
            await self._release_process(tenant, process, f"hosted env process {process} of tenant {tenant} stopped and "
                                                         "handed it back")
            return HostedClaimReply(lease_s=self.st.hosted_lease_s, stop=list(req.running),
                                    processes=self.hosted_processes(tenant))
        procs = self.st.hosted.setdefault(tenant, {})
        if process not in procs and len(procs) >= MAX_HOSTED_PROCESSES_PER_TENANT:
            raise QuotaExceeded.of("hosted_processes", MAX_HOSTED_PROCESSES_PER_TENANT,
                                   f"tenant {tenant!r} has {len(procs)} hosted env processes connected",
                                   self.st.hosted_lease_s, tenant=tenant)
        procs[process] = now + self.st.hosted_lease_s
        worker = hosted_worker(process)
        stop, mine = [], []
        for w in req.running:
            rec = self.st.workloads.get(w)
            if rec is None or rec.tenant != tenant or rec.state != "running" or rec.worker != worker:
                stop.append(w)
            else:
                mine.append(w)
        # Workloads this process took but no longer runs (its workflow ended and its done event
        # never arrived, or it could not start it): back to pending, not running on nobody. A
        # process names what it took from the claim that handed it out on (sdk/env_serve.py),
        # and a done event is applied before its reply, so this never catches a live one.
        for rec in list(self.st.workloads.values()):
            if rec.tenant == tenant and rec.state == "running" and rec.worker == worker and rec.workload not in mine:
                await self._moves().repend(rec, f"hosted env process {process} of tenant {tenant} no longer runs it")
        start = []
        if len(mine) < req.capacity:
            for rec in sorted(self.st.workloads.values(), key=lambda r: r.created_at):
                if rec.tenant != tenant or rec.state != "pending" or not is_hosted(rec):
                    continue
                if rec.workload in self.st.starting or rec.workload in self.st.unsaved:
                    continue
                self.st.starting.add(rec.workload)
                try:
                    compiled = await self._moves().compile_start(rec)
                    if compiled is None:
                        continue  # an eval waiting for its tenant's training
                    workflow, eval_version = compiled
                    rec.worker, rec.eval_version = worker, eval_version
                    if await self._moves().set_state(rec, "running",
                                             f"workflow running on hosted env process {process} of tenant {tenant}"):
                        start.append(workflow)
                    else:
                        rec.worker = ""
                finally:
                    self.st.starting.discard(rec.workload)
                break  # one a claim: several processes of a tenant share its workloads
        return HostedClaimReply(lease_s=self.st.hosted_lease_s, start=start, stop=stop,
                                processes=self.hosted_processes(tenant))

    @op(ops.MASTER_HOSTED_EVENT)
    async def hosted_event(self, req: HostedEventRequest) -> Ok:
        ev = req.event
        process = check_token("process", req.process)
        rec = self.st.workloads.get(ev.workload)
        if rec is None or rec.tenant != req.tenant or ev.tenant != req.tenant:
            raise NotFound(f"tenant {req.tenant!r} has no workload {ev.workload!r}", details={"workload": ev.workload})
        if ev.kind not in ("progress", "done"):
            raise FailedPrecondition(f"a hosted process reports progress and done events, not {ev.kind!r}")
        if rec.state != "running" or rec.worker != hosted_worker(process):
            raise FailedPrecondition(f"workload {rec.workload} is {rec.state} and not on hosted process {process}; "
                                     "stop it", details={"workload": rec.workload, "state": rec.state})
        # Applied before the reply (a done event ends the workload before its process drops
        # it), then published as an env worker's workflow would, for the monitor's series.
        await self._moves().apply_event(ev)
        await self.st.bus.publish(self.st.names.workload_events(rec.workload), ev)
        return Ok(detail="event taken")

    async def hosted_pending(self, rec: WorkloadRecord) -> None:
        """The pending loop's turn for a hosted workload: processes take it by claiming;
        past NEXUS_HOSTED_WAIT_S untaken it fails, naming why."""
        since = rec.updated_at
        if rec.family == "eval":
            # An eval waits for its policy's training workload first: that wait is not this one.
            target = policy_pin_tenant(rec)
            ahead = [w for w in self.st.workloads.values() if w.tenant == target and w.family != "eval"]
            if any(w.state in ("pending", "running") for w in ahead):
                return
            since = max([since, *(w.updated_at for w in ahead)])
        waited = time.time() - since
        if waited <= self.st.hosted_wait_s:
            return
        n = self.hosted_processes(rec.tenant)
        why = (f"{n} hosted env processes of tenant {rec.tenant!r} are connected but none took it"
               if n else f"no hosted env process of tenant {rec.tenant!r} connected")
        await self._moves().set_state(rec, "failed", f"waited {waited:.0f} s for a hosted env process (NEXUS_HOSTED_WAIT_S="
                                             f"{self.st.hosted_wait_s:g}): {why}; start {serve_hint(rec.tenant)}")

    async def _hosted_sweep_loop(self) -> None:
        while True:
            await self.st.idle("hosted-leases", HOSTED_SWEEP_S)
            await self.expire_hosted(time.monotonic())

    async def expire_hosted(self, now: float) -> None:
        for tenant, procs in list(self.st.hosted.items()):
            for process, expiry in list(procs.items()):
                if expiry > now:
                    continue
                del procs[process]
                await self._release_process(tenant, process, f"hosted env process {process} of tenant {tenant} "
                                                             f"stopped claiming (lease {self.st.hosted_lease_s:g} s, "
                                                             "NEXUS_HOSTED_LEASE_S)")
            if not procs:
                self.st.hosted.pop(tenant, None)

    async def _release_process(self, tenant: str, process: str, why: str) -> None:
        """The workloads of a hosted process that is gone go back to pending: its half-filled
        jobs are sealed (what it queued trains), its rollout turn is freed, and another
        process of the tenant (or this one, back) takes them at its next claim."""
        worker = hosted_worker(process)
        for rec in list(self.st.workloads.values()):
            if rec.tenant == tenant and rec.state == "running" and rec.worker == worker:
                await self._moves().repend(rec, f"{why}: its episodes in flight are lost, its queued data trains; waiting "
                                        "for a hosted env process again")
