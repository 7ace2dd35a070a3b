"""Env worker (Environment Service): simulator sessions behind a gymnasium-style API over NATS.

    create  <prefix>.env.create                      (queue group: any worker)  -> EnvSession
    reset   <prefix>.svc.env.<worker>.reset           (the session's worker)     -> EnvObs
    step    <prefix>.svc.env.<worker>.step                                        -> EnvObs
    close   <prefix>.svc.env.<worker>.close                                       -> Ok

A session is a lease: every call renews it; a session not called for ``lease_s`` (its client
died) is closed by a sweeper. A simulator that raises fails only its own session (closed,
error reply naming it); the worker and every other session go on. Each simulator runs in a
child process of its own (`envs.simproc`, at most NEXUS_SIM_PROCS_MAX), so a scene build or a
slow renderer never stalls the worker's event loop or heartbeats, a call past
NEXUS_SIM_TIMEOUT_S kills its child, and a child that dies fails only its session.
Workflows (RL rollouts, SFT sampling, evaluation) also run here: the loops of `workflows/`, on
the SDK's primitives, found by kind in `protocol.recipes` (registered by the modules
NEXUS_WORKFLOW_MODULES names, imported at start), so this role never imports them; a start
of a kind not loaded here is refused (InvalidField on ``kind``) and the master fails that workload.

Run: ``python -m actors.run env --nats-url nats://127.0.0.1:4222``
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from transport.bus import retry
from transport.auth import PLATFORM_ACCOUNT
from actors.env_worker.config import EnvWorkerConfig
from actors.identity import current_caller, deny
from actors.paths import caller_roots, confine
from actors.runtime import Role, RoleConfig, op
from envs.simproc import SimFailure, configure as configure_sim_pool, pool as sim_pool
from protocol import ops, recipes
from protocol.policy import DRAIN_RELEASE
from protocol.errors import FailedPrecondition, InvalidField, NexusError, NotFound, QuotaExceeded
from protocol.messages import (
    EnvCloseRequest,
    EnvCreateRequest,
    EnvObs,
    EnvResetRequest,
    EnvSession,
    EnvStepRequest,
    DatasetBatch,
    HandbackRequest,
    Ok,
    WorkflowSpec,
    SampleRequest,
    WorkloadRef,
)
from protocol.subjects import check_token

SWEEP_EVERY_S = 1.0
MAX_READERS = 8  # open dataset readers kept per worker
MAX_LEASE_S = 3600.0


@dataclass
class _Session:
    id: str
    env_id: str
    env: Any  # envs.simproc.SimEnv: the simulator in its child process
    lease_s: float
    last_used: float
    lock: asyncio.Lock
    steps: int = 0
    reset_done: bool = False
    owner: str = PLATFORM_ACCOUNT  # the account that opened it: only it (or the platform) drives it


class EnvWorker(Role):
    name = "env"

    def __init__(self, cfg: RoleConfig, ecfg: EnvWorkerConfig | None = None) -> None:
        super().__init__(cfg)
        self.sessions: dict[str, _Session] = {}
        config = ecfg or EnvWorkerConfig.from_env()
        self.env_settings = config.env
        self.workflow_settings = config.workflow
        self.max_sessions = self.env_settings.max_sessions
        self.max_sessions_per_tenant = self.env_settings.max_sessions_per_tenant
        self.expired = 0
        self.workflows: dict[str, Any] = {}
        self.readers: OrderedDict[str, Any] = OrderedDict()
        self.sim = configure_sim_pool(self.env_settings.plugins)  # simulator children (envs.simproc)

    async def setup(self) -> None:
        import importlib

        # Users register their own simulators from modules named here (envs.register(...)).
        for module in self.env_settings.plugins:
            importlib.import_module(module)
        # The workflows register by kind (`protocol.recipes`) from the modules named
        # here: the loops are user-level code this role never imports by name.
        recipes.load_modules(self.workflow_settings.modules)
        self.spawn(self._sweep_loop, "session-sweeper", critical=True, max_quiet_s=30.0)

    def info_extra(self) -> dict[str, Any]:
        return {"sessions": len(self.sessions), "expired": self.expired,
                "workflows": {k: p.status() for k, p in self.workflows.items()}, "sim": self.sim.info()}

    def heartbeat_gauges(self) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """Simulator steps answered in this process (its workflows' and its sessions') and their
        seconds summed: running totals, so a reader takes the mean step latency between two beats
        (the monitor's ``env_step_seconds``, the scaler's ``env_step_s``)."""
        gauges, per_tenant = super().heartbeat_gauges()
        pool = sim_pool()  # the process's pool (a reconfigure keeps the totals)
        gauges.update(steps=float(pool.steps), step_s=pool.step_s)
        return gauges, per_tenant

    # -- sessions ------------------------------------------------------------------------
    def _session(self, sid: str) -> _Session:
        s = self.sessions.get(sid)
        if s is None:
            raise NotFound(f"no session {sid!r} on worker {self.instance} (closed, expired or never opened)",
                           details={"session": sid})
        caller = current_caller()
        if not caller.is_platform and caller.account != s.owner:
            raise deny(caller, "use env session", None, f"session {sid} belongs to another account")
        s.last_used = time.monotonic()
        return s

    @op(ops.ENV_CREATE)
    async def create(self, req: EnvCreateRequest) -> EnvSession:
        if not 0 < req.lease_s <= MAX_LEASE_S:
            raise InvalidField("lease_s", f"must be in (0, {MAX_LEASE_S:g}]")
        if len(self.sessions) >= self.max_sessions:
            raise FailedPrecondition(f"worker {self.instance} holds {len(self.sessions)} sessions, its maximum")
        caller = current_caller()
        self._check_tenant_sessions(caller)
        try:
            env = await self.sim.make(req.env_id, req.options)  # a child process of its own
        except SimFailure as exc:
            raise FailedPrecondition(f"env {req.env_id} could not be made: {exc.message}",
                                     details=exc.details) from None
        # Counted again after the make (seconds for a scene build): concurrent creates of one
        # tenant cannot all pass the check above and overshoot the bound together.
        try:
            self._check_tenant_sessions(caller)
        except QuotaExceeded:
            await env.close()
            raise
        sid = uuid.uuid4().hex[:12]
        self.sessions[sid] = _Session(sid, req.env_id, env, req.lease_s, time.monotonic(), asyncio.Lock(),
                                      owner=caller.account)
        self.log.info("session opened", session=sid, env_id=req.env_id)
        return EnvSession(session=sid, worker=self.instance, env_id=req.env_id, spec=spec_dict(env.spec))

    def _check_tenant_sessions(self, caller: Any) -> None:
        """A tenant's sessions on this worker (counted by its account) within
        NEXUS_ENV_MAX_SESSIONS_PER_TENANT: one tenant cannot take every session of a worker
        all tenants share. The platform's own sessions (workflows) are bounded by the worker's."""
        if caller.is_platform:
            return
        held = sum(1 for s in self.sessions.values() if s.owner == caller.account)
        if held >= self.max_sessions_per_tenant:
            raise QuotaExceeded.of(
                "env_sessions_per_tenant", self.max_sessions_per_tenant,
                f"{caller.describe()} holds {held} sessions on env worker {self.instance} "
                f"(NEXUS_ENV_MAX_SESSIONS_PER_TENANT); close one, or let an unused one's lease lapse",
                SWEEP_EVERY_S, setting="NEXUS_ENV_MAX_SESSIONS_PER_TENANT", held=held)

    @op(ops.ENV_RESET)
    async def reset(self, req: EnvResetRequest) -> EnvObs:
        s = self._session(req.session)
        async with s.lock:
            obs, info = await self._call(s, s.env.reset, req.seed, req.task)
            s.reset_done = True
        return to_env_obs(s.id, obs, info=info)

    @op(ops.ENV_STEP)
    async def step(self, req: EnvStepRequest) -> EnvObs:
        s = self._session(req.session)
        try:
            action = np.asarray(req.action, dtype=np.float32)
        except (TypeError, ValueError) as exc:  # a bfloat16 tensor has no numpy dtype
            raise InvalidField("action", f"must be a float array: {exc}") from None
        async with s.lock:
            obs, reward, terminated, truncated, info = await self._call(s, s.env.step, action)
            s.steps += 1
        return to_env_obs(s.id, obs, reward, terminated, truncated, info)

    @op(ops.ENV_CLOSE)
    async def close(self, req: EnvCloseRequest) -> Ok:
        s = self._session(req.session)
        await self._drop(s, "closed by its client")
        return Ok(detail=f"session {s.id} closed")

    # -- datasets -----------------------------------------------------------------------
    @op(ops.ENV_SAMPLE)
    async def sample(self, req: SampleRequest) -> DatasetBatch:
        """Frames of a local LeRobot v3.0 dataset; readers stay open (bounded) between calls."""
        # n and len(indices) are bounded by SampleRequest itself (at decode, SAMPLE_MAX_FRAMES).
        confine(req.root, "root", caller_roots(self.cfg.data_dir))
        reader = await self._reader(req.root)
        if req.indices:
            batch = await asyncio.to_thread(reader.get_batch, np.asarray(req.indices, np.int64))
        else:
            batch = await asyncio.to_thread(reader.sample, req.n, req.seed)
        return DatasetBatch(root=req.root, index=batch.index_B, episode_index=batch.episode_index_B,
                            frame_index=batch.frame_index_B, timestamp=batch.timestamp_B, tasks=list(batch.task_B),
                            images=batch.images, state=batch.state_B_S, action=batch.action_B_A)

    async def _reader(self, root: str) -> Any:
        from envs.lerobot import LeRobotReader

        reader = self.readers.pop(root, None)
        if reader is None:
            reader = await asyncio.to_thread(LeRobotReader, root)
            while len(self.readers) >= MAX_READERS:
                _, old = self.readers.popitem(last=False)
                old.close()
        self.readers[root] = reader  # most recently used last
        return reader

    # -- workflows -----------------------------------------------------------------------
    @op(ops.ENV_START_WORKFLOW)
    async def start_workflow(self, req: WorkflowSpec) -> Ok:
        check_token("workload", req.workload)  # its events go to a subject named after it
        if req.hosted:  # the tenant's own env runs only on its own machine (docs/hosted_envs.md)
            raise FailedPrecondition(f"workload {req.workload}'s env is hosted by its tenant ({req.hosted}); an env "
                                     "worker never runs it", details={"workload": req.workload})
        if req.workload in self.workflows:
            return Ok(detail=f"workflow of {req.workload} already running on {self.instance}")
        # The loops are user-level code on the SDK's public primitives (workflows/): the recipe
        # makes its own client to this worker's cluster.
        make = recipes.lookup(req.kind)
        workflow = make(req, data_dir=self.cfg.data_dir, log=self.log, nats_url=self.cfg.nats_url,
                        prefix=self.cfg.prefix)
        self.workflows[req.workload] = workflow
        workflow.task = self.spawn(self._run_workflow(workflow), f"workflow-{req.workload}")
        self.log.info("workflow started", workload=req.workload, tenant=req.tenant, kind=req.kind)
        return Ok(detail=f"{req.kind} workflow of {req.workload} running on {self.instance}")

    async def _run_workflow(self, workflow: Any) -> None:
        try:
            await workflow.main()
        finally:
            self.workflows.pop(workflow.spec.workload, None)

    @op(ops.ENV_STOP_WORKFLOW)
    async def stop_workflow(self, req: WorkloadRef) -> Ok:
        workflow = self.workflows.get(req.workload)
        if workflow is None:
            raise NotFound(f"no workflow of workload {req.workload!r} on {self.instance}")
        await workflow.stop()
        return Ok(detail=f"workflow of {req.workload} stopped")

    async def _call(self, s: _Session, fn, *args) -> Any:
        try:
            # In the session's child process, bounded by NEXUS_SIM_TIMEOUT_S (envs.simproc).
            return await fn(*args)
        except SimFailure as exc:
            # Hung (its child killed) or crashed (its child died or the simulator raised): this
            # session is gone, every other one goes on.
            await self._drop(s, f"simulator {exc.what}: {exc.message}")
            raise FailedPrecondition(f"session {s.id} ({s.env_id}) {exc.what} and was closed: {exc.message}; "
                                     "open a new one", details={"session": s.id, **exc.details}) from None
        # Any other NexusError is the caller's mistake (bad action shape, unknown task): the
        # session stays usable.

    async def _drop(self, s: _Session, reason: str) -> None:
        self.sessions.pop(s.id, None)
        await s.env.close()  # bounded: a close past its grace is a kill; a dead child is reaped
        self.log.info("session closed", session=s.id, reason=reason, steps=s.steps)

    async def _sweep_loop(self) -> None:
        while True:
            await self.idle("session-sweeper", SWEEP_EVERY_S)
            now = time.monotonic()
            for s in list(self.sessions.values()):
                if now - s.last_used > s.lease_s and not s.lock.locked():
                    self.expired += 1
                    await self._drop(s, f"lease of {s.lease_s:g} s expired (client gone)")

    async def on_drain(self) -> None:
        # 1. stop the workflows (their half-filled jobs are failed by the master), 2. hand
        # their workloads back so another worker resumes them, 3. close the sessions.
        workloads = list(self.workflows)
        for p in list(self.workflows.values()):
            await p.stop()
        if workloads:
            assert self.bus is not None
            try:
                await retry(self.bus.call, ops.MASTER_HANDBACK,
                            HandbackRequest(worker=self.instance, workloads=workloads), timeout_s=10,
                            policy=DRAIN_RELEASE)
                self.log.info("workloads handed back", workloads=workloads)
            except NexusError as exc:
                # The master is gone too: at its start it re-pends workloads of workers that are gone.
                self.log.warning("handback failed", error=exc.message, workloads=workloads)
        for s in list(self.sessions.values()):
            await self._drop(s, "worker draining")


def spec_dict(spec: Any) -> dict[str, Any]:
    d = asdict(spec)
    # Tuples become lists for msgpack; nested dataclasses are already dicts.
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def to_env_obs(sid: str, obs: Any, reward: float = 0.0, terminated: bool = False, truncated: bool = False,
               info: dict[str, Any] | None = None) -> EnvObs:
    return EnvObs(session=sid, images={k: np.asarray(v) for k, v in obs.images.items()},
                  state=np.asarray(obs.state, dtype=np.float32), instruction=obs.instruction,
                  reward=float(reward), terminated=bool(terminated), truncated=bool(truncated),
                  info=_plain(info or {}))


def _plain(info: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in info.items():
        if isinstance(v, np.generic):
            v = v.item()
        out[str(k)] = v if isinstance(v, str | int | float | bool | type(None)) else str(v)
    return out
