"""Eval: read-only. The version is pinned once (by the master, at submit, or the final
version of the training workload it closes), N episodes, success rate and return; no training
queue, no optimizer, no version change.
"""

from __future__ import annotations

import asyncio

import numpy as np

from workflows.common import Workflow

EVAL_DEFAULTS = {"exec_steps": 0}


async def evaluate(wf: Workflow) -> None:
    """``wf.spec.eval_episodes`` episodes of the pinned version; the metrics in ``wf.final``."""
    import envs

    spec = wf.spec
    env = await asyncio.to_thread(envs.make, spec.env_id, **spec.env_options)
    version = spec.eval_version  # pinned once by the master; never changes here
    if version < 0:  # a training workload's closing evaluation: its final version
        await wf._refresh_version()
        version = wf.progress.version
    wf.progress.version = version
    exec_steps = int({**EVAL_DEFAULTS, **spec.algo}["exec_steps"])
    try:
        for ep in range(spec.eval_episodes):
            success, ret = await wf._episode(env, spec.eval_seed + ep, spec.eval_sample, version, exec_steps, None)
            wf._episode_done(success, ret)
            if (ep + 1) % 10 == 0 or ep + 1 == spec.eval_episodes:
                await wf._event("progress", metrics=eval_metrics(wf))
        wf.final = eval_metrics(wf)
    finally:
        env.close()


def eval_metrics(wf: Workflow) -> dict[str, float]:
    p = wf.progress
    return {"success_rate": p.successes / max(1, p.episodes), "mean_return": float(np.mean(p.returns or [0.0])),
            "episodes": float(p.episodes), "version": float(p.version)}


class EvalWorkflow(Workflow):
    kind = "eval"

    async def train(self) -> None:  # an eval workload is its evaluation, nothing else
        await evaluate(self)
