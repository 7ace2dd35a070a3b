"""What every workflow shares: budget and target, reserve / put / mark_ready with their
retries, waiting for the trained result, episodes through the inference service, events.

Built only on the SDK's public primitives (`sdk.client.AsyncClient`), as a user's own loop
would be (examples/custom_loop.py): nothing here reaches into a role's internals.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import ValidationError

from envs import simproc
from protocol.errors import Busy, FailedPrecondition, InvalidField, NexusError, NotFound
from protocol.messages import JobRecord, WorkflowSpec, QueuePutRequest, TaskResult, WorkloadEvent
from protocol.policy import SIM_REPLACE, RetryPolicy
from protocol.recipe_configs import RecipeConfig
from protocol.recipes import RecipeFactory
from sdk.client import AsyncClient, retry_through_outage
from sdk.tracing import current_context, detached, new_root, tracer
from workflows.evaluation import evaluate

# A put refused with Busy (the tenant's SFT prefetch cap: the trainer is behind) waits for the
# trainer; an hour without room means the trainers are gone, and the workload fails saying so.
PUT_BUSY = RetryPolicy("put_busy", deadline_s=3600.0, backoff_s=0.2, max_backoff_s=2.0)


class JobsNotTrained(RuntimeError):
    """Every training job of a workload failed or was dropped: the workload failed."""


@dataclass
class Progress:
    episodes: int = 0
    successes: int = 0
    returns: list[float] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)
    version: int = 0
    items: int = 0
    # Optimizer steps (micro-batches) of this workload's budget trained or queued, a resumed
    # workflow's predecessors' included (WorkflowSpec.steps_done).
    steps: int = 0
    started: float = field(default_factory=time.monotonic)


class _StdLog:
    """The structured-log calls a workflow makes (``log.warning("what", key=value)``), on the
    stdlib logger, for a workflow run outside an env worker."""

    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(name)

    def _emit(self, level: int, event: str, exc_info: Any = None, **kw: Any) -> None:
        self._log.log(level, "%s %s", event, " ".join(f"{k}={v}" for k, v in kw.items()), exc_info=exc_info)

    def info(self, event: str, **kw: Any) -> None:
        self._emit(logging.INFO, event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._emit(logging.WARNING, event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._emit(logging.ERROR, event, **kw)


class Workflow:
    """One workload's data side: subclasses implement `train` (sft, rl) or are the eval.

    ``client``: an `AsyncClient` (connected by `main`); ``spec``: the workload's
    `WorkflowSpec` (compiled by the master from its spec); ``data_dir``: where recorded demos
    go; ``log``: a structured logger (an env worker's own, or the stdlib's).

    ``config_model``: the recipe's config (a `protocol.recipe_configs.RecipeConfig`), which
    ``spec.algo`` is validated into once, here, as ``self.config``; None: the recipe takes
    none (``spec.algo`` must be empty). ``family``: the built-in task whose rules the kind
    follows (`protocol.recipes.FAMILIES`: sft, rl or eval): the master checks a spec of the
    kind by them, and here an eval-family run is its own evaluation (no closing one)."""

    kind = ""
    family: ClassVar[str] = ""
    config_model: ClassVar[type[RecipeConfig] | None] = None

    def __init__(self, client: AsyncClient, spec: WorkflowSpec, *, data_dir: str | Path = ".",
                 log: Any = None) -> None:
        self.client, self.spec = client, spec
        self.config = self.read_config(spec)
        self.data_dir = Path(data_dir)
        self.log = log if log is not None else _StdLog(f"workflows.{spec.kind}")
        # A resumed workflow carries on where its workload stands: the steps and episodes of its
        # budget already spent, and the jobs still to train that it waits for before it is done.
        self.progress = Progress(steps=spec.steps_done, episodes=spec.episodes_done, jobs=list(spec.jobs))
        self.task: asyncio.Task | None = None  # set by whoever runs `main` as a task
        self.state = "starting"
        self.error = ""
        self.final: dict[str, float] = {}
        # The evaluation's per-task table (workflows/evaluation.py), sent with every event after it.
        self.per_task: list[TaskResult] = []
        # (task index, name, instruction) of the last episode's task, when its env reports one.
        self.last_task: tuple[int, str, str] | None = None
        self._life = uuid.uuid4().hex[:8]  # this incarnation (a resumed workload gets a new one)
        self._reserves = 0
        self.target_message = ""  # set once schedule.budget.target is reached
        # Where the workload started (the env worker's start_workflow span): each update's
        # trace links to it, and is never its child (one trace per update, not per workload).
        self._origin: Any = None
        self._sim_failures = 0  # simulators failed in a row (SIM_REPLACE bounds it)
        self.jobs_not_trained: list[JobRecord] = []  # failed or dropped as stale (`_wait_jobs`)

    @classmethod
    def read_config(cls, spec: WorkflowSpec) -> Any:
        """``spec.algo`` as the recipe's typed config; a bad value is `InvalidField` naming
        ``algo.<field>`` (a start the master did not compile, or a master of another version)."""
        if cls.config_model is None:
            if spec.algo:
                raise InvalidField("algo", f"a {spec.kind} workflow takes no algorithm config; got {sorted(spec.algo)}")
            return None
        try:
            return cls.config_model.model_validate(spec.algo)
        except ValidationError as exc:
            from master.spec_schema import spec_errors

            errors = spec_errors(cls.config_model, exc, spec.algo)
            first = errors[0]
            raise InvalidField(f"algo.{first['field']}", "; ".join(
                [first["message"], *(f"algo.{e['field']}: {e['message']}" for e in errors[1:])]),
                details={"errors": errors}) from None

    def status(self) -> dict[str, Any]:
        return {"kind": self.spec.kind, "tenant": self.spec.tenant, "state": self.state,
                "episodes": self.progress.episodes, "version": self.progress.version, "error": self.error}

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def train(self) -> None:
        raise NotImplementedError

    async def main(self) -> None:
        """Connect, run the workflow (and, for sft / rl with eval episodes, the closing
        evaluation of the final version), publish ``done`` (completed or failed), close."""
        self._origin = current_context()
        # This task's spans start traces of their own (an update, an episode), not children of
        # the start_workflow request that spawned it (asyncio copied its context into the task).
        with detached():  # a caller's own task gets its context back after
            await self._main()

    async def _main(self) -> None:
        await self.client.connect()
        try:
            self.state = "running"
            await self.train()
            if self.family != "eval" and self.spec.eval_episodes:
                trained = dict(self.final)
                self.progress = Progress(version=self.progress.version, jobs=self.progress.jobs)
                await evaluate(self)  # the closing evaluation of the final version
                self.final = {**trained, **{f"eval_{k}": v for k, v in self.final.items()}}
            self.state = "done"
            message = self.target_message or self._budget_message()
            if self.jobs_not_trained:
                first = self.jobs_not_trained[0]
                self.final["jobs_not_trained"] = float(len(self.jobs_not_trained))
                message += (f"; {len(self.jobs_not_trained)} of {len(self.progress.jobs)} jobs not trained "
                            f"(first: {first.job} {first.state}: {first.reason or 'no reason recorded'})")
            await self._event("done", message=message, metrics=self.final)
        except asyncio.CancelledError:
            self.state = "cancelled"
            raise
        except Exception as exc:
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            self.log.error("workflow failed", workload=self.spec.workload, exc_info=exc)
            await self._event("done", state="failed", message=self.error)
        finally:
            await self.client.close()

    def update_span(self) -> Any:
        """One training update (an RL rollout and its job, an SFT job) as a new trace, from
        the env steps through the trainer to the weight sync (docs/observability.md)."""
        s = self.spec
        return new_root(tracer(), f"workflow.{s.kind}.update",
                        {"nexus.tenant": s.tenant, "nexus.workload": s.workload, "nexus.update": len(self.progress.jobs)},
                        links=[self._origin] if self._origin is not None else [])

    async def _event(self, kind: str, state: str = "", message: str = "", metrics: dict[str, float] | None = None) -> None:
        ev = WorkloadEvent(workload=self.spec.workload, tenant=self.spec.tenant, kind=kind, state=state,  # type: ignore[arg-type]
                           step=self.progress.version, episodes=self.progress.episodes,
                           metrics=metrics or {}, message=message, at=time.time(), per_task=list(self.per_task))
        try:
            await self.client.publish_event(ev)
        except NexusError as exc:
            self.log.warning("event publish failed", error=str(exc))

    async def _retry(self, fn, *args, **kwargs) -> Any:
        """Ride out a master or inferencer restart (calls safe to repeat only)."""
        return await retry_through_outage(
            fn, *args, on_retry=lambda exc: self.log.warning(
                "retrying after outage", call=getattr(fn, "__name__", "?"), error=exc.message), **kwargs)

    def _target_reached(self, values: list[float]) -> bool:
        """schedule.budget.target: the rolling mean of the last ``target_window`` values (the
        window full) against its bound."""
        s = self.spec
        if not s.target_metric or len(values) < s.target_window:
            return False
        mean = float(np.mean(values[-s.target_window:]))
        hit = ((s.target_at_least is not None and mean >= s.target_at_least)
               or (s.target_at_most is not None and mean <= s.target_at_most))
        if hit and not self.target_message:
            bound = f">= {s.target_at_least:g}" if s.target_at_least is not None else f"<= {s.target_at_most:g}"
            self.target_message = (f"target reached: {s.target_metric} {mean:.4g} {bound} "
                                   f"(mean of the last {s.target_window})")
        return hit

    def _budget_message(self) -> str:
        """The done event's message: what this workload trained, from which version to which."""
        s, p = self.spec, self.progress
        # Why it stopped, when a limit other than its steps did it (a wall-clock or episode
        # budget); a workload that trained its steps simply says what it trained.
        why = ""
        if s.max_wall_s and time.monotonic() - p.started >= s.max_wall_s:
            why = f"its wall-clock budget of {s.max_wall_s:g} s ran out"
        elif s.max_episodes and p.episodes >= s.max_episodes:
            why = f"its {s.max_episodes} episodes ran"
        if self.family == "eval":
            return f"evaluated {p.episodes} episodes"
        if s.start_version < 0:
            return why or "finished"
        steps = max(0, p.version - s.start_version)
        of = f"/{s.max_steps}" if s.max_steps else ""
        text = f"trained {steps}{of} steps (version {s.start_version} -> {p.version})"
        return f"{text}; {why}" if why else text

    def _budget_left(self) -> bool:
        s, p = self.spec, self.progress
        if self.target_message:
            return False
        # This workload's steps (queued ones included: each will train), not the tenant's version.
        if s.max_steps and p.steps >= s.max_steps:
            return False
        if s.max_episodes and p.episodes >= s.max_episodes:
            return False
        if s.max_wall_s and time.monotonic() - p.started >= s.max_wall_s:
            return False
        return True

    async def _refresh_version(self) -> None:
        ref = await self._retry(self.client.latest_weights, self.spec.tenant)
        if ref is not None:  # never back: a trained job's version may run ahead of the last export
            self.progress.version = max(self.progress.version, ref.version)

    async def _reserve(self, task: str) -> str:
        # One key per reserve of this workflow's life: a retry after a lost reply (timeout)
        # gets the same job back instead of leaving an orphan on the tenant's in-flight cap.
        self._reserves += 1
        key = f"{self.spec.workload}.{self._life}.{self._reserves}"
        while True:
            try:
                return (await self._retry(self.client.reserve, self.spec.tenant, task, key=key,
                                          workload=self.spec.workload)).job
            except Busy as exc:  # back-pressure: the trainer is behind; wait, do not pile up
                await asyncio.sleep(float(exc.details.get("retry_after_s", 0.5)))
                await self._refresh_version()
                if not self._budget_left():
                    return ""

    async def _wait_jobs(self) -> None:
        """Wait until every job this workflow queued is trained (or dropped / failed). None of
        them trained is the workload's failure, naming the first job's reason (a workload whose
        every job failed said `completed, trained 0/12 steps`); some not trained are counted in
        its final metrics (`jobs_not_trained`) and its done message."""
        lost: list[JobRecord] = []
        trained = 0
        for job in self.progress.jobs:
            try:
                rec = await self._retry(self.client.wait_job, self.spec.tenant, job, timeout_s=3600)
            except NotFound:
                trained += 1  # compacted: the master deletes only finished records
                continue
            if rec.state == "cleared":
                trained += 1
            else:
                lost.append(rec)
        if lost and not trained:
            first = lost[0]
            raise JobsNotTrained(f"none of its {len(lost)} training job(s) trained: job {first.job} "
                                 f"{first.state}: {first.reason or 'no reason recorded'}")
        self.jobs_not_trained = lost
        await self._final_export()
        await self._refresh_version()

    async def _final_export(self) -> None:
        """outputs.export_every_steps skips exports between every N steps: the workload's last
        trained version is exported here if the trainer skipped it."""
        if not self.progress.jobs:
            return
        try:
            last = await self._retry(self.client.job, self.spec.tenant, self.progress.jobs[-1])
        except NotFound:
            return
        ref = await self._retry(self.client.latest_weights, self.spec.tenant)
        if last.trained_version > (ref.version if ref is not None else -1):
            await self._retry(self.client.export_params, self.spec.tenant)

    async def _put(self, item: QueuePutRequest) -> bool:
        """queue_put that waits out the SFT prefetch cap (Busy) with the master's retry hint.

        False when the job is no longer open (the master sealed or failed it while this
        workflow was thought gone): the caller moves on to a new job; what was put is kept."""
        deadline = time.monotonic() + PUT_BUSY.deadline_s
        attempt = 0
        while True:
            try:
                await self._retry(self.client.queue_put, item)
                return True
            except FailedPrecondition:
                rec = await self._retry(self.client.job, item.tenant, item.job)
                if rec.state in ("reserved", "filling"):
                    raise
                self.log.warning("job closed under its workflow; moving on", job=item.job, state=rec.state,
                                 reason=rec.reason)
                return False
            except Busy as exc:
                attempt += 1
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(PUT_BUSY.delay(attempt, float(exc.details.get("retry_after_s", 0.0))))

    async def _mark_ready(self, job: str) -> None:
        """mark_ready; a job the master already sealed (ready) is waited for like any other,
        one it failed is left out."""
        try:
            await self._retry(self.client.mark_ready, self.spec.tenant, job)
        except FailedPrecondition:
            rec = await self._retry(self.client.job, self.spec.tenant, job)
            if rec.state == "failed" or rec.state == "dropped_stale":
                return
            if rec.state in ("reserved", "filling"):
                raise
        self.progress.jobs.append(job)

    # -- episodes ------------------------------------------------------------------------
    async def _episode(self, env: Any, seed: int, sample: bool, version: int,
                       record: list[dict[str, Any]] | None, task: int | None = None) -> tuple[bool, float]:
        """One episode with the inference service's policy; transitions go to ``record``.
        ``task``: the env's task index to reset to (None: the env draws one from the seed)."""
        with tracer().start_as_current_span("workflow.episode", attributes={
                "nexus.tenant": self.spec.tenant, "nexus.workload": self.spec.workload, "nexus.seed": seed}):
            return await self._episode_steps(env, seed, sample, version, record, task)

    async def _episode_steps(self, env: Any, seed: int, sample: bool, version: int,
                             record: list[dict[str, Any]] | None, task: int | None = None) -> tuple[bool, float]:
        # Every simulator call in its env's child process, bounded (envs.simproc): a hung one
        # (killed) raises SimTimeout, a dead one SimCrashed.
        obs, info = await env.reset(seed) if task is None else await env.reset(seed, task=task)
        index = info.get("task_index")
        self.last_task = ((int(index), str(info.get("task", "")), obs.instruction)
                          if isinstance(index, (int, np.integer)) and not isinstance(index, bool) else None)
        low, high = np.asarray(env.spec.action_low, np.float32), np.asarray(env.spec.action_high, np.float32)
        total, success, done = 0.0, False, False
        while not done:
            reply = await self.client.predict(self.spec.policy_tenant or self.spec.tenant, obs.images, obs.state,
                                              obs.instruction,
                                              version=version, sample=sample, timeout_s=60,
                                              workload=self.spec.workload)  # metered to this workload
            chunk = np.asarray(reply.actions, np.float32)
            reward, terminated, truncated = 0.0, False, False
            next_obs = obs
            # The whole chunk: the horizon the policy was trained to act over.
            for a in chunk:
                next_obs, r, terminated, truncated, info = await env.step(np.clip(a, low, high))
                reward += float(r)
                if terminated or truncated:
                    break
            if record is not None:
                record.append({"obs": obs, "action": chunk, "log_prob": reply.log_prob, "value": reply.value,
                               "reward": reward, "terminated": terminated, "truncated": truncated,
                               "version": reply.version})
            total += reward
            success = success or bool(info.get("success", False))
            done = terminated or truncated
            obs = next_obs
        self._sim_failures = 0  # a whole episode: the simulator works (SIM_REPLACE counts in a row)
        return success, total

    # -- simulators (envs.simproc: one child process each) ------------------------------------
    async def _make_env(self) -> simproc.SimEnv:
        """A simulator of the workload's env in a child process; with every child slot of this
        process taken (NEXUS_SIM_PROCS_MAX) it waits up to NEXUS_SIM_TIMEOUT_S for one."""
        pool = simproc.pool()
        return await pool.make(self.spec.env_id, self.spec.env_options, wait_s=pool.timeout_s)

    async def _make_envs(self, n: int) -> list[simproc.SimEnv]:
        """``n`` simulators, their scene builds at once (each in its own process)."""
        made = await asyncio.gather(*(self._make_env() for _ in range(n)), return_exceptions=True)
        failed = [m for m in made if isinstance(m, BaseException)]
        if failed:
            await asyncio.gather(*(m.close() for m in made if isinstance(m, simproc.SimEnv)))
            raise failed[0]
        return list(made)  # type: ignore[arg-type]

    async def _replace_env(self, env: simproc.SimEnv, exc: simproc.SimFailure) -> simproc.SimEnv:
        """A new simulator for one that hung or crashed (its episode is lost). Past
        SIM_REPLACE.attempts failures in a row the simulator is broken: the workload fails."""
        await env.close()  # its process is gone already; this frees its slot for sure
        self._sim_failures += 1
        if self._sim_failures > SIM_REPLACE.attempts:
            raise simproc.SimFailure(f"{self._sim_failures} simulators of {self.spec.env_id} failed in a row "
                                     f"(policy {SIM_REPLACE.name}); the last: {exc.message}",
                                     details=exc.details) from None
        await asyncio.sleep(SIM_REPLACE.delay(self._sim_failures))
        return await self._make_env()

    def _episode_done(self, success: bool, ret: float) -> None:
        p = self.progress
        p.episodes += 1
        p.successes += int(success)
        p.returns.append(ret)


def as_recipe(cls: type[Workflow]) -> RecipeFactory:
    """``cls`` as a `protocol.recipes` factory (``register(kind, as_recipe(cls))``): on the
    host's ``client``, or on a new `AsyncClient` of ``nats_url`` / ``prefix`` (an env worker's
    cluster: the client is made here, on the SDK's floor, not by the role). It carries the
    class's ``config_model`` and ``family``: `register` declares the kind with them."""

    def make(spec: WorkflowSpec, *, data_dir: str | Path = ".", log: Any = None, client: AsyncClient | None = None,
             nats_url: str = "", prefix: str = "") -> Workflow:
        if client is None:
            client = AsyncClient(nats_url, prefix, timeout_s=60)
        return cls(client, spec, data_dir=data_dir, log=log)

    make.__qualname__ = f"{cls.__name__}.recipe"
    make.config_model, make.family = cls.config_model, cls.family  # type: ignore[attr-defined]
    return make
