"""A tenant's own env, as `nexus env serve` runs it (docs/hosted_envs.md).

The tenant names a factory ``MODULE:FACTORY``; ``FACTORY(**env.options)`` returns either

* an `envs.adapter.EnvAdapter` (the platform's contract: `Observation` with ``images``,
  ``state``, ``instruction``; ``info["success"]``), used as it is; or
* a plain ``gymnasium.Env`` whose observation space is a ``Dict`` of image and state spaces,
  wrapped by `GymnasiumAdapter`: every ``Box`` of dtype uint8 and shape (H, W, 3) is a camera
  (its key the camera name; or nested under an ``images`` Dict), the 1-D ``Box`` named
  ``state`` the state (none: state_dim 0); the action space a 1-D ``Box``; the instruction the
  env's ``instruction`` attribute (or ``info["instruction"]`` at reset); success
  ``info["success"]`` (absent: False). Reward, termination and success are the tenant's own:
  they run in its process, never on the platform.

Every env runs in a child process of the serving process (`envs.simproc`), made through
`make_hosted`, which checks the first observation of each env against the workload's
observation schema: a camera or state of another shape is refused with one error naming the
key and both shapes (`ObservationMismatch`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from envs.adapter import (
    INFO_SUCCESS,
    INFO_TASK,
    INFO_TASK_INDEX,
    CameraSpec,
    EnvAdapter,
    EnvSpec,
    Observation,
    TaskSpec,
)
from envs.errors import ConfigError, EnvError, EnvStateError

DEFAULT_MAX_EPISODE_STEPS = 1000  # a gymnasium env without a TimeLimit spec


class FactoryError(ConfigError):
    """The factory ``MODULE:FACTORY`` cannot be loaded or called; the message names the module."""


class ObservationMismatch(EnvError, ValueError):
    """An observation of the tenant's env does not match the workload's observation schema."""


def load_factory(ref: str) -> Callable[..., Any]:
    """The callable ``ref`` (``MODULE:FACTORY``, FACTORY may be dotted) names."""
    module_name, sep, qual = ref.partition(":")
    if not sep or not module_name or not qual:
        raise FactoryError(f"factory {ref!r}: allowed: MODULE:FACTORY (e.g. my_task:make_env), a module on "
                           "the Python path and a callable in it")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the tenant's module's
        raise FactoryError(f"factory {ref!r}: module {module_name!r} could not be imported "
                           f"({type(exc).__name__}: {exc})", details={"module": module_name}) from None
    for part in qual.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise FactoryError(f"factory {ref!r}: module {module_name!r} has no {qual!r}",
                               details={"module": module_name, "factory": qual}) from None
    if not callable(obj):
        raise FactoryError(f"factory {ref!r}: {qual!r} in module {module_name!r} is not callable",
                           details={"module": module_name, "factory": qual})
    return obj


def as_adapter(env: Any, env_id: str) -> EnvAdapter:
    """``env`` as an `EnvAdapter`: itself, or a gymnasium env wrapped."""
    if isinstance(env, EnvAdapter):
        return env
    import gymnasium as gym

    if isinstance(env, gym.Env):
        return GymnasiumAdapter(env, env_id)
    raise FactoryError(f"the factory of {env_id} returned a {type(env).__name__}; allowed: an envs.EnvAdapter or a "
                       "gymnasium.Env (docs/hosted_envs.md)")


def _is_camera(space: Any) -> bool:
    import gymnasium as gym

    return (isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3
            and space.shape[2] == 3)


class GymnasiumAdapter(EnvAdapter):
    """A plain gymnasium env with image and state spaces behind the platform's adapter API."""

    def __init__(self, env: Any, env_id: str) -> None:
        import gymnasium as gym

        self.env, self.env_id = env, env_id
        space = env.observation_space
        if not isinstance(space, gym.spaces.Dict):
            raise FactoryError(f"{env_id}: observation_space is a {type(space).__name__}; allowed: a Dict of camera "
                               "Boxes (uint8, H x W x 3) and an optional 1-D 'state' Box")
        images = space.spaces.get("images")
        cams = images.spaces if isinstance(images, gym.spaces.Dict) else {
            k: v for k, v in space.spaces.items() if _is_camera(v)}
        self._nested = isinstance(images, gym.spaces.Dict)
        bad = [k for k, v in cams.items() if not _is_camera(v)]
        if bad or not cams:
            raise FactoryError(f"{env_id}: observation_space needs at least one camera Box (uint8, H x W x 3); "
                               f"not one: {bad or 'none given'}")
        state = space.spaces.get("state")
        if state is not None and not (isinstance(state, gym.spaces.Box) and len(state.shape) == 1):
            raise FactoryError(f"{env_id}: observation_space['state'] must be a 1-D Box, got {state}")
        act = env.action_space
        if not (isinstance(act, gym.spaces.Box) and len(act.shape) == 1):
            raise FactoryError(f"{env_id}: action_space must be a 1-D Box, got {act}")
        self._cams = tuple(cams)
        limit = getattr(getattr(env, "spec", None), "max_episode_steps", None) or DEFAULT_MAX_EPISODE_STEPS
        instruction = str(getattr(env, "instruction", "") or "")
        self._spec = EnvSpec(
            env_id=env_id,
            cameras=tuple(CameraSpec(k, int(v.shape[0]), int(v.shape[1])) for k, v in cams.items()),
            state_dim=int(state.shape[0]) if state is not None else 0, action_dim=int(act.shape[0]),
            action_low=tuple(float(x) for x in act.low), action_high=tuple(float(x) for x in act.high),
            tasks=(TaskSpec("default", instruction),), max_episode_steps=int(limit),
            fps=int(getattr(env, "metadata", {}).get("render_fps") or 10))
        self._instruction = instruction
        self._started = False

    @property
    def spec(self) -> EnvSpec:
        return self._spec

    def _obs(self, raw: Any, info: dict[str, Any]) -> Observation:
        if not isinstance(raw, dict):
            raise ObservationMismatch(f"{self.env_id}: an observation must be a dict, got {type(raw).__name__}")
        images = raw.get("images") if self._nested else raw
        if not isinstance(images, dict):
            raise ObservationMismatch(f"{self.env_id}: observation key 'images' must be a dict of camera frames")
        state = raw.get("state")
        instruction = str(info.get("instruction") or getattr(self.env, "instruction", "") or self._instruction)
        return Observation(images={k: np.asarray(images.get(k)) for k in self._cams if k in images},
                           state=np.zeros(0, np.float32) if state is None else np.asarray(state, np.float32),
                           instruction=instruction)

    @staticmethod
    def _info(info: dict[str, Any]) -> dict[str, Any]:
        out = dict(info or {})
        out[INFO_SUCCESS] = bool(out.get(INFO_SUCCESS, False))
        out.setdefault(INFO_TASK, "default")
        out.setdefault(INFO_TASK_INDEX, 0)
        return out

    def reset(self, seed: int | None = None, task: str | int | None = None) -> tuple[Observation, dict[str, Any]]:
        raw, info = self.env.reset(seed=seed)
        self._started = True
        return self._obs(raw, info or {}), self._info(info)

    def step(self, action: np.ndarray) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        if not self._started:
            raise EnvStateError(f"{self.env_id}: step before reset")
        raw, reward, terminated, truncated, info = self.env.step(np.asarray(action, np.float32))
        return self._obs(raw, info or {}), float(reward), bool(terminated), bool(truncated), self._info(info)

    def close(self) -> None:
        self.env.close()


class SchemaChecked(EnvAdapter):
    """The tenant's env with its observations checked against the workload's schema: every
    reset's (the first one refuses a mismatched env before any data is queued)."""

    def __init__(self, env: EnvAdapter, cameras: dict[str, list[int]], state_dim: int) -> None:
        self.env, self.cameras, self.state_dim = env, cameras, state_dim

    @property
    def spec(self) -> EnvSpec:
        return self.env.spec

    def check(self, obs: Observation) -> None:
        id_ = self.env.spec.env_id
        for name, shape in self.cameras.items():
            want = (int(shape[0]), int(shape[1]), 3)
            frame = obs.images.get(name)
            if frame is None:
                raise ObservationMismatch(
                    f"{id_}: observation key images.{name}: the spec's observation.cameras wants shape {want}, the env "
                    f"gives none (its cameras: {sorted(obs.images)})", details={"key": f"images.{name}"})
            got = tuple(np.asarray(frame).shape)
            if got != want or np.asarray(frame).dtype != np.uint8:
                raise ObservationMismatch(
                    f"{id_}: observation key images.{name}: the env gives shape {got} ({np.asarray(frame).dtype}), "
                    f"the spec's observation wants {want} (uint8)", details={"key": f"images.{name}"})
        got_state = tuple(np.asarray(obs.state).shape)
        if got_state != (self.state_dim,):
            raise ObservationMismatch(
                f"{id_}: observation key state: the env gives shape {got_state}, the spec's observation.state_dim "
                f"wants ({self.state_dim},)", details={"key": "state"})

    def reset(self, seed: int | None = None, task: str | int | None = None) -> tuple[Observation, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, task=task)
        self.check(obs)
        return obs, info

    def step(self, action: np.ndarray) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        return self.env.step(action)

    def close(self) -> None:
        self.env.close()


def make_hosted(env_id: str, factory: str, options: dict[str, Any] | None = None,
                cameras: dict[str, list[int]] | None = None, state_dim: int = 0) -> EnvAdapter:
    """The env `nexus env serve` registers for a hosted workload's env id (called in the
    simulator's child process): the tenant's factory with the workload's env.options, checked
    against its observation schema (``cameras``: name -> [H, W]; ``state_dim``)."""
    fn = load_factory(factory)
    try:
        env = fn(**dict(options or {}))
    except EnvError:
        raise
    except TypeError as exc:  # an option the factory does not take
        raise ConfigError(f"{env_id}: the factory {factory!r} refused env.options {sorted(options or {})}: {exc}") from None
    return SchemaChecked(as_adapter(env, env_id), dict(cameras or {}), int(state_dim))
