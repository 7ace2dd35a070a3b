"""A spec's task may be a kind a recipe module registered (docs/workload_spec.md "Adding a
recipe"): with examples/recipe_repeat_eval.py loaded, ``task: repeat-eval`` validates by eval's
rules with its ``algorithm`` typed by RepeatEvalConfig; without it, the task is refused naming
the kinds this process knows and the setting that loads others."""

from __future__ import annotations

import sys

import pytest

from master.spec import SpecError, parse_spec, spec_from_dict, spec_to_dict
from master.workload_plan import compile_workflow
from protocol import recipes

MODULE = "examples.recipe_repeat_eval"


def _spec(**changes) -> dict:
    spec = {"tenant": "rep", "task": "repeat-eval", "env": {"id": "builtin/reach-v0"},
            "eval": {"version": "latest", "episodes": 2, "sample": False}, "algorithm": {"rounds": 3}}
    spec.update(changes)
    return {k: v for k, v in spec.items() if v is not None}


def _errors(doc: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(doc)
    return {e["field"]: e["message"] for e in info.value.errors}


@pytest.fixture
def registry(monkeypatch):
    """The registry without repeat-eval (the built-ins and `workflows`' factories only), and the
    module not imported yet: whatever this test loads is gone after it."""
    # `workflows` registers the built-ins' factories at its first import: that must land in the
    # real registry, not in this test's copy (a later test would find it empty).
    recipes.load_modules(("workflows",))
    monkeypatch.setattr(recipes, "_DECLARED", {k: v for k, v in recipes._DECLARED.items() if k != "repeat-eval"})
    monkeypatch.setattr(recipes, "_RECIPES", {k: v for k, v in recipes._RECIPES.items() if k != "repeat-eval"})
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    yield
    sys.modules.pop(MODULE, None)  # registered into the copy only: a later import must register again


def test_a_registered_kind_validates_with_its_config_and_its_familys_rules(registry):
    recipes.load_modules((MODULE,))  # as the master does at start, from NEXUS_WORKFLOW_MODULES
    config = sys.modules[MODULE].RepeatEvalConfig
    spec = parse_spec(_spec())
    assert spec.task == "repeat-eval" and spec.family == "eval"
    assert type(spec.algorithm) is config and spec.algorithm.rounds == 3
    assert spec_from_dict(spec_to_dict(spec)) == spec and spec_to_dict(spec)["algorithm"] == {"rounds": 3}
    assert parse_spec(_spec(algorithm=None)).algorithm == config()  # the recipe's defaults, written out
    # What the env worker gets: the kind and the section, whole; an eval's pinned read.
    wf = compile_workflow(spec, "w1", eval_version=4)
    assert (wf.kind, wf.algo, wf.policy_tenant, wf.eval_version, wf.start_version) == ("repeat-eval", {"rounds": 3},
                                                                                      "rep", 4, -1)

    bad = _errors(_spec(algorithm={"rounds": "3"}))
    assert bad == {"algorithm.rounds": "expected an integer, got a string ('3')"}
    assert _errors(_spec(algorithm={"rounds": 99})) == {"algorithm.rounds": "99 is too large; allowed: >= 1 and <= 16"}
    assert _errors(_spec(algorithm={"round": 2})) == {"algorithm.round": "unknown field; allowed in algorithm: rounds"}
    # eval's rules: it needs env and eval, takes no dataset, measures no target.
    errs = _errors(_spec(env=None, eval=None, dataset={"root": "x", "camera_map": {"a": "b"}},
                         schedule={"budget": {"target": {"metric": "loss", "at_most": 0.1}}}))
    assert errs["env"].startswith("required for task 'repeat-eval'") and errs["eval"].startswith("required for")
    assert errs["dataset"] == "not allowed for task 'repeat-eval'; remove it"
    assert errs["schedule.budget.target.metric"].startswith("'loss' is not measured by task 'repeat-eval'")


def test_an_unloaded_kind_is_refused_naming_the_known_ones(registry):
    errs = _errors(_spec())
    assert set(errs) == {"task"}, errs
    assert errs["task"].startswith("'repeat-eval' is not allowed; allowed: sft, rl, eval (")
    assert "NEXUS_WORKFLOW_MODULES" in errs["task"]
    assert _errors(_spec(task="Repeat Eval"))["task"].startswith("'Repeat Eval' is not allowed; allowed: sft, rl, eval")
    assert _errors(_spec(task=3))["task"] == "expected a string, got an integer"


def test_a_record_knows_its_family_without_the_module():
    """A master restarted without the recipe's module still treats the workload as its family's;
    a record from before families (or of a built-in) reads its task as its family."""
    from protocol.messages import WorkloadRecord
    from protocol.wire import decode, encode

    base = {"workload": "w1", "tenant": "t", "state": "pending", "spec": {}, "created_at": 0.0, "updated_at": 0.0}
    rec = WorkloadRecord(task="repeat-eval", family="eval", **base)
    assert decode(encode(rec), WorkloadRecord).family == "eval"
    assert decode(encode(WorkloadRecord(task="rl", **base)), WorkloadRecord).family == "rl"
