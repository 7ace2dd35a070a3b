"""Workflow recipes by kind: the modules NEXUS_WORKFLOW_MODULES names register a runner factory
per workload kind here; the hosts that run workloads (the env worker, `nexus env serve`) look
the kind up, so they never import the workflows themselves.

    from protocol import recipes
    recipes.register("rl", make_rl)      # in a recipe module (workflows/__init__.py does sft, rl, eval;
                                         # workflows.common.as_recipe(cls) makes a factory of a Workflow)
    recipes.load_modules(("workflows",)) # a host, at start
    runner = recipes.lookup(spec.kind)(spec, data_dir=d, log=log, nats_url=url, prefix=p)

A factory is called ``factory(spec, *, data_dir, log=None, client=None, nats_url="",
prefix="")`` with the workload's `WorkflowSpec` and returns its runner, not started (a
`workflows.Workflow`: ``await runner.main()``, ``await runner.stop()``, ``runner.status()``).
``client``: the SDK client to run on (a hosted env process passes its own); None means the
recipe makes its own to ``nats_url`` / ``prefix`` (the env worker's cluster). The runner
validates ``spec.algo`` into its recipe's config model when it is made (`protocol.recipe_configs`;
a bad value is `InvalidField` naming ``algo.<field>``). Adding a recipe: docs/workload_spec.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

from protocol.errors import ErrorCode, InvalidField, NexusError

RecipeFactory = Callable[..., Any]

SETTING = "NEXUS_WORKFLOW_MODULES"  # the variable naming the modules that register recipes

# kind -> factory, in registration order (the order errors list them in).
_RECIPES: dict[str, RecipeFactory] = {}


class RecipeModuleError(NexusError, ValueError):
    """A module NEXUS_WORKFLOW_MODULES names could not be imported (its own error chained): a
    bad value of that setting, so a host stops at start saying which module."""

    code = ErrorCode.INVALID_FIELD


def register(kind: str, factory: RecipeFactory, *, overwrite: bool = False) -> None:
    """Make ``factory`` the runner of workloads of ``kind``; a kind taken by another factory
    is refused unless ``overwrite`` (a recipe module replacing a built-in one says so)."""
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"kind={kind!r}: a recipe's kind must be a non-empty string")
    if not callable(factory):
        raise ValueError(f"recipe of kind {kind!r}: {factory!r} is not callable")
    old = _RECIPES.get(kind)
    if old is not None and old is not factory and not overwrite:
        raise ValueError(f"workflow kind {kind!r} is already registered ({_name(old)}); pass overwrite=True "
                         "to replace it")
    _RECIPES[kind] = factory


def kinds() -> tuple[str, ...]:
    """The registered kinds, in registration order."""
    return tuple(_RECIPES)


def lookup(kind: str) -> RecipeFactory:
    """The factory of ``kind``; `InvalidField` on ``kind`` naming the known kinds otherwise."""
    factory = _RECIPES.get(kind)
    if factory is None:
        known = ", ".join(_RECIPES) or f"none registered (no module {SETTING} names registered one)"
        raise InvalidField("kind", f"{kind!r} is not a workflow; allowed: {known}")
    return factory


def load_modules(modules: Sequence[str]) -> None:
    """Import each module (its import registers its recipes); one that fails to import is a
    `RecipeModuleError` naming it and the setting, its own error chained."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # a module raising anything at import is one that did not load
            raise RecipeModuleError(f"{SETTING}: module {module!r} could not be imported: "
                                    f"{type(exc).__name__}: {exc}", details={"module": module}) from exc


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
