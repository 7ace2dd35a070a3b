"""Eval: read-only. The version is pinned once (by the master, at submit, or the final
version of the training workload it closes), N episodes, success rate and return; no training
queue, no optimizer, no version change.
"""

from __future__ import annotations

import numpy as np

from envs.simproc import SimFailure
from workflows.common import Workflow

EVAL_DEFAULTS = {"exec_steps": 0}


async def evaluate(wf: Workflow) -> None:
    """``wf.spec.eval_episodes`` episodes of the pinned version; the metrics in ``wf.final``."""
    spec = wf.spec
    env = await wf._make_env()  # a child process of its own (envs.simproc)
    version = spec.eval_version  # pinned once by the master; never changes here
    if version < 0:  # a training workload's closing evaluation: its final version
        await wf._refresh_version()
        version = wf.progress.version
    wf.progress.version = version
    exec_steps = int({**EVAL_DEFAULTS, **spec.algo}["exec_steps"])
    try:
        for ep in range(spec.eval_episodes):
            try:
                success, ret = await wf._episode(env, spec.eval_seed + ep, spec.eval_sample, version, exec_steps,
                                                 None)
            except SimFailure as exc:
                # A simulator that hung (its process killed) or crashed fails its episode (a
                # failure with return 0) and is replaced by a new process; past SIM_REPLACE
                # failures in a row the workload fails (Workflow._replace_env).
                wf.log.warning(f"eval episode failed: simulator {exc.what}; env replaced", workload=spec.workload,
                               episode=ep, error=exc.message)
                success, ret = False, 0.0
                env = await wf._replace_env(env, exc)
            wf._episode_done(success, ret)
            if (ep + 1) % 10 == 0 or ep + 1 == spec.eval_episodes:
                await wf._event("progress", metrics=eval_metrics(wf))
        wf.final = eval_metrics(wf)
    finally:
        await env.close()


def eval_metrics(wf: Workflow) -> dict[str, float]:
    p = wf.progress
    return {"success_rate": p.successes / max(1, p.episodes), "mean_return": float(np.mean(p.returns or [0.0])),
            "episodes": float(p.episodes), "version": float(p.version)}


class EvalWorkflow(Workflow):
    kind = "eval"

    async def train(self) -> None:  # an eval workload is its evaluation, nothing else
        await evaluate(self)
