"""The simulator adapter interface every simulator (built-in, ManiSkill3, LIBERO) implements.

An adapter is a gymnasium-like env with a typed spec, a language task and rendered cameras:

    env = envs.make("builtin/reach-v0")
    spec = env.spec                 # EnvSpec: cameras (name, H, W), state_dim, action bounds, tasks
    obs, info = env.reset(seed=0, task="red")   # task: name, instruction, index, or None (seeded pick)
    obs, reward, terminated, truncated, info = env.step(action_A)
    env.close()

`Observation.images[name]` is uint8 (H, W, 3); `Observation.state` float32 (state_dim,);
`Observation.instruction` the language instruction of the episode's task. `info` always has
``success`` (bool), ``task`` (task name) and ``task_index`` (int).
"""

from __future__ import annotations

import abc
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envs.errors import ActionError, ConfigError, UnknownTaskError

# Keys every adapter puts in `info` (the env worker and evaluators rely on them).
INFO_SUCCESS = "success"
INFO_TASK = "task"
INFO_TASK_INDEX = "task_index"


@dataclass(frozen=True)
class CameraSpec:
    name: str
    height: int
    width: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("CameraSpec.name: must be a non-empty string")
        for fname in ("height", "width"):
            if int(getattr(self, fname)) <= 0:
                raise ConfigError(f"CameraSpec.{fname}: must be > 0, got {getattr(self, fname)}")

    @property
    def shape_HWC(self) -> tuple[int, int, int]:
        return (self.height, self.width, 3)


@dataclass(frozen=True)
class TaskSpec:
    name: str
    instruction: str


@dataclass(frozen=True)
class EnvSpec:
    env_id: str
    cameras: tuple[CameraSpec, ...]
    state_dim: int
    action_dim: int
    action_low: tuple[float, ...]
    action_high: tuple[float, ...]
    tasks: tuple[TaskSpec, ...]
    max_episode_steps: int
    fps: int
    state_names: tuple[str, ...] = ()
    action_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.action_low) != self.action_dim or len(self.action_high) != self.action_dim:
            raise ConfigError(
                f"EnvSpec.action_low/action_high: need {self.action_dim} values each, got "
                f"{len(self.action_low)} and {len(self.action_high)}"
            )
        if not self.tasks:
            raise ConfigError("EnvSpec.tasks: at least one task is required")

    @property
    def camera_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.cameras)

    @property
    def instructions(self) -> tuple[str, ...]:
        return tuple(t.instruction for t in self.tasks)

    def task_index(self, task: str | int) -> int:
        """Resolve a task given as index, name or instruction; unknown ones list the known."""
        if isinstance(task, (int, np.integer)) and not isinstance(task, bool):
            if 0 <= int(task) < len(self.tasks):
                return int(task)
        else:
            for i, t in enumerate(self.tasks):
                if task in (t.name, t.instruction):
                    return i
        known = ", ".join(f"{i}={t.name!r} ({t.instruction!r})" for i, t in enumerate(self.tasks))
        raise UnknownTaskError(
            f"unknown task {task!r} for {self.env_id}; known tasks: {known}",
            details={"task": str(task), "known": [t.name for t in self.tasks]},
        )


@dataclass
class Observation:
    images: dict[str, np.ndarray]  # camera name -> uint8 (H, W, 3)
    state: np.ndarray  # float32 (state_dim,)
    instruction: str


@dataclass
class StepResult:
    """What `step` returns, for callers that prefer names over a 5-tuple."""

    obs: Observation
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)


class EnvAdapter(abc.ABC):
    """One simulator session. Not thread-safe; one episode at a time."""

    @property
    @abc.abstractmethod
    def spec(self) -> EnvSpec: ...

    @abc.abstractmethod
    def reset(
        self, seed: int | None = None, task: str | int | None = None
    ) -> tuple[Observation, dict[str, Any]]: ...

    @abc.abstractmethod
    def step(self, action: np.ndarray) -> tuple[Observation, float, bool, bool, dict[str, Any]]: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> EnvAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_action(spec: EnvSpec, action: Any) -> np.ndarray:
    """Validate shape and finiteness, then clip to the spec's bounds (documented behaviour)."""
    arr = np.asarray(action, dtype=np.float32)
    expected = (spec.action_dim,)
    if arr.shape != expected:
        raise ActionError(
            f"action for {spec.env_id} must have shape {expected}, got {arr.shape}",
            details={"expected": list(expected), "actual": list(arr.shape)},
        )
    if not np.all(np.isfinite(arr)):
        raise ActionError(f"action for {spec.env_id} has non-finite values: {arr.tolist()}")
    return np.clip(arr, np.asarray(spec.action_low, np.float32), np.asarray(spec.action_high, np.float32))


# The largest frame side any env renders on request (the tenant schema's camera bound,
# models/schema.py): options come from tenants, and an unbounded side is an unbounded render.
MAX_IMAGE_SIDE = 4096


def config_from_options(cls: type, env_id: str, options: dict[str, Any],
                        image_size: int | tuple[int, int] | None = None, **fixed: Any) -> Any:
    """Build an adapter's config dataclass from registry options; unknown ones raise, naming
    them and the known ones. ``image_size`` (int or (H, W)) sets image_height / image_width;
    ``fixed`` are fields the factory sets itself (callers may not)."""
    known = {f.name for f in dataclasses.fields(cls)} - set(fixed)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"{env_id}: unknown option(s) {unknown}; known: {sorted(known | {'image_size'})}")
    options = dict(options)
    try:
        if image_size is not None:
            if not (isinstance(image_size, int) or (isinstance(image_size, (list, tuple)) and len(image_size) == 2)) \
                    or isinstance(image_size, bool):
                raise ConfigError(f"{env_id}: option image_size={image_size!r}; allowed: an int (square frames) "
                                  "or [height, width]")
            h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
            options.update(image_height=h, image_width=w)
        for name in ("image_height", "image_width"):
            side = options.get(name)
            if isinstance(side, (int, np.integer)) and not isinstance(side, bool) and side > MAX_IMAGE_SIDE:
                raise ConfigError(f"{env_id}: option {name}={side} is too large; allowed: 1..{MAX_IMAGE_SIDE}")
        return cls(**options, **fixed)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # options come from clients: a wrong type is theirs
        raise ConfigError(f"{env_id}: bad option value ({type(exc).__name__}: {exc})") from None


# ---- what an env takes and renders, known without building it ------------------------------
@dataclass(frozen=True)
class EnvFacts:
    """An env id's options and, for the options given, what it would render: known from its
    config dataclass alone, without starting a simulator (`envs.registry.describe`). The
    submit checks (master/submit_checks.py) compare a workload spec with these. None: known
    only once the simulator is built (a ManiSkill task that is not listed, say)."""

    env_id: str
    options: tuple[str, ...]  # every option name the env accepts
    cameras: tuple[CameraSpec, ...] | None = None
    state_dim: int | None = None
    action_dim: int | None = None
    unknown: tuple[str, ...] = ()  # options given that the env does not take
    problem: str = ""  # why the options given would be refused (the config's own message)
    problem_option: str = ""  # the option given that ``problem`` is about, when it names one


def option_names(cls: type, **fixed: Any) -> tuple[str, ...]:
    """The options `config_from_options` takes for ``cls``: its fields (less the ones the
    factory sets itself) and image_size."""
    return tuple(sorted(({f.name for f in dataclasses.fields(cls)} - set(fixed)) | {"image_size"}))


def facts_from_options(cls: type, env_id: str, options: dict[str, Any], facts: Any, **fixed: Any) -> EnvFacts:
    """Build ``cls`` from ``options`` as the env's factory would (every value check of the config
    runs; nothing is simulated) and describe it with ``facts(config) -> dict`` of EnvFacts fields."""
    known = option_names(cls, **fixed)
    unknown = tuple(sorted(set(options) - set(known)))
    if unknown:
        return EnvFacts(env_id, known, unknown=unknown)
    opts = dict(options)
    image_size = opts.pop("image_size", None)
    try:
        cfg = config_from_options(cls, env_id, opts, image_size, **fixed)
    except ConfigError as exc:
        return EnvFacts(env_id, known, problem=exc.message, problem_option=_named_option(exc.message, options))
    return EnvFacts(env_id, known, **facts(cfg))


def _named_option(message: str, options: dict[str, Any]) -> str:
    """The option given that a config error names ('ReachConfig.cameras: ...', 'option image_height=...')."""
    for name in re.findall(r"(?:Config\.|option )([A-Za-z_]+)", message):
        if name in ("image_height", "image_width") and name not in options and "image_size" in options:
            return "image_size"
        if name in options:
            return name
    return ""
