"""Env ids -> adapter factories.

    import envs
    env = envs.make("builtin/reach-v0", cameras=("top",), image_size=64)
    envs.known_env_ids()   # ('builtin/reach-v0', ...)

Factories register lazily (a module path + attribute) so that listing ids never imports a
heavy simulator; ManiSkill3 and LIBERO adapters register the same way later.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from envs.adapter import EnvAdapter, EnvFacts
from envs.errors import UnknownEnvError

Factory = str | Callable[..., Any]

# env id -> "module:callable" or a callable returning an EnvAdapter.
_REGISTRY: dict[str, Factory] = {}
# env id -> "module:callable" building a scripted expert: expert(env) -> action.
_EXPERTS: dict[str, Factory] = {}
# env id -> "module:callable" describing it without a simulator: describe(env_id, options)
# -> envs.adapter.EnvFacts (the options it takes, the cameras it renders with them).
_DESCRIBERS: dict[str, Factory] = {}


def register(env_id: str, factory: Factory, *, expert: Factory | None = None, describe: Factory | None = None,
             overwrite: bool = False) -> None:
    if env_id in _REGISTRY and not overwrite:
        raise ValueError(f"env id {env_id!r} is already registered")
    _REGISTRY[env_id] = factory
    if expert is not None:
        _EXPERTS[env_id] = expert
    if describe is not None:
        _DESCRIBERS[env_id] = describe
    else:
        _DESCRIBERS.pop(env_id, None)  # a re-registered id's old description no longer holds


def describe(env_id: str, options: dict[str, Any]) -> EnvFacts | None:
    """What ``env_id`` takes and, with ``options``, renders, without starting its simulator;
    None for an id registered without a describer or not registered here (an env worker's
    plugin: its env worker checks the options when the workload starts)."""
    if env_id not in _DESCRIBERS:
        return None
    return _load(_DESCRIBERS[env_id])(env_id, dict(options))


def has_expert(env_id: str) -> bool:
    return env_id in _EXPERTS


def experts() -> tuple[str, ...]:
    return tuple(sorted(_EXPERTS))


def _load(factory: Factory) -> Callable[..., Any]:
    if isinstance(factory, str):
        module_name, _, attr = factory.partition(":")
        return getattr(importlib.import_module(module_name), attr)
    return factory


def known_env_ids() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def _resolve(env_id: str) -> Callable[..., EnvAdapter]:
    try:
        factory = _REGISTRY[env_id]
    except KeyError:
        raise UnknownEnvError(
            f"unknown env id {env_id!r}; known env ids: {', '.join(known_env_ids())}",
            details={"env_id": env_id, "known": list(known_env_ids())},
        ) from None
    return _load(factory)


def make(env_id: str, **kwargs: Any) -> EnvAdapter:
    """Build a fresh adapter; kwargs go to the env's config (unknown ones raise, naming them)."""
    return _resolve(env_id)(env_id=env_id, **kwargs)


def factory_ref(env_id: str) -> str:
    """``"module:qualname"`` of an env id's factory, for a child process (`envs.simproc`) to
    import and call; "" when it has none to import (a callable of ``__main__`` or a local one:
    the child then resolves the id in its own registry). An unknown id raises, listing them."""
    _resolve(env_id)
    factory = _REGISTRY[env_id]
    if isinstance(factory, str):
        return factory
    module, qual = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or module == "__main__" or not qual or "<" in qual:
        return ""
    return f"{module}:{qual}"


def make_expert(env_id: str) -> Callable[[EnvAdapter], Any]:
    """The scripted expert of an env id: `expert(env) -> action` (it may read privileged state)."""
    _resolve(env_id)  # unknown ids get the same listing error as make()
    if env_id not in _EXPERTS:
        with_expert = ", ".join(sorted(_EXPERTS))
        raise UnknownEnvError(f"env id {env_id!r} has no scripted expert; env ids with one: {with_expert}")
    return _load(_EXPERTS[env_id])()


register("builtin/reach-v0", "envs.builtin.reach:make_reach", expert="envs.builtin.expert:ReachExpert",
         describe="envs.builtin.reach:describe_reach")
for _suite in ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90"):  # envs/libero.py
    register(f"libero/{_suite}", "envs.libero:make_libero", describe="envs.libero:describe_libero")
for _task in ("PickCube-v1", "PushCube-v1", "StackCube-v1", "PegInsertionSide-v1"):  # envs/maniskill.py
    register(f"maniskill/{_task}", "envs.maniskill:make_maniskill",
             expert={"PickCube-v1": "envs.maniskill:PickCubeExpert",
                     "PushCube-v1": "envs.maniskill:PushCubeExpert"}.get(_task),
             describe="envs.maniskill:describe_maniskill")
