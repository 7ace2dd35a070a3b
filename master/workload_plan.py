"""A workload spec compiled to what runs it: its id, the policy an eval pins, its step budget
and the env worker's `WorkflowSpec` (used by `master.workloads` at submit and at start)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from transport.datasets import tenant_datasets
from protocol.messages import WorkflowSpec


def new_workload_id() -> str:
    return f"w{int(time.time()):010d}{uuid.uuid4().hex[:6]}"

def policy_pin(spec: Any) -> tuple[str, int | str]:
    """(tenant whose policy an eval scores, version pin: an int or 'latest')."""
    version = spec.eval.version if spec.eval is not None else "latest"
    if isinstance(version, str) and version.startswith("tenant:"):
        name, _, pin = version.removeprefix("tenant:").partition("@")
        return name, int(pin) if pin.isdigit() else "latest"
    return spec.tenant, version

def step_budget(spec: Any, version: int) -> int:
    """The optimizer steps a workload trains from its tenant's ``version`` (0: no step budget):
    this workload's own, never the tenant's total. sft: algorithm.steps, or up to
    algorithm.until_version; schedule.budget.max_steps, when set, caps either (the first limit
    reached ends the workload); rl: schedule.budget.max_steps. By the task's family (a
    recipe of family sft plans by its config's steps / until_version when it has them)."""
    limit = spec.schedule.budget.max_steps or 0
    if spec.family != "sft" or spec.algorithm is None:
        return limit
    steps, until = getattr(spec.algorithm, "steps", None), getattr(spec.algorithm, "until_version", None)
    if steps is None and until is None:
        return limit
    planned = steps if steps is not None else max(0, until - version)
    return min(limit, planned) if limit else planned

def budget_note(spec: Any, version: int) -> str:
    """What the accepted event (and `nexus submit`) says the workload will train."""
    steps = step_budget(spec, version)
    if spec.family == "eval":
        return ""
    if not steps:
        return f"; from version {version}"
    return f"; from version {version}, {steps} more steps (to version {version + steps})"

def compile_workflow(spec: Any, workload: str, eval_version: int = -1, start_version: int = 0) -> WorkflowSpec:
    """The env worker's part of a workload spec; ``start_version``: the tenant's version when
    the workload was accepted (its step budget counts from there)."""
    budget = spec.schedule.budget
    p = WorkflowSpec(workload=workload, tenant=spec.tenant, kind=spec.task, seed=spec.seed,
                     max_steps=step_budget(spec, start_version), max_episodes=budget.max_episodes or 0,
                     max_wall_s=float(budget.max_wall_s or 0.0),
                     start_version=start_version if spec.family != "eval" else -1)
    if budget.target is not None:
        t = budget.target
        p.target_metric, p.target_at_least, p.target_at_most, p.target_window = (
            t.metric, t.at_least, t.at_most, t.window)
    if spec.env is not None:
        p.env_id, p.env_options, p.hosted = spec.env.id, dict(spec.env.options), spec.env.hosted or ""
        if spec.env.demos is not None:
            p.demo_episodes, p.demo_noise = spec.env.demos.episodes, spec.env.demos.noise
            p.demo_seed = spec.env.demos.seed
            p.record_path = str(tenant_datasets(Path(), spec.tenant) / workload)
    if spec.dataset is not None:
        p.dataset_root, p.camera_map = spec.dataset.root, dict(spec.dataset.camera_map)
        p.state_key, p.action_key = spec.dataset.state_key, spec.dataset.action_key
    if spec.eval is not None:
        # eval: the workload itself; sft / rl: a closing evaluation of the final version.
        p.eval_episodes, p.eval_seed, p.eval_sample = spec.eval.episodes, spec.eval.seed, spec.eval.sample
        tasks = spec.eval.tasks
        p.eval_all_tasks = tasks == "all"
        p.eval_tasks = list(tasks) if isinstance(tasks, list) else []
    if spec.algorithm is not None:
        # The task's recipe config, whole: the workflow validates it back into the same model
        # (protocol/recipe_configs.py), so no knob gets a second default on the way.
        p.algo = spec.algorithm.model_dump(mode="json")
    if spec.family == "eval":
        p.policy_tenant, _ = policy_pin(spec)
        p.eval_version = eval_version
    return p
