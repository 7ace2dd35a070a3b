"""Eval: read-only. The version is pinned once (by the master, at submit, or the final
version of the training workload it closes), N episodes, success rate and return; no training
queue, no optimizer, no version change.
"""

from __future__ import annotations


import numpy as np

from envs.simcall import SimTimeout, sim_call
from workflows.common import Workflow

EVAL_DEFAULTS = {"exec_steps": 0}


async def evaluate(wf: Workflow) -> None:
    """``wf.spec.eval_episodes`` episodes of the pinned version; the metrics in ``wf.final``."""
    import envs

    spec = wf.spec
    env = await sim_call("make", envs.make, spec.env_id, **spec.env_options)
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
            except SimTimeout as exc:
                # A hung simulator fails its episode (a failure with return 0) and is replaced;
                # its thread is given up (envs.simcall), never closed under the hung call.
                wf.log.warning("eval episode failed: simulator hung; env replaced", workload=spec.workload,
                               episode=ep, error=exc.message)
                success, ret = False, 0.0
                env = await sim_call("make", envs.make, spec.env_id, **spec.env_options)
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
