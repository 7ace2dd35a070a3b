"""Workflows: the SFT, RL and eval loops, written as a user would write them.

Each is built only on the SDK's public primitives (`sdk.client.AsyncClient`: reserve,
queue_put, mark_ready, job, wait_job, latest_weights, export_params, predict, tenant,
rollout_begin / rollout_end, publish_event), the same way examples/custom_loop.py is. Env
workers run them for submitted workloads (`start_workflow`, actors/env_worker/env_worker.py), finding
them by kind in `protocol.recipes`, where importing this package registers sft, rl and eval
(NEXUS_WORKFLOW_MODULES names the modules the env workers and the master import; this one by
default). Each
reads its recipe's typed config (`Workflow.config`: `WorkflowSpec.algo` validated once into
`protocol.recipe_configs.SFTConfig` / `RLConfig`). A loop of your own can subclass `Workflow`,
register it as a recipe (docs/workload_spec.md "Adding a recipe"), or run one directly:

    wf = workflow_for(AsyncClient(url, prefix, timeout_s=60), workflow_spec, data_dir=".nexus")
    await wf.main()          # connects, runs, publishes its events, closes

    workflows/common.py   Workflow: its typed config, budget / target, reserve / put / mark_ready with
                          retries, episodes, events; as_recipe(cls): a class as a recipes factory
    workflows/sft.py      SFTWorkflow: demos or a LeRobot root -> micro-batches with action chunks
    workflows/rl.py       RLWorkflow: parallel rollouts -> GAE -> PPO jobs
    workflows/eval.py     EvalWorkflow: an eval workload (its run is `evaluate`)
    workflows/evaluation.py  evaluate: a pinned version, N episodes (also sft / rl's closing evaluation)
    workflows/gae.py      gae(): generalised advantage estimation
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protocol.messages import WorkflowSpec
from protocol.recipes import lookup, register
from sdk.client import AsyncClient
from workflows.common import Progress, Workflow, as_recipe
from workflows.eval import EvalWorkflow
from workflows.gae import gae
from workflows.rl import RLWorkflow
from workflows.sft import SFTWorkflow

WORKFLOWS: dict[str, type[Workflow]] = {"sft": SFTWorkflow, "rl": RLWorkflow, "eval": EvalWorkflow}


def workflow_for(client: AsyncClient, spec: WorkflowSpec, *, data_dir: str | Path = ".", log: Any = None) -> Workflow:
    """The registered workflow of ``spec.kind`` (sft, rl, eval, or a recipe of your own), not started."""
    return lookup(spec.kind)(spec, data_dir=data_dir, log=log, client=client)


for _kind, _cls in WORKFLOWS.items():
    register(_kind, as_recipe(_cls))


__all__ = ["WORKFLOWS", "EvalWorkflow", "Progress", "RLWorkflow", "SFTWorkflow", "Workflow", "as_recipe", "gae",
           "workflow_for"]
