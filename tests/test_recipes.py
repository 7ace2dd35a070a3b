"""protocol/recipes.py: workflows found by kind, not by import (the env worker and `nexus env
serve` load the modules NEXUS_WORKFLOW_MODULES names; importing workflows registers sft, rl, eval)."""

from __future__ import annotations

import pytest

from protocol import recipes
from protocol.errors import InvalidField


def test_workflows_register_their_kinds_and_a_factory_makes_its_client():
    recipes.load_modules(("workflows",))
    assert {"sft", "rl", "eval"} <= set(recipes.kinds())
    from protocol.messages import ProducerSpec
    from workflows import EvalWorkflow

    spec = ProducerSpec(workload="w1", tenant="t1", kind="eval", env_id="builtin/reach-v0")
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
