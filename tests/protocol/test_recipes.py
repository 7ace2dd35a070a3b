"""protocol/recipes.py: workflows found by kind, not by import (the env worker and `nexus env
serve` load the modules NEXUS_WORKFLOW_MODULES names; importing workflows registers sft, rl, eval)."""

from __future__ import annotations

import pytest

from protocol import recipes
from protocol.errors import InvalidField


def test_workflows_register_their_kinds_and_a_factory_makes_its_client():
    recipes.load_modules(("workflows",))
    assert {"sft", "rl", "eval"} <= set(recipes.kinds())
    from protocol.messages import WorkflowSpec
    from workflows import EvalWorkflow

    spec = WorkflowSpec(workload="w1", tenant="t1", kind="eval", env_id="builtin/reach-v0")
    wf = recipes.lookup("eval")(spec, data_dir="/tmp", nats_url="nats://127.0.0.1:1", prefix="px")
    assert isinstance(wf, EvalWorkflow) and wf.client.url == "nats://127.0.0.1:1" and wf.client.names.prefix == "px" and wf.spec is spec


def test_unknown_kind_names_the_known_ones():
    recipes.load_modules(("workflows",))
    with pytest.raises(InvalidField, match=r"'dance' is not a workflow; allowed: .*sft.*rl.*eval") as err:
        recipes.lookup("dance")
    assert err.value.field == "kind"


def test_a_taken_kind_is_refused_unless_overwritten(monkeypatch):
    monkeypatch.setattr(recipes, "_RECIPES", {})
    first, second = (lambda *a, **k: 1), (lambda *a, **k: 2)
    recipes.register("x", first)
    recipes.register("x", first)  # the same factory again: a module imported twice
    with pytest.raises(ValueError, match="kind 'x' is already registered"):
        recipes.register("x", second)
    recipes.register("x", second, overwrite=True)
    assert recipes.lookup("x") is second
    with pytest.raises(ValueError, match="non-empty"):
        recipes.register("", first)


def test_a_module_that_does_not_import_is_named():
    with pytest.raises(recipes.RecipeModuleError, match=r"NEXUS_WORKFLOW_MODULES: module 'no_such_recipes_mod' "
                                                        r"could not be imported: ModuleNotFoundError") as err:
        recipes.load_modules(("workflows", "no_such_recipes_mod"))
    assert err.value.details == {"module": "no_such_recipes_mod"} and isinstance(err.value, ValueError)


def test_none_registered_says_which_setting(monkeypatch):
    monkeypatch.setattr(recipes, "_RECIPES", {})
    with pytest.raises(InvalidField, match="none registered .*NEXUS_WORKFLOW_MODULES"):
        recipes.lookup("rl")


def _make(kind: str, algo: dict):
    from protocol.messages import WorkflowSpec

    spec = WorkflowSpec(workload="w1", tenant="t1", kind=kind, env_id="builtin/reach-v0", algo=algo)  # type: ignore[arg-type]
    return recipes.lookup(kind)(spec, data_dir="/tmp", nats_url="nats://127.0.0.1:1", prefix="px")


def test_a_workflow_reads_its_typed_config_with_the_specs_defaults():
    """`WorkflowSpec.algo` is validated once into the recipe's model: the defaults are the
    spec's (one per knob), a bad value names its field."""
    from protocol.recipe_configs import RLConfig, SFTConfig

    recipes.load_modules(("workflows",))
    rl = _make("rl", {})
    assert rl.config == RLConfig() and rl.config.episodes_per_update == 16  # docs/workload_spec.md's default
    assert _make("sft", {"batch_size": 8}).config == SFTConfig(batch_size=8)
    assert _make("eval", {}).config is None
    with pytest.raises(InvalidField, match="too large") as err:
        _make("rl", {"gamma": 2.0})
    assert err.value.field == "algo.gamma"
    with pytest.raises(InvalidField, match="unknown field") as err:
        _make("sft", {"batch": 8})
    assert err.value.field == "algo.batch"
    with pytest.raises(InvalidField, match="takes no algorithm config"):
        _make("eval", {"gamma": 0.5})


def test_the_compiled_spec_section_is_the_workflows_config():
    """What the master sends (the spec's algorithm section, whole) validates back into the same
    model: every leaf the user set reaches the workflow unchanged."""
    from master.spec import parse_spec
    from master.workload_plan import compile_workflow
    from tests.master.test_spec_fields import _set, doc

    recipes.load_modules(("workflows",))
    spec = parse_spec(_set(_set(doc("rl"), "algorithm.gamma", 0), "algorithm.parallel_envs", 3))
    wspec = compile_workflow(spec, "w1")
    wf = recipes.lookup("rl")(wspec, nats_url="nats://127.0.0.1:1", prefix="px")
    assert wf.config == spec.algorithm and wf.config.gamma == 0.0 and wf.config.parallel_envs == 3


def test_a_recipe_of_one_file_registers_its_kind_and_config():
    """docs/workload_spec.md "Adding a recipe": examples/recipe_repeat_eval.py, loaded by name."""
    recipes.load_modules(("workflows", "examples.recipe_repeat_eval"))
    wf = _make("repeat-eval", {"rounds": 3})
    assert type(wf).__name__ == "RepeatEvalWorkflow" and wf.config.rounds == 3
    assert _make("repeat-eval", {}).config.rounds == 2
    with pytest.raises(InvalidField, match="expected an integer") as err:
        _make("repeat-eval", {"rounds": "3"})
    assert err.value.field == "algo.rounds"
