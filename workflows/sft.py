"""SFT: dataset micro-batches (recorded expert demos or a LeRobot root) reserved, put and
marked ready at once; no weight sync between batches.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from protocol.messages import QueuePutRequest
from protocol.recipe_configs import SFTConfig
from workflows.common import Workflow


class SFTWorkflow(Workflow):
    kind = family = "sft"
    config_model = SFTConfig
    config: SFTConfig

    async def train(self) -> None:
        from envs.lerobot import LeRobotReader
        from envs.lerobot.reader import ReaderConfig

        cfg = self.config
        root = await self._dataset_root()
        tenant = await self._retry(self.client.tenant, self.spec.tenant)
        horizon = int(tenant.schema["action_horizon"])
        reader = await asyncio.to_thread(LeRobotReader, ReaderConfig(root, state_key=self.spec.state_key,
                                                                     action_key=self.spec.action_key))
        self._check_features(reader, tenant)
        rng = np.random.default_rng(self.spec.seed)
        losses: list[float] = []
        # The budget is this workload's steps: progress.steps starts at what a stopped
        # predecessor already trained or queued (the master counts it), so a resumed workflow
        # queues only the rest.
        await self._refresh_version()
        try:
            while self._budget_left():
                with self.update_span():  # one trace: the job, its training, the weight sync
                    job = await self._reserve("sft")
                    if not job:
                        break
                    n_items = cfg.items_per_job
                    if self.spec.max_steps:  # the last job takes only what is left
                        n_items = min(n_items, self.spec.max_steps - self.progress.steps)
                    for seq in range(n_items):
                        item = await asyncio.to_thread(self._sft_item, reader, rng, cfg.batch_size, horizon, job, seq)
                        if not await self._put(item):
                            break
                        self.progress.steps += 1
                    await self._mark_ready(job)
                await self._refresh_version()
                rec = await self._retry(self.client.job, self.spec.tenant,
                                        self.progress.jobs[max(0, len(self.progress.jobs) - 3)])
                # The version a trained job reached, not only the last export's: with
                # export_every_steps > 1 the steps shown would otherwise jump at exports only.
                self.progress.version = max(self.progress.version, rec.trained_version)
                await self._event("progress", metrics={k: v for k, v in rec.metrics.items() if k in ("loss", "l1")})
                if self.spec.target_metric == "loss":
                    await self._sft_losses(losses)
                    self._target_reached(losses)
            await self._wait_jobs()
            last = (await self._retry(self.client.job, self.spec.tenant, self.progress.jobs[-1])
                    if self.progress.jobs else None)
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

        # The tenant's own datasets dir, as the master named it: it may read its demos back
        # (dataset.root, sample), no other tenant may (actors/paths.py).
        if not self.spec.record_path or ".." in Path(self.spec.record_path).parts or Path(self.spec.record_path).is_absolute():
            raise ValueError(f"workflow spec of {self.spec.workload}: record_path {self.spec.record_path!r} is no "
                             "relative path under the data dir (a master older than this env worker?)")
        root = self.data_dir / self.spec.record_path
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
