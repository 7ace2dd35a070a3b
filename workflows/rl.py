"""RL: episodes with the current policy through the inference service -> transitions with
behaviour version, log-prob, value, reward, done -> GAE -> reserve / queue_put / mark_ready ->
(trainer: PPO) -> new version synced back; asynchronous, bounded by the in-flight cap and the
staleness bound; rollouts gated by the master (1 active per tenant, 3 globally).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from envs.simproc import SimFailure
from protocol.errors import Busy, InvalidField
from protocol.messages import QueuePutRequest
from protocol.recipe_configs import RLConfig
from workflows.common import Workflow
from workflows.gae import gae



def group_advantages(outcomes: list[float], groups: list[int]) -> list[float]:
    """Each episode's outcome against its group's (the episodes of one reset seed): (outcome -
    mean) / (std + 1e-6); a group whose outcomes are all equal (all succeeded, all failed, or a
    lone survivor of dropped episodes) scores 0: it ranks no action above another."""
    out = [0.0] * len(outcomes)
    for g in set(groups):
        members = [i for i, gi in enumerate(groups) if gi == g]
        vals = np.array([outcomes[i] for i in members], np.float64)
        if len(members) < 2 or float(vals.std()) == 0.0:
            continue
        for i, v in zip(members, (vals - vals.mean()) / (vals.std() + 1e-6)):
            out[i] = float(v)
    return out


def rollout_rows(segments: list[list[dict[str, Any]]], cfg: RLConfig, episodes_done: int,
                 outcomes: list[float] | None = None, groups: list[int] | None = None) -> list[dict[str, Any]]:
    """An update's transitions with their advantage (``adv``) and GAE return (``ret``).
    ``advantage: gae``: GAE from the value head, normalised over the update. ``advantage:
    group_success``: every step of segment i gets `group_advantages` of ``outcomes`` (1.0 for a
    success) within ``groups`` (segment i's reset-seed group), not normalised again; the GAE
    returns still train the value head. ``episodes_done``: the workload's episodes so far, this
    update's included. While that is at most ``value_warmup_episodes`` the advantages are zeros:
    PPO's policy term then has no gradient and the update trains the value head alone (on the
    policy the tenant starts from, e.g. its SFT version), so the first policy steps are taken
    on advantages of a value head that has seen this policy's returns, not on an untrained
    one's noise (docs/results.md: the first PPO round from an SFT start lost the most)."""
    grouped = cfg.advantage == "group_success"
    if grouped and (outcomes is None or groups is None or not len(outcomes) == len(segments) == len(groups)):
        raise ValueError("advantage group_success needs each segment's outcome and group")
    episode_adv = group_advantages(outcomes, groups) if grouped else None  # type: ignore[arg-type]
    rows: list[dict[str, Any]] = []
    for i, steps in enumerate(segments):
        rewards = np.array([s["reward"] for s in steps], np.float32)
        values = np.array([s["value"] for s in steps], np.float32)
        dones = np.array([s["terminated"] for s in steps], bool)
        # A truncated episode bootstraps from its last value estimate (time limit, not failure).
        last_value = 0.0 if steps[-1]["terminated"] else float(values[-1])
        adv, ret = gae(rewards, values, dones, last_value, cfg.gamma, cfg.gae_lambda)
        if episode_adv is not None:
            adv = np.full(len(steps), episode_adv[i], np.float32)
        for s, a, r in zip(steps, adv, ret):
            rows.append({**s, "adv": a, "ret": r})
    if episodes_done <= cfg.value_warmup_episodes:
        return [{**r, "adv": np.float32(0.0)} for r in rows]
    if cfg.normalize_advantages and len(rows) > 1 and not grouped:
        adv_all = np.array([r["adv"] for r in rows], np.float32)
        mean, std = float(adv_all.mean()), float(adv_all.std())
        rows = [{**r, "adv": (r["adv"] - mean) / (std + 1e-8)} for r in rows]
    return rows


class RLWorkflow(Workflow):
    kind = family = "rl"
    config_model = RLConfig
    config: RLConfig

    async def train(self) -> None:
        cfg = self.config
        self._kl_fields(cfg)  # a KL term without an anchor version fails now, not after a rollout
        # Several episodes at once: their predict requests meet in the inferencer's groups
        # (one base forward for all of them) instead of queueing one round trip at a time.
        n_envs = cfg.parallel_envs  # bounded by RLConfig, a start the master did not compile too
        pool = await self._make_envs(n_envs)  # one child process each (envs.simproc)

        async def episode(j: int, seed_j: int, record: list[dict[str, Any]]) -> tuple[bool, float] | None:
            # A simulator that hung (its process killed) or crashed fails its episode (dropped:
            # a partial segment has no end to bootstrap from) and is replaced by a new process;
            # past SIM_REPLACE failures in a row the workload fails (Workflow._replace_env).
            try:
                return await self._episode(pool[j], seed_j, True, -1, record)
            except SimFailure as exc:
                self.log.warning(f"rl episode dropped: simulator {exc.what}; env replaced",
                                 workload=self.spec.workload, error=exc.message)
                record.clear()
                pool[j] = await self._replace_env(pool[j], exc)
                return None

        seed = self.spec.seed * 1_000_003
        # group_success: group_size episodes in a row share a reset seed (one group).
        per_seed = cfg.group_size if cfg.advantage == "group_success" else 1
        started = 0  # episodes started by this workload: episode e resets with seed + e // per_seed
        window: list[tuple[bool, float]] = []
        try:
            while self._budget_left():
                with self.update_span():  # one trace: the rollout, its job, the training, the weight sync
                    await self._rollout_gate(True)
                    try:
                        segments: list[list[dict[str, Any]]] = []
                        outcomes: list[float] = []
                        groups: list[int] = []
                        # Either so many episodes, or episodes until so many policy steps. Groups
                        # count episodes started, not kept (a dropped one leaves its group a member
                        # short); without groups a dropped episode is replaced.
                        by_steps = cfg.steps_per_update or 0
                        first = started

                        def collected() -> int:
                            return started - first if per_seed > 1 else len(segments)

                        while (sum(len(seg) for seg in segments) < by_steps if by_steps
                               else collected() < (cfg.episodes_per_update or 0)):
                            k = n_envs if by_steps else min(n_envs, (cfg.episodes_per_update or 0) - collected())
                            records: list[list[dict[str, Any]]] = [[] for _ in range(k)]
                            results = await asyncio.gather(*(episode(j, seed + (started + j) // per_seed, records[j])
                                                             for j in range(k)))
                            for j, (steps, result) in enumerate(zip(records, results)):
                                if result is None:
                                    continue
                                success, ret = result
                                segments.append(steps)
                                outcomes.append(float(success))
                                groups.append((started + j) // per_seed)
                                self._episode_done(success, ret)
                                window.append((success, ret))
                            started += k
                    finally:
                        await self._rollout_gate(False)
                    await self._queue_rl(segments, cfg, outcomes, groups)
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
            await asyncio.gather(*(env.close() for env in pool))

    async def _rollout_gate(self, begin: bool) -> None:
        # The master's gate: 1 active rollout per tenant, 3 in all; Busy says wait for a turn.
        gate = self.client.rollout_begin if begin else self.client.rollout_end
        while True:
            try:
                await self._retry(gate, self.spec.tenant, self.spec.workload, timeout_s=30)
                return
            except Busy as exc:
                await asyncio.sleep(float(exc.details.get("retry_after_s", 0.5)))

    def _kl_fields(self, cfg: RLConfig) -> dict[str, Any]:
        """The KL term's fields of every micro-batch ({}: none). The anchor is the version named
        (kl_anchor_version: rounds of PPO all anchored to one SFT start), else the one this
        workload starts from; the trainer copies the policy when its slot is at that version."""
        if cfg.kl_coef == 0:
            return {}
        anchor = cfg.kl_anchor_version if cfg.kl_anchor_version is not None else self.spec.start_version
        if anchor < 0:  # a start the master did not compile (it always sets start_version for rl)
            raise InvalidField("algo.kl_coef", "a KL term needs its anchor's version: set algo.kl_anchor_version "
                                               "or the workflow's start_version")
        return {"kl_coef": cfg.kl_coef, "anchor_version": anchor}

    async def _queue_rl(self, segments: list[list[dict[str, Any]]], cfg: RLConfig,
                        outcomes: list[float], groups: list[int]) -> None:
        rows = rollout_rows(segments, cfg, self.progress.episodes, outcomes, groups)
        if not rows:
            return
        # PPO epochs: each pass over the rollout, in a fresh order, is more micro-batches of
        # the same job (the trainer applies them in order, one step each).
        order_rng = np.random.default_rng(self.progress.episodes)
        passes = []
        for _ in range(cfg.epochs):
            passes.extend(rows[i] for i in order_rng.permutation(len(rows)))
        rows = passes
        kl = self._kl_fields(cfg)
        mb = cfg.micro_batch
        if self.spec.max_steps:  # the last job takes only the micro-batches (steps) left of the budget
            rows = rows[: max(0, self.spec.max_steps - self.progress.steps) * mb]
            if not rows:
                return
        job = await self._reserve("rl")
        if not job:
            return
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
                behaviour_version=min(int(r["version"]) for r in part), **kl,
            )
            if not await self._put(item):
                break
            self.progress.items += 1
            self.progress.steps += 1
        await self._mark_ready(job)
