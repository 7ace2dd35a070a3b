"""builtin/reach-v0: "reach the <colour> target", the embedded default VLA task.

A point end-effector moves in the 2-D workspace [-1, 1]^2 among three coloured targets
(red, green, blue) at seeded random positions; the instruction names one of them, the
other two are distractors. Success: the end-effector centre comes within `success_radius`
of the instructed target (the episode then terminates). Truncation at `max_episode_steps`.

    env = envs.make("builtin/reach-v0")                  # two 64x64 cameras, 50 steps
    env = envs.make("builtin/reach-v0", cameras=("top",), image_size=96)
    obs, info = env.reset(seed=3, task="green")
    obs, r, terminated, truncated, info = env.step(expert_action(env))

Observation: cameras "top" (whole workspace, fixed) and "wrist" (a 2x zoomed view that moves
with the end-effector); state float32 [x, y, vx, vy] (vx, vy: last commanded velocity in
[-1, 1]). Action: float32 (2,) velocity command in [-1, 1]^2 (clipped), moving at most
`max_step` per axis per step. Reward ("dense", default): decrease in distance to the
instructed target each step, plus `success_bonus` on success; "sparse": only the bonus.

Determinism: the layout depends only on the reset seed (not on the task), so the same seed
with different instructions gives the same image and different correct actions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.adapter import (
    config_from_options,
    EnvFacts,
    facts_from_options,
    INFO_SUCCESS,
    INFO_TASK,
    INFO_TASK_INDEX,
    CameraSpec,
    EnvAdapter,
    EnvSpec,
    Observation,
    TaskSpec,
    check_action,
)
from envs.builtin.render import DiscCamera
from envs.errors import ConfigError, EnvStateError

CAMERA_TOP = "top"
CAMERA_WRIST = "wrist"
KNOWN_CAMERAS = (CAMERA_TOP, CAMERA_WRIST)
REWARD_MODES = ("dense", "sparse")

# Task variants: (name, rgb). Saturated, well-separated colours so a tiny CNN tells them apart.
TARGETS: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("red", (220, 40, 40)),
    ("green", (40, 170, 60)),
    ("blue", (50, 80, 220)),
)
AGENT_RGB = (25, 25, 25)
FLOOR_RGB = (205, 205, 200)
WALL_RGB = (70, 70, 70)
STATE_NAMES = ("x", "y", "vx", "vy")
ACTION_NAMES = ("vx", "vy")
INFO_DISTANCE = "distance"
INFO_STEPS = "steps"

# Objects are placed away from the walls so the wrist view always sees some floor around them.
_PLACEMENT_HALF_EXTENT = 0.85
_MAX_PLACEMENT_TRIES = 1000


def instruction_for(target_name: str) -> str:
    return f"reach the {target_name} target"


MAX_IMAGE_SIDE = 4096  # the tenant schema's own camera bound


@dataclass(frozen=True)
class ReachConfig:
    image_height: int = 64  # small: rendering stays ~0.1 ms and a tiny CNN trains on CPU
    image_width: int = 64
    cameras: tuple[str, ...] = (CAMERA_TOP, CAMERA_WRIST)  # () = no rendering (state-only RL)
    max_episode_steps: int = 50  # the expert needs <= 20 steps; 50 leaves room for a learner
    max_step: float = 0.1  # displacement per axis per step at |action| = 1
    success_radius: float = 0.12  # a bit more than one max step, so a learner need not be exact
    target_radius: float = 0.1  # drawn size: ~3 px at 64x64 in the top view
    agent_radius: float = 0.07
    wrist_half_extent: float = 0.5  # wrist view covers 1x1 of the 2x2 workspace
    min_target_separation: float = 0.45  # targets never overlap on screen
    min_start_distance: float = 0.5  # start this far from every target: no free successes
    reward: str = "dense"  # dense progress reward makes PPO from scratch feasible on CPU
    success_bonus: float = 1.0
    fps: int = 10  # control rate; recorded datasets use it as their fps
    seed: int = 0  # seeds resets that pass no seed

    def __post_init__(self) -> None:
        for name in ("image_height", "image_width", "max_episode_steps", "fps"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ReachConfig.{name}: must be a positive int, got {value!r}")
        # Options arrive from clients (env.create): an image size without a bound is an OOM.
        if max(self.image_height, self.image_width) > MAX_IMAGE_SIDE:
            raise ConfigError(f"ReachConfig.image_height/image_width: at most {MAX_IMAGE_SIDE}")
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"ReachConfig.seed: must be an int >= 0, got {self.seed!r}")
        for name in ("max_step", "success_radius", "target_radius", "agent_radius", "wrist_half_extent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not float(value) > 0:
                raise ConfigError(f"ReachConfig.{name}: must be > 0, got {getattr(self, name)!r}")
        if not isinstance(self.cameras, tuple):
            object.__setattr__(self, "cameras", tuple(self.cameras))
        unknown = [c for c in self.cameras if c not in KNOWN_CAMERAS]
        if unknown or len(set(self.cameras)) != len(self.cameras):
            raise ConfigError(
                f"ReachConfig.cameras: each must be one of {KNOWN_CAMERAS}, no repeats; got {self.cameras}"
            )
        if self.reward not in REWARD_MODES:
            raise ConfigError(f"ReachConfig.reward: must be one of {REWARD_MODES}, got {self.reward!r}")
        if self.min_start_distance <= self.success_radius:
            raise ConfigError("ReachConfig.min_start_distance: must exceed success_radius")


class ReachEnv(EnvAdapter):
    def __init__(self, config: ReachConfig | None = None, env_id: str = "builtin/reach-v0") -> None:
        self.config = config or ReachConfig()
        cfg = self.config
        self._spec = EnvSpec(
            env_id=env_id,
            cameras=tuple(CameraSpec(c, cfg.image_height, cfg.image_width) for c in cfg.cameras),
            state_dim=len(STATE_NAMES),
            action_dim=len(ACTION_NAMES),
            action_low=(-1.0, -1.0),
            action_high=(1.0, 1.0),
            tasks=tuple(TaskSpec(name, instruction_for(name)) for name, _ in TARGETS),
            max_episode_steps=cfg.max_episode_steps,
            fps=cfg.fps,
            state_names=STATE_NAMES,
            action_names=ACTION_NAMES,
        )
        self._camera = DiscCamera(cfg.image_height, cfg.image_width, FLOOR_RGB, WALL_RGB)
        self._rng = np.random.default_rng(cfg.seed)
        self._closed = False
        self._needs_reset = True
        self._pos = np.zeros(2)
        self._vel = np.zeros(2)
        self._targets = np.zeros((len(TARGETS), 2))
        self._task_index = 0
        self._steps = 0

    # -- adapter API ---------------------------------------------------------------------
    @property
    def spec(self) -> EnvSpec:
        return self._spec

    def reset(self, seed: int | None = None, task: str | int | None = None) -> tuple[Observation, dict[str, Any]]:
        self._check_open()
        rng = np.random.default_rng(seed) if seed is not None else self._rng
        # Always draw the task first so the layout that follows is the same for any task.
        drawn_task = int(rng.integers(len(TARGETS)))
        self._task_index = drawn_task if task is None else self._spec.task_index(task)
        self._targets, self._pos = self._sample_layout(rng)
        self._vel = np.zeros(2)
        self._steps = 0
        self._needs_reset = False
        return self._observe(), self._info(self._distance())

    def step(self, action: Any) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        self._check_open()
        if self._needs_reset:
            raise EnvStateError(f"{self._spec.env_id}: call reset() before step() (also after an episode ends)")
        a = check_action(self._spec, action).astype(np.float64)
        cfg = self.config
        before = self._distance()
        self._pos = np.clip(self._pos + a * cfg.max_step, -1.0, 1.0)
        self._vel = a
        self._steps += 1
        after = self._distance()
        success = after <= cfg.success_radius
        reward = (before - after if cfg.reward == "dense" else 0.0) + (cfg.success_bonus if success else 0.0)
        truncated = (not success) and self._steps >= cfg.max_episode_steps
        self._needs_reset = success or truncated
        return self._observe(), float(reward), bool(success), bool(truncated), self._info(after)

    def close(self) -> None:
        self._closed = True

    # -- for the scripted expert and tests -----------------------------------------------
    @property
    def agent_position(self) -> np.ndarray:
        return self._pos.copy()

    @property
    def target_position(self) -> np.ndarray:
        return self._targets[self._task_index].copy()

    @property
    def target_positions(self) -> np.ndarray:
        return self._targets.copy()

    # -- internals -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EnvStateError(f"{self._spec.env_id}: env is closed")

    def _sample_layout(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.config
        h = _PLACEMENT_HALF_EXTENT
        for _ in range(_MAX_PLACEMENT_TRIES):
            pts = rng.uniform(-h, h, size=(len(TARGETS) + 1, 2))
            targets, agent = pts[:-1], pts[-1]
            d_tt = np.linalg.norm(targets[:, None] - targets[None], axis=-1)
            d_tt[np.diag_indices(len(TARGETS))] = np.inf
            if d_tt.min() < cfg.min_target_separation:
                continue
            if np.linalg.norm(targets - agent, axis=-1).min() < cfg.min_start_distance:
                continue
            return targets, agent
        raise ConfigError(
            "ReachConfig.min_target_separation/min_start_distance: too large to place objects "
            f"after {_MAX_PLACEMENT_TRIES} tries"
        )

    def _distance(self) -> float:
        return float(np.linalg.norm(self._pos - self._targets[self._task_index]))

    def _observe(self) -> Observation:
        cfg = self.config
        images: dict[str, np.ndarray] = {}
        if cfg.cameras:
            discs = [
                (float(t[0]), float(t[1]), cfg.target_radius, rgb)
                for t, (_, rgb) in zip(self._targets, TARGETS)
            ]
            discs.append((float(self._pos[0]), float(self._pos[1]), cfg.agent_radius, AGENT_RGB))
            for cam in cfg.cameras:
                if cam == CAMERA_TOP:
                    images[cam] = self._camera.render((0.0, 0.0), 1.0, discs)
                else:
                    images[cam] = self._camera.render(self._pos, cfg.wrist_half_extent, discs)
        state = np.array([self._pos[0], self._pos[1], self._vel[0], self._vel[1]], np.float32)
        return Observation(images=images, state=state, instruction=self._spec.tasks[self._task_index].instruction)

    def _info(self, distance: float) -> dict[str, Any]:
        return {
            INFO_SUCCESS: distance <= self.config.success_radius,
            INFO_TASK: self._spec.tasks[self._task_index].name,
            INFO_TASK_INDEX: self._task_index,
            INFO_DISTANCE: distance,
            INFO_STEPS: self._steps,
        }


def make_reach(
    env_id: str = "builtin/reach-v0", image_size: int | tuple[int, int] | None = None, **kwargs: Any
) -> ReachEnv:
    """Registry factory: kwargs are ReachConfig fields; `image_size` sets height and width."""
    return ReachEnv(config_from_options(ReachConfig, env_id, kwargs, image_size), env_id=env_id)


def describe_reach(env_id: str, options: dict[str, Any]) -> EnvFacts:
    """Registry describer: what make_reach(env_id, **options) would render, without building it."""
    return facts_from_options(ReachConfig, env_id, options, lambda cfg: dict(
        cameras=tuple(CameraSpec(c, cfg.image_height, cfg.image_width) for c in cfg.cameras),
        state_dim=len(STATE_NAMES), action_dim=len(ACTION_NAMES)))
