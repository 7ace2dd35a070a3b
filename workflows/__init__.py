"""Workflows: the SFT, RL and eval loops, written as a user would write them.

Each is built only on the SDK's public primitives (`sdk.client.AsyncClient`: reserve,
queue_put, mark_ready, job, wait_job, latest_weights, export_params, predict, tenant,
rollout_begin / rollout_end, publish_event), the same way examples/custom_loop.py is. Env
workers run them for submitted workloads (`start_producer`, actors/env_worker.py); a loop of
your own can subclass `Workflow` or run one directly:

    wf = workflow_for(AsyncClient(url, prefix, timeout_s=60), producer_spec, data_dir=".nexus")
    await wf.main()          # connects, runs, publishes its events, closes

    workflows/common.py   Workflow: budget / target, reserve / put / mark_ready with retries, episodes, events
    workflows/sft.py      SFTWorkflow: demos or a LeRobot root -> micro-batches with action chunks
    workflows/rl.py       RLWorkflow: parallel rollouts -> GAE -> PPO jobs
    workflows/eval.py     EvalWorkflow / evaluate: a pinned version, N episodes
    workflows/gae.py      gae(): generalised advantage estimation
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protocol.errors import InvalidField
from protocol.messages import ProducerSpec
from sdk.client import AsyncClient
from workflows.common import Progress, Workflow
from workflows.eval import EvalWorkflow
from workflows.gae import gae
from workflows.rl import RLWorkflow
from workflows.sft import SFTWorkflow

WORKFLOWS: dict[str, type[Workflow]] = {"sft": SFTWorkflow, "rl": RLWorkflow, "eval": EvalWorkflow}


def workflow_for(client: AsyncClient, spec: ProducerSpec, *, data_dir: str | Path = ".", log: Any = None) -> Workflow:
    """The workflow of ``spec.kind`` (sft, rl or eval), not started."""
    cls = WORKFLOWS.get(spec.kind)
    if cls is None:
        raise InvalidField("kind", f"{spec.kind!r} is not a workflow; allowed: {', '.join(WORKFLOWS)}")
    return cls(client, spec, data_dir=data_dir, log=log)


__all__ = ["WORKFLOWS", "EvalWorkflow", "Progress", "RLWorkflow", "SFTWorkflow", "Workflow", "gae", "workflow_for"]
