"""Producers: the data side of the three workflows, run by env workers.

    RL    episodes with the current policy through the inference service -> transitions with
          behaviour version, log-prob, value, reward, done -> GAE -> reserve / queue_put /
          mark_ready -> (trainer: PPO) -> new version synced back; asynchronous, bounded by
          the in-flight cap and the staleness bound; rollouts gated by the master
          (1 active per tenant, 3 globally).
    SFT   dataset micro-batches (recorded expert demos or a LeRobot root) reserved, put and
          marked ready at once; no weight sync between batches.
    Eval  read-only: the version is pinned once, N episodes with the mean action, success
          rate and return; no training queue, no optimizer, no version change.

Each producer publishes `WorkloadEvent`s (progress, done) on ``<prefix>.workloads.events.<id>``.
The environment runs in-process on the worker (it *is* the environment service); the policy
is always the inference service's, over NATS.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from actors.bus import retry_through_outage
from protocol.errors import Busy, FailedPrecondition, InvalidField, NexusError, NotFound
from protocol.messages import ProducerSpec, QueuePutRequest, WorkloadEvent
from protocol.policy import RetryPolicy

# A put refused with Busy (the tenant's SFT prefetch cap: the trainer is behind) waits for the
# trainer; an hour without room means the trainers are gone, and the workload fails saying so.
PUT_BUSY = RetryPolicy("put_busy", deadline_s=3600.0, backoff_s=0.2, max_backoff_s=2.0)

# Defaults with a reason each; a spec's algo dict overrides them.
RL_DEFAULTS = {
    "gamma": 0.99,  # episodes are short (<= 50 steps): little discounting needed
    "gae_lambda": 0.95,
    "episodes_per_update": 8,  # one job = the transitions of this many episodes
    "micro_batch": 64,  # rows per queue item (a trainer step each)
    "normalize_advantages": True,  # standardise over each rollout (master/spec.py)
    "parallel_envs": 1,  # episodes rolled out at once (their requests share inferencer groups)
    "exec_steps": 0,  # env steps per predicted chunk; 0 = the whole chunk
}
MAX_PARALLEL_ENVS = 256  # the spec's bound (master/spec.py PPOAlgorithm.parallel_envs)
SFT_DEFAULTS = {"batch_size": 32, "items_per_job": 1}
EVAL_DEFAULTS = {"exec_steps": 0}


def gae(rewards_T: np.ndarray, values_T: np.ndarray, dones_T: np.ndarray, last_value: float,
        gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over one trajectory segment.

    ``dones_T[t]`` is True where the episode *terminated* after step t (no bootstrap); a
    truncated segment end bootstraps from ``last_value``. Returns (advantages_T, returns_T).
    """
    T = len(rewards_T)
    adv = np.zeros(T, np.float32)
    last = 0.0
    for t in reversed(range(T)):
        next_value = last_value if t == T - 1 else values_T[t + 1]
        nonterminal = 0.0 if dones_T[t] else 1.0
        delta = rewards_T[t] + gamma * next_value * nonterminal - values_T[t]
        last = delta + gamma * lam * nonterminal * last
        adv[t] = last
    return adv, (adv + values_T).astype(np.float32)


@dataclass
class Progress:
    episodes: int = 0
    successes: int = 0
    returns: list[float] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)
    version: int = 0
    items: int = 0
    started: float = field(default_factory=time.monotonic)


class Producer:
    def __init__(self, worker: Any, spec: ProducerSpec) -> None:
        from sdk.client import AsyncClient

        self.worker, self.spec = worker, spec
        self.client = AsyncClient(worker.cfg.nats_url, worker.cfg.prefix, timeout_s=60)
        self.progress = Progress()
        self.task: asyncio.Task | None = None
        self.state = "starting"
        self.error = ""
        self.final: dict[str, float] = {}
        self._life = uuid.uuid4().hex[:8]  # this incarnation (a resumed workload gets a new one)
        self._reserves = 0
        self.target_message = ""  # set once schedule.budget.target is reached

    def status(self) -> dict[str, Any]:
        return {"kind": self.spec.kind, "tenant": self.spec.tenant, "state": self.state,
                "episodes": self.progress.episodes, "version": self.progress.version, "error": self.error}

    def start(self) -> None:
        self.task = self.worker.spawn(self._main(), f"producer-{self.spec.workload}")

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def _main(self) -> None:
        await self.client.connect()
        try:
            self.state = "running"
            if self.spec.kind == "rl":
                await self._rl()
            elif self.spec.kind == "sft":
                await self._sft()
            else:
                await self._eval()
            if self.spec.kind != "eval" and self.spec.eval_episodes:
                trained = dict(self.final)
                self.progress = Progress(version=self.progress.version, jobs=self.progress.jobs)
                await self._eval()  # the closing evaluation of the final version
                self.final = {**trained, **{f"eval_{k}": v for k, v in self.final.items()}}
            self.state = "done"
            await self._event("done", message=self.target_message or "budget reached", metrics=self.final)
        except asyncio.CancelledError:
            self.state = "cancelled"
            raise
        except Exception as exc:
            self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            self.worker.log.error("producer failed", workload=self.spec.workload, exc_info=exc)
            await self._event("done", state="failed", message=self.error)
        finally:
            self.worker.producers.pop(self.spec.workload, None)
            await self.client.close()

    async def _event(self, kind: str, state: str = "", message: str = "", metrics: dict[str, float] | None = None) -> None:
        ev = WorkloadEvent(workload=self.spec.workload, tenant=self.spec.tenant, kind=kind, state=state,  # type: ignore[arg-type]
                           step=self.progress.version, episodes=self.progress.episodes,
                           metrics=metrics or {}, message=message, at=time.time())
        try:
            await self.client.bus.publish(self.client.names.workload_events(self.spec.workload), ev)
        except NexusError as exc:
            self.worker.log.warning("event publish failed", error=str(exc))

    async def _retry(self, fn, *args, **kwargs) -> Any:
        """Ride out a master or inferencer restart (calls safe to repeat only)."""
        return await retry_through_outage(
            fn, *args, on_retry=lambda exc: self.worker.log.warning(
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

    def _budget_left(self) -> bool:
        s, p = self.spec, self.progress
        if self.target_message:
            return False
        if s.max_steps and p.version >= s.max_steps:
            return False
        if s.max_episodes and p.episodes >= s.max_episodes:
            return False
        if s.max_wall_s and time.monotonic() - p.started >= s.max_wall_s:
            return False
        return True

    async def _refresh_version(self) -> None:
        ref = await self._retry(self.client.latest_weights, self.spec.tenant)
        if ref is not None:
            self.progress.version = ref.version

    async def _reserve(self, task: str) -> str:
        # One key per reserve of this producer's life: a retry after a lost reply (timeout)
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
        """Wait until every job this producer queued is trained (or dropped / failed)."""
        for job in self.progress.jobs:
            try:
                await self._retry(self.client.wait_job, self.spec.tenant, job, timeout_s=3600)
            except NotFound:
                pass  # compacted: the master deletes only finished records
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
        producer was thought gone): the caller moves on to a new job; what was put is kept."""
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
                self.worker.log.warning("job closed under its producer; moving on", job=item.job, state=rec.state,
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
    async def _episode(self, env: Any, seed: int, sample: bool, version: int, exec_steps: int,
                       record: list[dict[str, Any]] | None) -> tuple[bool, float]:
        """One episode with the inference service's policy; transitions go to ``record``."""
        obs, info = await asyncio.to_thread(env.reset, seed)
        low, high = np.asarray(env.spec.action_low, np.float32), np.asarray(env.spec.action_high, np.float32)
        total, success, done = 0.0, False, False
        while not done:
            reply = await self.client.predict(self.spec.policy_tenant or self.spec.tenant, obs.images, obs.state,
                                              obs.instruction,
                                              version=version, sample=sample, timeout_s=60)
            chunk = np.asarray(reply.actions, np.float32)
            n = len(chunk) if exec_steps <= 0 else min(exec_steps, len(chunk))
            reward, terminated, truncated = 0.0, False, False
            next_obs = obs
            for a in chunk[:n]:
                next_obs, r, terminated, truncated, info = await asyncio.to_thread(env.step, np.clip(a, low, high))
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
        return success, total

    def _episode_done(self, success: bool, ret: float) -> None:
        p = self.progress
        p.episodes += 1
        p.successes += int(success)
        p.returns.append(ret)

    # -- RL ------------------------------------------------------------------------------
    async def _rl(self) -> None:
        import envs

        algo = {**RL_DEFAULTS, **self.spec.algo}
        # Several episodes at once: their predict requests meet in the inferencer's groups
        # (one base forward for all of them) instead of queueing one round trip at a time.
        n_envs = max(1, int(algo.get("parallel_envs", 1)))
        if n_envs > MAX_PARALLEL_ENVS:  # the spec bounds it too; a raw start_producer must not
            raise InvalidField("algo.parallel_envs", f"{n_envs} is over the limit of {MAX_PARALLEL_ENVS}")
        pool = [await asyncio.to_thread(envs.make, self.spec.env_id, **self.spec.env_options) for _ in range(n_envs)]
        seed = self.spec.seed * 1_000_003
        window: list[tuple[bool, float]] = []
        try:
            while self._budget_left():
                await self._rollout_gate(True)
                try:
                    segments: list[list[dict[str, Any]]] = []
                    # Either so many episodes, or episodes until so many policy steps.
                    by_steps = int(algo.get("steps_per_update") or 0)
                    while (sum(len(seg) for seg in segments) < by_steps if by_steps
                           else len(segments) < int(algo["episodes_per_update"])):
                        k = n_envs if by_steps else min(n_envs, int(algo["episodes_per_update"]) - len(segments))
                        records: list[list[dict[str, Any]]] = [[] for _ in range(k)]
                        results = await asyncio.gather(*(
                            self._episode(pool[j], seed + j, True, -1, int(algo["exec_steps"]), records[j])
                            for j in range(k)))
                        seed += k
                        for steps, (success, ret) in zip(records, results):
                            segments.append(steps)
                            self._episode_done(success, ret)
                            window.append((success, ret))
                finally:
                    await self._rollout_gate(False)
                await self._queue_rl(segments, algo)
                if self.spec.target_metric:
                    key = 0 if self.spec.target_metric == "success_rate" else 1
                    self._target_reached([float(w[key]) for w in window])
                window = window[-max(50, self.spec.target_window):]
                await self._refresh_version()
                await self._event("progress", metrics={
                    "success_rate": float(np.mean([w[0] for w in window])),
                    "mean_return": float(np.mean([w[1] for w in window])),
                })
            await self._wait_jobs()
            self.final = {"success_rate": float(np.mean([w[0] for w in window])) if window else 0.0,
                          "mean_return": float(np.mean([w[1] for w in window])) if window else 0.0}
        finally:
            for env in pool:
                env.close()

    async def _rollout_gate(self, begin: bool) -> None:
        from protocol.messages import JobRef, Ok

        op = "rollout_begin" if begin else "rollout_end"
        req = JobRef(tenant=self.spec.tenant, job=self.spec.workload)
        while True:
            try:
                await self._retry(self.client.bus.request, self.client.names.master(op), req, Ok, timeout_s=30)
                return
            except Busy as exc:
                await asyncio.sleep(float(exc.details.get("retry_after_s", 0.5)))

    async def _queue_rl(self, segments: list[list[dict[str, Any]]], algo: dict[str, Any]) -> None:
        rows: list[dict[str, Any]] = []
        for steps in segments:
            rewards = np.array([s["reward"] for s in steps], np.float32)
            values = np.array([s["value"] for s in steps], np.float32)
            dones = np.array([s["terminated"] for s in steps], bool)
            # A truncated episode bootstraps from its last value estimate (time limit, not failure).
            last_value = 0.0 if steps[-1]["terminated"] else float(values[-1])
            adv, ret = gae(rewards, values, dones, last_value, float(algo["gamma"]), float(algo["gae_lambda"]))
            for s, a, r in zip(steps, adv, ret):
                rows.append({**s, "adv": a, "ret": r})
        if not rows:
            return
        if algo.get("normalize_advantages", True) and len(rows) > 1:
            adv_all = np.array([r["adv"] for r in rows], np.float32)
            mean, std = float(adv_all.mean()), float(adv_all.std())
            rows = [{**r, "adv": (r["adv"] - mean) / (std + 1e-8)} for r in rows]
        # PPO epochs: each pass over the rollout, in a fresh order, is more micro-batches of
        # the same job (the trainer applies them in order, one step each).
        order_rng = np.random.default_rng(self.progress.episodes)
        passes = []
        for _ in range(max(1, int(algo.get("epochs", 1)))):
            passes.extend(rows[i] for i in order_rng.permutation(len(rows)))
        rows = passes
        job = await self._reserve("rl")
        if not job:
            return
        mb = int(algo["micro_batch"])
        for seq, lo in enumerate(range(0, len(rows), mb)):
            part = rows[lo: lo + mb]
            item = QueuePutRequest(
                tenant=self.spec.tenant, job=job, seq=seq,
                images={k: np.stack([r["obs"].images[k] for r in part]) for k in part[0]["obs"].images},
                state=np.stack([r["obs"].state for r in part]).astype(np.float32),
                instructions=[r["obs"].instruction for r in part],
                actions=np.stack([r["action"] for r in part]).astype(np.float32),
                old_log_prob=np.array([r["log_prob"] for r in part], np.float32),
                advantages=np.array([r["adv"] for r in part], np.float32),
                returns=np.array([r["ret"] for r in part], np.float32),
                behaviour_version=min(int(r["version"]) for r in part),
            )
            if not await self._put(item):
                break
            self.progress.items += 1
        await self._mark_ready(job)

    # -- SFT -----------------------------------------------------------------------------
    async def _sft(self) -> None:
        from envs.lerobot import LeRobotReader
        from envs.lerobot.reader import ReaderConfig

        algo = {**SFT_DEFAULTS, **self.spec.algo}
        root = await self._dataset_root()
        tenant = await self._retry(self.client.tenant, self.spec.tenant)
        horizon = int(tenant.schema["action_horizon"])
        reader = await asyncio.to_thread(LeRobotReader, ReaderConfig(root, state_key=self.spec.state_key,
                                                                     action_key=self.spec.action_key))
        self._check_features(reader, tenant)
        rng = np.random.default_rng(self.spec.seed)
        losses: list[float] = []
        # A workload resumed on another worker counts the steps its tenant already has.
        await self._refresh_version()
        queued_steps = self.progress.version
        try:
            while self._budget_left() and (not self.spec.max_steps or queued_steps < self.spec.max_steps):
                job = await self._reserve("sft")
                if not job:
                    break
                n_items = int(algo["items_per_job"])
                if self.spec.max_steps:  # the last job takes only what is left
                    n_items = min(n_items, self.spec.max_steps - queued_steps)
                for seq in range(n_items):
                    item = await asyncio.to_thread(self._sft_item, reader, rng, int(algo["batch_size"]), horizon, job, seq)
                    if not await self._put(item):
                        break
                    queued_steps += 1
                await self._mark_ready(job)
                await self._refresh_version()
                rec = await self._retry(self.client.job, self.spec.tenant,
                                        self.progress.jobs[max(0, len(self.progress.jobs) - 3)])
                await self._event("progress", metrics={k: v for k, v in rec.metrics.items() if k in ("loss", "l1")})
                if self.spec.target_metric == "loss":
                    await self._sft_losses(losses)
                    self._target_reached(losses)
            await self._wait_jobs()
            last = await self.client.job(self.spec.tenant, self.progress.jobs[-1]) if self.progress.jobs else None
            self.final = {"loss": last.metrics.get("loss", float("nan"))} if last else {}
        finally:
            reader.close()

    async def _sft_losses(self, losses: list[float]) -> None:
        """Append the loss of every newly trained job, in order (the target's values)."""
        while len(losses) < len(self.progress.jobs):
            rec = await self._retry(self.client.job, self.spec.tenant, self.progress.jobs[len(losses)])
            if rec.state not in ("cleared", "trained", "exported", "synced"):
                return  # not trained yet: the next job's turn comes after it
            losses.append(float(rec.metrics.get("loss", float("nan"))))

    def _check_features(self, reader: Any, tenant: Any) -> None:
        """The dataset against the tenant schema, before any put: a missing state or action key
        is a clear error naming the spec field, not a NoneType error deep in a batch."""
        from master.spec import SpecError, feature_errors

        raw = {k: {"dtype": f.dtype, "shape": list(f.shape)} for k, f in reader.meta.features.items()}
        cameras = list(self.spec.camera_map) or [k for k in raw if raw[k]["dtype"] in ("image", "video")]
        errors = feature_errors(raw, self.spec.state_key, self.spec.action_key, cameras,
                                int(tenant.schema["state_dim"]), int(tenant.schema["action_dim"]))
        if errors:
            raise SpecError(errors)

    async def _dataset_root(self) -> Path:
        if self.spec.dataset_root:
            return Path(self.spec.dataset_root)
        from envs.lerobot import record
        from envs.lerobot.record import RecordConfig

        root = Path(self.worker.cfg.data_dir) / "datasets" / f"{self.spec.tenant}-{self.spec.workload}"
        if not (root / "meta" / "info.json").exists():
            await self._event("progress", message=f"recording {self.spec.demo_episodes} expert demonstrations")
            await asyncio.to_thread(record, RecordConfig(out=root, episodes=self.spec.demo_episodes,
                                                         action_noise=self.spec.demo_noise,
                                                         # PNG, not 4:2:0 video: the task's targets are
                                                         # small coloured discs whose chroma video smears.
                                                         use_videos=False,
                                                         env_id=self.spec.env_id, seed=self.spec.demo_seed,
                                                         env_kwargs=dict(self.spec.env_options), overwrite=True))
        return root

    def _sft_item(self, reader: Any, rng: np.random.Generator, batch: int, horizon: int, job: str,
                  seq: int) -> QueuePutRequest:
        b = reader.sample(batch, rng)
        # Action chunk: this frame's action and the next horizon-1 of the same episode
        # (repeating the last one past the episode's end).
        ends = {e.episode_index: e.dataset_to_index for e in reader.meta.episodes}
        idx = np.array([[min(i + k, ends[int(e)] - 1) for k in range(horizon)]
                        for i, e in zip(b.index_B, b.episode_index_B)])
        actions = reader.get_batch(idx.reshape(-1)).action_B_A.reshape(batch, horizon, -1)
        cmap = self.spec.camera_map or {k: k.removeprefix("observation.images.") for k in b.images}
        # No state in the dataset and state_dim 0 (checked at start): an empty state vector.
        state = b.state_B_S if b.state_B_S is not None else np.zeros((batch, 0), np.float32)
        return QueuePutRequest(
            tenant=self.spec.tenant, job=job, seq=seq,
            images={cmap[k]: v for k, v in b.images.items() if k in cmap},
            state=state.astype(np.float32).reshape(batch, -1), instructions=list(b.task_B),
            actions=actions.astype(np.float32),
        )

    # -- eval ----------------------------------------------------------------------------
    async def _eval(self) -> None:
        import envs

        env = await asyncio.to_thread(envs.make, self.spec.env_id, **self.spec.env_options)
        version = self.spec.eval_version  # pinned once by the master; never changes here
        if version < 0:  # a training workload's closing evaluation: its final version
            await self._refresh_version()
            version = self.progress.version
        self.progress.version = version
        exec_steps = int({**EVAL_DEFAULTS, **self.spec.algo}["exec_steps"])
        try:
            for ep in range(self.spec.eval_episodes):
                success, ret = await self._episode(env, self.spec.eval_seed + ep, self.spec.eval_sample, version,
                                                   exec_steps, None)
                self._episode_done(success, ret)
                if (ep + 1) % 10 == 0 or ep + 1 == self.spec.eval_episodes:
                    await self._event("progress", metrics=self._eval_metrics())
            self.final = self._eval_metrics()
        finally:
            env.close()

    def _eval_metrics(self) -> dict[str, float]:
        p = self.progress
        return {"success_rate": p.successes / max(1, p.episodes), "mean_return": float(np.mean(p.returns or [0.0])),
                "episodes": float(p.episodes), "version": float(p.version)}
