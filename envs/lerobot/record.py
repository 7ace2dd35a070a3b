"""Record scripted-expert demonstrations from a registered env as a LeRobot v3.0 dataset.

    from envs.lerobot.record import RecordConfig, record
    result = record(RecordConfig(out="/data/reach_demos", episodes=50, seed=0))
    result.episodes, result.frames, result.attempts

Episode attempt i resets with seed `seed + i` (task drawn from that seed). Each recorded
frame is (observation before the step, action taken); the episode's task string is its
language instruction. With `only_success` (default) failed attempts are dropped and
more attempts are made, up to `max_attempts`.

Feature keys: observation.images.<camera> (video or PNG image), observation.state, action.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envs.adapter import INFO_SUCCESS, EnvAdapter
from envs.errors import ConfigError, DatasetError
from envs.lerobot import constants as C
from envs.lerobot.video import DEFAULT_VCODEC
from envs.lerobot.writer import LeRobotWriter, WriterConfig
from envs.registry import make, make_expert


@dataclass(frozen=True)
class RecordConfig:
    out: Path
    episodes: int
    env_id: str = "builtin/reach-v0"
    seed: int = 0
    use_videos: bool = True  # False: cameras stored as PNG images in the data parquet
    vcodec: str = DEFAULT_VCODEC
    only_success: bool = True
    # DART-style noise: the env executes expert action + N(0, action_noise), the dataset
    # records the expert's clean action. Demos then cover the states a slightly-off policy
    # visits, with the right correction as label (behaviour cloning's covariate shift).
    action_noise: float = 0.0
    max_attempts: int | None = None  # default: 2 x episodes + 10
    overwrite: bool = False
    env_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        if not isinstance(self.episodes, int) or self.episodes <= 0:
            raise ConfigError(f"RecordConfig.episodes: must be a positive int, got {self.episodes!r}")
        if self.max_attempts is not None and self.max_attempts < self.episodes:
            raise ConfigError("RecordConfig.max_attempts: must be >= episodes")


@dataclass(frozen=True)
class RecordProgress:
    attempts: int
    episodes: int  # recorded so far
    target: int
    frames: int
    last_success: bool


@dataclass(frozen=True)
class RecordResult:
    root: Path
    episodes: int
    frames: int
    attempts: int
    successes: int


def camera_key(camera: str) -> str:
    return f"{C.OBS_IMAGES_PREFIX}{camera}"


def features_for(env: EnvAdapter, use_videos: bool) -> dict[str, dict[str, Any]]:
    spec = env.spec
    dtype = C.DTYPE_VIDEO if use_videos else C.DTYPE_IMAGE
    feats: dict[str, dict[str, Any]] = {
        camera_key(c.name): {"dtype": dtype, "shape": list(c.shape_HWC), "names": list(C.IMAGE_AXIS_NAMES)}
        for c in spec.cameras
    }
    feats[C.OBS_STATE] = {"dtype": "float32", "shape": [spec.state_dim], "names": list(spec.state_names) or None}
    feats[C.ACTION] = {"dtype": "float32", "shape": [spec.action_dim], "names": list(spec.action_names) or None}
    return feats


def run_expert_episode(env: EnvAdapter, expert: Callable[[EnvAdapter], np.ndarray], seed: int,
                       action_noise: float = 0.0) -> tuple[str, dict[str, np.ndarray], bool]:
    obs, info = env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    instruction = obs.instruction
    images: dict[str, list[np.ndarray]] = {c: [] for c in env.spec.camera_names}
    states, actions = [], []
    done = False
    while not done:
        action = np.asarray(expert(env), np.float32)
        for c in images:
            images[c].append(obs.images[c])
        states.append(obs.state)
        actions.append(action)
        executed = action
        if action_noise > 0:
            low, high = np.asarray(env.spec.action_low), np.asarray(env.spec.action_high)
            executed = np.clip(action + rng.normal(0.0, action_noise, action.shape), low, high).astype(np.float32)
        obs, _, terminated, truncated, info = env.step(executed)
        done = terminated or truncated
    data = {camera_key(c): np.stack(v) for c, v in images.items()}
    data[C.OBS_STATE] = np.stack(states)
    data[C.ACTION] = np.stack(actions)
    return instruction, data, bool(info[INFO_SUCCESS])


def record(config: RecordConfig, progress: Callable[[RecordProgress], None] | None = None) -> RecordResult:
    env = make(config.env_id, **config.env_kwargs)
    expert = make_expert(config.env_id)
    max_attempts = config.max_attempts or 2 * config.episodes + 10
    writer = LeRobotWriter(WriterConfig(
        root=config.out, fps=env.spec.fps, features=features_for(env, config.use_videos),
        robot_type=config.env_id.replace("/", "_"), vcodec=config.vcodec, overwrite=config.overwrite,
    ))
    attempts = successes = frames = 0
    try:
        while writer.num_episodes < config.episodes:
            if attempts >= max_attempts:
                raise DatasetError(
                    f"record: only {writer.num_episodes} of {config.episodes} episodes succeeded "
                    f"in {attempts} attempts with {config.env_id}'s expert"
                )
            task, data, success = run_expert_episode(env, expert, config.seed + attempts, config.action_noise)
            attempts += 1
            successes += success
            if success or not config.only_success:
                writer.add_episode(task, data)
                frames += len(data[C.ACTION])
            if progress is not None:
                progress(RecordProgress(attempts, writer.num_episodes, config.episodes, frames, success))
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    finally:
        env.close()
    return RecordResult(config.out, writer.num_episodes, frames, attempts, successes)
