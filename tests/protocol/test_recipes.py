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


@pytest.fixture
def fresh(monkeypatch):
    """An empty registry (the built-ins declared, no factory), put back after the test."""
    recipes.load_modules(("workflows",))  # its first import registers into the real registry, not this copy
    monkeypatch.setattr(recipes, "_RECIPES", {})
    monkeypatch.setattr(recipes, "_DECLARED", dict(recipes._DECLARED))


def test_a_taken_kind_is_refused_unless_overwritten(fresh):
    first, second = (lambda *a, **k: 1), (lambda *a, **k: 2)
    recipes.register("x", first, family="eval")
    recipes.register("x", first)  # the same factory again: a module imported twice (its family kept)
    with pytest.raises(ValueError, match="kind 'x' is already registered"):
        recipes.register("x", second)
    recipes.register("x", second, overwrite=True)
    assert recipes.lookup("x") is second and recipes.family_of("x") == "eval"
    with pytest.raises(ValueError, match="non-empty"):
        recipes.register("", first)


def test_a_registration_declares_its_kind_family_and_config(fresh):
    """The master reads a kind's declaration without its factory: the built-ins are declared
    in protocol; a new kind needs a family, a tenant-safe name and a RecipeConfig model."""
    from protocol.recipe_configs import CONFIGS, RecipeConfig, RLConfig

    assert recipes.declared_kinds() == ("sft", "rl", "eval") and recipes.kinds() == ()
    assert recipes.declaration("rl") == recipes.Declaration("rl", "rl", CONFIGS["rl"])
    assert recipes.declaration("eval").config is None and recipes.declaration("dance") is None

    class Rounds(RecipeConfig):
        n: int = 1

    def make(*a, **k):
        return None

    make.config_model, make.family = Rounds, "eval"  # what workflows.common.as_recipe sets
    recipes.register("twice-eval", make)
    assert recipes.declaration("twice-eval") == recipes.Declaration("twice-eval", "eval", Rounds)
    recipes.register("ppo-plus", lambda *a, **k: None, config=RLConfig, family="rl")
    assert recipes.family_of("ppo-plus") == "rl" and recipes.declared_kinds()[-2:] == ("twice-eval", "ppo-plus")
    with pytest.raises(ValueError, match=r"family=None; allowed: sft, rl, eval"):
        recipes.register("nofamily", lambda *a, **k: None)
    with pytest.raises(ValueError, match="a built-in kind keeps its family"):
        recipes.register("rl", lambda *a, **k: None, family="eval")
    with pytest.raises(ValueError, match="is not a RecipeConfig model"):
        recipes.register("badcfg", lambda *a, **k: None, config=dict, family="eval")
    for bad in ("Repeat", "repeat eval", "9lives", "a" * 33, "a.b", None):  # tenants send kinds
        with pytest.raises(ValueError, match="non-empty name of lowercase letters"):
            recipes.register(bad, make)  # type: ignore[arg-type]
    with pytest.raises(InvalidField, match=r"'dance' is not a workload kind this process knows; allowed: sft, rl, "
                                           r"eval, twice-eval, ppo-plus \(NEXUS_WORKFLOW_MODULES"):
        recipes.family_of("dance")


def test_a_kind_on_the_wire_is_a_bounded_name():
    from protocol.messages import WorkflowSpec
    from protocol.wire import decode, encode

    ok = WorkflowSpec(workload="w1", tenant="t1", kind="repeat-eval")
    assert decode(encode(ok), WorkflowSpec).kind == "repeat-eval"
    for bad in ("Repeat", "a" * 33, "", "x y"):
        with pytest.raises(InvalidField, match="kind"):
            decode(encode(WorkflowSpec(workload="w1", tenant="t1", kind=bad)), WorkflowSpec)


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
