"""Evaluation episodes of a pinned version: an eval workload's whole run and sft / rl's closing
evaluation (`Workflow.main`), so both the eval workflow and the common base import it.

Read-only. The version is pinned once (by the master, at submit, or the final version of the
training workload it closes), N episodes, success rate and return; no training queue, no
optimizer, no version change.

Episode i resets with seed ``eval.seed + i`` and, with ``eval.tasks`` set, the task of that
plan (round-robin over the env's tasks or the listed ones); every episode whose env reports a
task index (``info["task_index"]``: LIBERO suites, builtin reach, ManiSkill's one task) counts
in the per-task table the workload's events and report carry (``per_task``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs.simproc import SimFailure
from protocol.messages import MAX_TASK_ROWS, MAX_TASK_TEXT, TaskResult


class EvalTaskError(ValueError):
    """eval.tasks names a task the env does not have (raised before any episode)."""


def task_plan(spec_tasks: list[int | str], all_tasks: bool, env_spec: Any) -> list[int]:
    """The task index of each episode slot (episode i runs plan[i % len(plan)]); [] = the
    env's own seeded draw. Names and indices are checked against the env's tasks first."""
    tasks = tuple(env_spec.tasks)
    if all_tasks:
        return list(range(len(tasks)))
    plan = []
    for i, want in enumerate(spec_tasks):
        try:
            plan.append(env_spec.task_index(want))
        except Exception:  # envs.errors.UnknownTaskError, whatever its module path here
            known = ", ".join(f"{j}={t.name!r}" for j, t in enumerate(tasks))
            raise EvalTaskError(f"eval.tasks[{i}]: {want!r} is not a task of {env_spec.env_id}; allowed: an index "
                                f"0..{len(tasks) - 1} or a name ({known})") from None
    return plan


class TaskTable:
    """Episodes and successes per task index, bounded to MAX_TASK_ROWS rows."""

    def __init__(self) -> None:
        self.rows: dict[int, TaskResult] = {}

    def add(self, task: tuple[int, str, str] | None, success: bool) -> None:
        if task is None:
            return
        index, name, instruction = task
        row = self.rows.get(index)
        if row is None:
            if len(self.rows) >= MAX_TASK_ROWS:
                return  # the totals still count it
            row = self.rows[index] = TaskResult(task_index=index, task=name[:MAX_TASK_TEXT],
                                                instruction=instruction[:MAX_TASK_TEXT])
        row.episodes += 1
        row.successes += int(success)
        row.success_rate = row.successes / row.episodes

    def table(self) -> list[TaskResult]:
        return [self.rows[k] for k in sorted(self.rows)]


async def evaluate(wf: Any) -> None:
    """``wf.spec.eval_episodes`` episodes of the pinned version; the metrics in ``wf.final``,
    the per-task table in ``wf.per_task``. ``wf``: a `workflows.common.Workflow` (not imported
    here: common runs this as its closing evaluation)."""
    spec = wf.spec
    env = await wf._make_env()  # a child process of its own (envs.simproc)
    version = spec.eval_version  # pinned once by the master; never changes here
    if version < 0:  # a training workload's closing evaluation: its final version
        await wf._refresh_version()
        version = wf.progress.version
    wf.progress.version = version
    table = TaskTable()
    try:
        plan = task_plan(list(spec.eval_tasks), spec.eval_all_tasks, env.spec)
        for ep in range(spec.eval_episodes):
            task = plan[ep % len(plan)] if plan else None
            try:
                success, ret = await wf._episode(env, spec.eval_seed + ep, spec.eval_sample, version, None, task=task)
                done_task = wf.last_task
            except SimFailure as exc:
                # A simulator that hung (its process killed) or crashed fails its episode (a
                # failure with return 0) and is replaced by a new process; past SIM_REPLACE
                # failures in a row the workload fails (Workflow._replace_env).
                wf.log.warning(f"eval episode failed: simulator {exc.what}; env replaced", workload=spec.workload,
                               episode=ep, error=exc.message)
                success, ret = False, 0.0
                # A planned task's episode counts as its failure; a drawn one is unknown.
                done_task = None if task is None else (task, env.spec.tasks[task].name,
                                                       env.spec.tasks[task].instruction)
                env = await wf._replace_env(env, exc)
            wf._episode_done(success, ret)
            table.add(done_task, success)
            wf.per_task = table.table()
            if (ep + 1) % 10 == 0 or ep + 1 == spec.eval_episodes:
                await wf._event("progress", metrics=eval_metrics(wf))
        wf.final = eval_metrics(wf)
    finally:
        await env.close()


def eval_metrics(wf: Any) -> dict[str, float]:
    p = wf.progress
    return {"success_rate": p.successes / max(1, p.episodes), "mean_return": float(np.mean(p.returns or [0.0])),
            "episodes": float(p.episodes), "version": float(p.version)}
