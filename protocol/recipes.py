"""Workflow recipes by kind: the modules NEXUS_WORKFLOW_MODULES names register a runner factory
per workload kind here, with the recipe's config model and its *family*; the master reads the
declaration (to validate a spec of that kind), the hosts that run workloads (the env worker,
`nexus env serve`) the factory, so none of them imports the workflows themselves.

    from protocol import recipes
    recipes.register("rl", make_rl)      # in a recipe module (workflows/__init__.py does sft, rl, eval;
                                         # workflows.common.as_recipe(cls) makes a factory of a Workflow,
                                         # carrying its config_model and family)
    recipes.register("repeat-eval", make, config=RepeatEvalConfig, family="eval")
    recipes.load_modules(("workflows",)) # a host or the master, at start
    recipes.declaration("repeat-eval")   # Declaration(kind, family="eval", config=RepeatEvalConfig)
    runner = recipes.lookup(spec.kind)(spec, data_dir=d, log=log, nats_url=url, prefix=p)

A kind's *family* is the built-in task whose rules it follows (`FAMILIES`): which spec sections
it needs or forbids, whether it trains (and makes training-queue jobs of that task), which
budget target metrics apply, whether it reads a pinned version of an existing policy (eval).
The built-in kinds sft, rl and eval are declared here, with their configs
(`protocol.recipe_configs`), so the master knows them without importing a workflow; their
factories come from `workflows`. A kind of your own is declared by its registration.

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
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.errors import ErrorCode, InvalidField, NexusError
from protocol.policy import RECIPE_KIND_MAX, RECIPE_KIND_PATTERN
from protocol.recipe_configs import CONFIGS, RecipeConfig

RecipeFactory = Callable[..., Any]

SETTING = "NEXUS_WORKFLOW_MODULES"  # the variable naming the modules that register recipes
# The built-in tasks, in the order errors list them; every kind follows the rules of one.
FAMILIES = ("sft", "rl", "eval")
_KIND = re.compile(rf"^{RECIPE_KIND_PATTERN}$")
_UNSET: Any = object()


@dataclass(frozen=True)
class Declaration:
    """What the master needs of a kind: its family and its config model (None: it takes no
    ``algorithm`` section)."""

    kind: str
    family: str
    config: type[RecipeConfig] | None = None


# kind -> declaration (the built-ins first) and kind -> factory, in registration order (the
# order errors list them in).
_DECLARED: dict[str, Declaration] = {k: Declaration(k, k, CONFIGS.get(k)) for k in FAMILIES}
_RECIPES: dict[str, RecipeFactory] = {}


class RecipeModuleError(NexusError, ValueError):
    """A module NEXUS_WORKFLOW_MODULES names could not be imported (its own error chained): a
    bad value of that setting, so a host stops at start saying which module."""

    code = ErrorCode.INVALID_FIELD


def valid_kind(kind: Any) -> bool:
    """Is ``kind`` a well-formed kind name (whether registered or not)?"""
    return isinstance(kind, str) and _KIND.match(kind) is not None


def kind_rule() -> str:
    return f"lowercase letters, digits and '-', starting with a letter, at most {RECIPE_KIND_MAX} characters"


def register(kind: str, factory: RecipeFactory, *, config: type[RecipeConfig] | None = _UNSET,
             family: str | None = None, overwrite: bool = False) -> None:
    """Make ``factory`` the runner of workloads of ``kind`` and declare the kind: ``config``
    (its ``algorithm`` section's model, None for none) and ``family`` (one of `FAMILIES`)
    default to the factory's ``config_model`` / ``family`` attributes (`as_recipe` sets them),
    then to the built-in kind's own. A kind taken by another factory is refused unless
    ``overwrite`` (a recipe module replacing a built-in one says so); a built-in kind keeps its
    family (the master's rules for it are that task's)."""
    if not valid_kind(kind):
        raise ValueError(f"kind={kind!r}: a recipe's kind must be a non-empty name of {kind_rule()}")
    if not callable(factory):
        raise ValueError(f"recipe of kind {kind!r}: {factory!r} is not callable")
    old = _RECIPES.get(kind)
    if old is not None and old is not factory and not overwrite:
        raise ValueError(f"workflow kind {kind!r} is already registered ({_name(old)}); pass overwrite=True "
                         "to replace it")
    known = _DECLARED.get(kind)
    family = family or getattr(factory, "family", None) or (known.family if known is not None else None)
    if family not in FAMILIES:
        raise ValueError(f"recipe of kind {kind!r}: family={family!r}; allowed: {', '.join(FAMILIES)} (the built-in "
                         "task whose spec rules, training queue and target metrics the kind follows: set the "
                         "workflow class's `family`, or pass register(..., family=...))")
    if kind in FAMILIES and family != kind:
        raise ValueError(f"recipe of kind {kind!r}: a built-in kind keeps its family; got {family!r}")
    if config is _UNSET:
        config = getattr(factory, "config_model", _UNSET)
        if config is _UNSET:
            config = known.config if known is not None else None
    if config is not None and not (isinstance(config, type) and issubclass(config, RecipeConfig)):
        raise ValueError(f"recipe of kind {kind!r}: config={config!r} is not a RecipeConfig model")
    _DECLARED[kind] = Declaration(kind, family, config)
    _RECIPES[kind] = factory


def kinds() -> tuple[str, ...]:
    """The kinds with a factory registered here, in registration order."""
    return tuple(_RECIPES)


def declared_kinds() -> tuple[str, ...]:
    """Every kind this process knows: the built-ins and those registered, in that order."""
    return tuple(_DECLARED)


def declaration(kind: Any) -> Declaration | None:
    """The declaration of ``kind`` (no factory needed: the master's view); None when unknown."""
    return _DECLARED.get(kind) if isinstance(kind, str) else None


def family_of(kind: str) -> str:
    """The family of a declared ``kind``; `InvalidField` on ``kind`` naming the known kinds otherwise."""
    known = declaration(kind)
    if known is None:
        raise InvalidField("kind", f"{kind!r} is not a workload kind this process knows; allowed: "
                                   f"{', '.join(_DECLARED)} ({SETTING} names the modules that register others)")
    return known.family


def lookup(kind: str) -> RecipeFactory:
    """The factory of ``kind``; `InvalidField` on ``kind`` naming the known kinds otherwise."""
    factory = _RECIPES.get(kind)
    if factory is None:
        known = (f"{', '.join(_RECIPES)} (the modules {SETTING} names on this host register them)" if _RECIPES
                 else f"none registered (no module {SETTING} names registered one)")
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
