"""maniskill/<Task>-v1: ManiSkill3 tabletop tasks behind the adapter interface, on CPU.

Setup once: `pip install mani-skill==3.0.1` and `bash deploy/setup/vulkan.sh` (SAPIEN needs a
Vulkan device even for state observations; the script unpacks Mesa 25's lavapipe into
<venv>/vulkan). Then:

    env = envs.make("maniskill/PickCube-v1")                               # state, no cameras
    env = envs.make("maniskill/PickCube-v1", obs_mode="rgb", image_size=224)  # camera "base_camera"
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(np.zeros(env.spec.action_dim))

Time a task: `python -m envs.maniskill PickCube-v1 --obs-mode rgb --image-size 224 --steps 200`.

Vulkan: unless VK_ICD_FILENAMES (or VK_DRIVER_FILES) is already set or the system has the
NVIDIA Vulkan driver (nvidia*.json in /usr/share/vulkan/icd.d, /etc/vulkan/icd.d, ...),
building an env points VK_ICD_FILENAMES at the first lvp_icd.json found in
$NEXUS_VULKAN_DIR, <sys.prefix>/vulkan, then <project>/.venv/vulkan (where
deploy/setup/vulkan.sh writes it).
Without a device, make() raises VulkanUnavailableError saying what to run.

Observation: `state` float32 = ManiSkill's observation dict flattened in its own key order
(state mode: everything, privileged object poses included, like obs_mode="state"; rgb mode:
the `agent` and `extra` parts: qpos, qvel, tcp pose, goal...); `spec.state_names` names each
entry. `images[camera]` uint8 (H, W, 3) per ManiSkill sensor camera (rgb mode only). Each task
has one language instruction (ManiSkill has none; ours below). Episodes terminate on
ManiSkill's success (unless `ignore_terminations`), truncate at max_episode_steps. One env per
simulator on CPU (num_envs > 1 needs CUDA); several adapters in one process take turns through
a process-wide lock.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
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
from envs.errors import ConfigError, EnvError, EnvStateError, UnknownEnvError
from envs.probe import probe_in_child
from protocol.errors import ErrorCode
from protocol.settings import SimulatorSettings

ENV_ID_PREFIX = "maniskill/"
PIP_SPEC = "mani-skill==3.0.1"
SETUP_SCRIPT = "deploy/setup/vulkan.sh"
ICD_FILE = "lvp_icd.json"
_SYSTEM_ICD_DIRS = ("/usr/share/vulkan/icd.d", "/usr/local/share/vulkan/icd.d", "/etc/vulkan/icd.d")
PROJECT_ROOT = Path(__file__).resolve().parents[1]

OBS_STATE = "state"
OBS_RGB = "rgb"
# Cameras and the full state (privileged object poses included): a policy that needs the cube's
# pose to the millimetre (a pick) need not find it in a 64x64 frame.
OBS_RGB_STATE = "rgb+state"
OBS_MODES = (OBS_STATE, OBS_RGB, OBS_RGB_STATE)
_CAMERA_MODES = (OBS_RGB, OBS_RGB_STATE)
# Our obs mode -> ManiSkill's: "state_dict" is "state" before flattening, so entries get names;
# "rgb+state_dict" renders and adds the task's privileged `extra` entries (obj_pose, ...).
_MS_OBS_MODE = {OBS_STATE: "state_dict", OBS_RGB: "rgb", OBS_RGB_STATE: "rgb+state_dict"}
# The parts of an rgb-mode observation that are proprioception / task state (not sensor data).
_RGB_STATE_KEYS = ("agent", "extra")

# Tasks whose assets ship inside the mani-skill wheel (no download), with our instruction.
INSTRUCTIONS: dict[str, str] = {
    "PickCube-v1": "pick up the red cube and move it to the goal position",
    "PushCube-v1": "push the blue cube onto the red and white target",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "PegInsertionSide-v1": "insert the peg into the hole in the box from the side",
}
KNOWN_ENV_IDS = tuple(ENV_ID_PREFIX + k for k in INSTRUCTIONS)
# What the listed tasks observe (ManiSkill 3.0.1, measured: docs/envs.md "Env ids"), so a
# spec is checked at submit without building a SAPIEN scene: rgb sensor cameras, and the
# flattened state's length per obs mode (the same for every control mode).
RGB_CAMERAS: dict[str, tuple[str, ...]] = {
    "PickCube-v1": ("base_camera",), "PushCube-v1": ("base_camera",), "StackCube-v1": ("base_camera",),
    "PegInsertionSide-v1": ("base_camera", "hand_camera"),
}
STATE_DIMS: dict[str, dict[str, int]] = {
    "PickCube-v1": {"state": 42, "rgb": 29}, "PushCube-v1": {"state": 35, "rgb": 25},
    "StackCube-v1": {"state": 48, "rgb": 25}, "PegInsertionSide-v1": {"state": 43, "rgb": 25},
}
for _dims in STATE_DIMS.values():  # rgb+state observes what state does (the same entries, same order)
    _dims[OBS_RGB_STATE] = _dims[OBS_STATE]

# Panda action names per control mode (7 arm joints + gripper); other robots get a0, a1, ...
_ACTION_NAMES: dict[str, tuple[str, ...]] = {
    "pd_ee_delta_pose": ("dx", "dy", "dz", "drx", "dry", "drz", "gripper"),
    "pd_ee_delta_pos": ("dx", "dy", "dz", "gripper"),
    "pd_joint_delta_pos": tuple(f"dq{i}" for i in range(1, 8)) + ("gripper",),
    "pd_joint_pos": tuple(f"q{i}" for i in range(1, 8)) + ("gripper",),
}

# SAPIEN scenes share one render device and PhysX; env worker sessions step from a thread
# pool, so every simulator call in this process goes through one lock.
_SIM_LOCK = threading.RLock()


class VulkanUnavailableError(EnvError, RuntimeError):
    """No Vulkan device could be created: run deploy/setup/vulkan.sh."""

    code = ErrorCode.FAILED_PRECONDITION


def vulkan_icd_candidates() -> list[Path]:
    dirs = [SimulatorSettings.from_env().vulkan_dir, Path(sys.prefix) / "vulkan", PROJECT_ROOT / ".venv" / "vulkan"]
    return [Path(d) / ICD_FILE for d in dirs if d]


def hardware_vulkan_icds() -> list[Path]:
    """ICD jsons of the NVIDIA Vulkan driver. Only NVIDIA's counts: Mesa installs its radeon and
    intel ICDs beside its (Mesa 22: rejected) lavapipe on machines with no such GPU."""
    return [p for d in _SYSTEM_ICD_DIRS for p in sorted(Path(d).glob("nvidia*.json"))]


def ensure_vulkan_env() -> str | None:
    """Point VK_ICD_FILENAMES at the project's lavapipe unless the caller chose a driver or the
    system has a hardware one (a GPU renders far faster); return what the loader will use."""
    for var in ("VK_ICD_FILENAMES", "VK_DRIVER_FILES"):
        if os.environ.get(var):
            return os.environ[var]
    if hardware_vulkan_icds():
        return None
    for icd in vulkan_icd_candidates():
        if icd.is_file():
            os.environ["VK_ICD_FILENAMES"] = str(icd)
            return str(icd)
    return None


_PROBE = (
    "from envs.maniskill import make_maniskill\n"
    "with make_maniskill('maniskill/PickCube-v1') as env:\n"
    "    env.reset(seed=0)\n"
)


def vulkan_problem(timeout_s: float = 120.0) -> str | None:
    """None if a ManiSkill env builds and resets here (tried in a child process, so a crashing
    Vulkan driver cannot take this one down); otherwise what went wrong."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])))
    return probe_in_child(_PROBE, "ManiSkill probe (PickCube-v1, state)", timeout_s=timeout_s, env=env,
                          cwd=PROJECT_ROOT)


@dataclass(frozen=True)
class ManiSkillConfig:
    obs_mode: str = OBS_STATE  # "state": nothing rendered (~2-5 ms/step); "rgb": cameras via lavapipe;
    # "rgb+state": cameras and the full state
    image_height: int = 128  # ManiSkill's own camera size; 224 for ViT-based VLAs (~1.2x slower)
    image_width: int = 128
    # End-effector deltas + gripper in [-1, 1]: the action space of most VLAs (OpenVLA, Octo, pi0
    # on LIBERO). pd_joint_delta_pos steps ~2x faster on CPU (no IK).
    control_mode: str = "pd_ee_delta_pose"
    max_episode_steps: int | None = None  # None: ManiSkill's (50 for the cube tasks, 100 peg)
    reward_mode: str = "normalized_dense"  # ManiSkill's default: dense, in [0, 1]
    instruction: str | None = None  # None: ours from INSTRUCTIONS (needed for unlisted tasks)
    seed: int = 0  # seeds resets that pass no seed
    # Keep only the state entries named by these prefixes ("extra": the task's entries; "agent.qpos"),
    # in the env's order. A tenant's state is at most the base layout's width (32 for the tiny
    # bases): PickCube's full state is 42 long, its `extra` part 24. None: every entry.
    state_keys: tuple[str, ...] | None = None
    # Success does not end the episode: it runs to max_episode_steps (truncated), and `info`
    # says success while the task is solved. How ManiSkill's own PPO baselines train
    # (ignore_terminations / --no_partial_reset): with a per-step dense reward and a discount, an
    # episode that ends at success forfeits the reward its near-success states keep earning, so
    # PPO learns to stop short of success (the PushCube runs in docs/results.md). For RL; an eval
    # keeps the default (an episode is a success once solved).
    ignore_terminations: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.ignore_terminations, bool):
            raise ConfigError(f"ManiSkillConfig.ignore_terminations: must be true or false, "
                              f"got {self.ignore_terminations!r}")
        if self.obs_mode not in OBS_MODES:
            raise ConfigError(f"ManiSkillConfig.obs_mode: must be one of {OBS_MODES}, got {self.obs_mode!r}")
        for name in ("image_height", "image_width"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ManiSkillConfig.{name}: must be a positive int, got {value!r}")
        m = self.max_episode_steps
        if m is not None and (not isinstance(m, (int, np.integer)) or isinstance(m, bool) or m <= 0):
            raise ConfigError(f"ManiSkillConfig.max_episode_steps: must be a positive int or None, got {m!r}")
        if self.instruction is not None and not (isinstance(self.instruction, str) and self.instruction.strip()):
            raise ConfigError("ManiSkillConfig.instruction: must be a non-empty string or None")
        keys = self.state_keys
        if keys is not None:
            if (isinstance(keys, str) or not isinstance(keys, (list, tuple)) or not keys
                    or not all(isinstance(k, str) and k.strip() for k in keys)):
                raise ConfigError(f"ManiSkillConfig.state_keys: must be a non-empty list of state entry prefixes "
                                  f"(e.g. [extra] or [agent.qpos, extra]) or None, got {keys!r}")
            object.__setattr__(self, "state_keys", tuple(keys))


class ManiSkillEnv(EnvAdapter):
    def __init__(self, config: ManiSkillConfig | None = None, env_id: str = "maniskill/PickCube-v1") -> None:
        self.config = cfg = config or ManiSkillConfig()
        self.ms_env_id = env_id.removeprefix(ENV_ID_PREFIX)
        instruction = cfg.instruction or INSTRUCTIONS.get(self.ms_env_id)
        if instruction is None:
            raise UnknownEnvError(
                f"no instruction for ManiSkill task {self.ms_env_id!r} ({env_id}); known: "
                f"{', '.join(KNOWN_ENV_IDS)}; pass instruction= for another ManiSkill task",
                details={"env_id": env_id, "known": list(KNOWN_ENV_IDS)},
            )
        self._env = _make_gym_env(env_id, self.ms_env_id, cfg)
        self._closed = False
        self._needs_reset = True
        self._steps = 0
        self._rng = np.random.default_rng(cfg.seed)
        try:
            base = self._env.unwrapped
            # One reset tells the observation layout (cameras, state entries) for the spec.
            with _SIM_LOCK:
                first_obs, _ = self._env.reset(seed=cfg.seed)
            state_names = tuple(name for name, _ in self._state_leaves(first_obs))
            if not state_names:
                every = ", ".join(sorted({n.split("[")[0] for n, _ in self._state_leaves(first_obs, every=True)}))
                raise ConfigError(f"ManiSkillConfig.state_keys: {list(cfg.state_keys or ())} name no state entry "
                                  f"of {self.ms_env_id} ({cfg.obs_mode}); its entries: {every}")
            cameras = tuple(
                CameraSpec(name, int(d["rgb"].shape[1]), int(d["rgb"].shape[2]))
                for name, d in first_obs.get("sensor_data", {}).items()
                if cfg.obs_mode in _CAMERA_MODES
            )
            space = base.single_action_space
            low, high = (tuple(float(x) for x in np.asarray(b, np.float32)) for b in (space.low, space.high))
            action_names = _ACTION_NAMES.get(cfg.control_mode, ())
            if len(action_names) != len(low):
                action_names = tuple(f"a{i}" for i in range(len(low)))
            # Every ManiSkill task registers a step limit (50 for the cube tasks); read it back.
            max_steps = cfg.max_episode_steps or getattr(self._env, "_max_episode_steps", None)
            if not max_steps:
                raise ConfigError(f"ManiSkillConfig.max_episode_steps: {self.ms_env_id} has no limit; give one")
            self._spec = EnvSpec(
                env_id=env_id,
                cameras=cameras,
                state_dim=len(state_names),
                action_dim=len(low),
                action_low=low,
                action_high=high,
                tasks=(TaskSpec(self.ms_env_id, instruction),),
                max_episode_steps=int(max_steps),
                fps=int(base.control_freq),
                state_names=state_names,
                action_names=action_names,
            )
        except BaseException:
            self.close()
            raise

    # -- adapter API ---------------------------------------------------------------------
    @property
    def spec(self) -> EnvSpec:
        return self._spec

    def reset(self, seed: int | None = None, task: str | int | None = None) -> tuple[Observation, dict[str, Any]]:
        self._check_open()
        if task is not None:
            self._spec.task_index(task)  # one task per ManiSkill env; anything else is unknown
        episode_seed = int(self._rng.integers(2**31)) if seed is None else int(seed)
        with _SIM_LOCK:
            obs, info = self._env.reset(seed=episode_seed)
        self._steps = 0
        self._needs_reset = False
        return self._observe(obs), self._info(info)

    def step(self, action: Any) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        self._check_open()
        if self._needs_reset:
            raise EnvStateError(f"{self._spec.env_id}: call reset() before step() (also after an episode ends)")
        a = check_action(self._spec, action)
        with _SIM_LOCK:
            obs, reward, terminated, truncated, info = self._env.step(a)
        self._steps += 1
        terminated = _scalar(terminated, bool) and not self.config.ignore_terminations
        truncated = _scalar(truncated, bool) or (not terminated and self._steps >= self._spec.max_episode_steps)
        self._needs_reset = terminated or truncated
        return self._observe(obs), _scalar(reward, float), terminated, truncated, self._info(info)

    def close(self) -> None:
        if not getattr(self, "_closed", True):
            self._closed = True
            with _SIM_LOCK:
                self._env.close()

    # -- for scripted experts and tests: ManiSkill's own env (privileged state) ------------
    @property
    def unwrapped(self) -> Any:
        self._check_open()
        return self._env.unwrapped

    # -- internals -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EnvStateError(f"{self._spec.env_id}: env is closed")

    def _state_leaves(self, obs: dict[str, Any], every: bool = False) -> Iterator[tuple[str, np.ndarray]]:
        parts = obs if self.config.obs_mode == OBS_STATE else {k: obs[k] for k in _RGB_STATE_KEYS if k in obs}
        keys = None if every else self.config.state_keys
        for name, value in _leaves(parts):
            if keys is not None and not any(name == k or name.startswith(k + ".") for k in keys):
                continue
            flat = _to_numpy(value)[0].reshape(-1).astype(np.float32)  # [0]: drop the batch dim
            if flat.size == 1:
                yield name, flat
            else:
                for i in range(flat.size):
                    yield f"{name}[{i}]", flat[i : i + 1]

    def _observe(self, obs: dict[str, Any]) -> Observation:
        state = np.concatenate([v for _, v in self._state_leaves(obs)]).astype(np.float32)
        images = {cam.name: np.ascontiguousarray(_to_numpy(obs["sensor_data"][cam.name]["rgb"])[0])
                  for cam in self._spec.cameras} if self._spec.cameras else {}
        return Observation(images=images, state=state, instruction=self._spec.tasks[0].instruction)

    def _info(self, info: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in info.items():  # ManiSkill's scalars: is_grasped, elapsed_steps, ...
            arr = _to_numpy(value)
            if arr.size == 1:
                out[str(key)] = arr.reshape(-1)[0].item()
        out[INFO_SUCCESS] = bool(out.get(INFO_SUCCESS, False))
        out[INFO_TASK] = self._spec.tasks[0].name
        out[INFO_TASK_INDEX] = 0
        return out


def _make_gym_env(env_id: str, ms_env_id: str, cfg: ManiSkillConfig) -> Any:
    icd = ensure_vulkan_env()  # before SAPIEN creates its Vulkan instance
    try:
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401 - registers the ManiSkill env ids with gymnasium
        from mani_skill.utils.registration import REGISTERED_ENVS
    except ImportError as e:
        raise EnvError(f"{env_id}: ManiSkill is not installed ({e}); pip install {PIP_SPEC}") from e
    if ms_env_id not in REGISTERED_ENVS:
        raise UnknownEnvError(
            f"unknown ManiSkill task {ms_env_id!r} ({env_id}); registered here: {', '.join(KNOWN_ENV_IDS)}",
            details={"env_id": env_id, "known": list(KNOWN_ENV_IDS)},
        )
    kwargs: dict[str, Any] = dict(
        obs_mode=_MS_OBS_MODE[cfg.obs_mode],
        control_mode=cfg.control_mode,
        reward_mode=cfg.reward_mode,
        sim_backend="cpu",  # num_envs > 1 (GPU sim) needs CUDA; one env per simulator here
        # A software device (lavapipe) unless NVIDIA's Vulkan driver is installed; ManiSkill's
        # own default then picks the CUDA GPU (and falls back to the CPU device, with a warning).
        render_backend="gpu" if hardware_vulkan_icds() else "cpu",
        num_envs=1,
    )
    if cfg.obs_mode in _CAMERA_MODES:
        kwargs["sensor_configs"] = dict(width=int(cfg.image_width), height=int(cfg.image_height))
    if cfg.max_episode_steps is not None:
        kwargs["max_episode_steps"] = int(cfg.max_episode_steps)
    try:
        with _SIM_LOCK:
            return gym.make(ms_env_id, **kwargs)
    except AssertionError as e:  # ManiSkill checks control_mode / reward_mode with assert
        raise ConfigError(f"ManiSkillConfig: {e}") from e
    except RuntimeError as e:
        if "vk::" not in str(e) and "vulkan" not in str(e).lower():
            raise
        raise VulkanUnavailableError(
            f"{env_id}: no Vulkan device ({e}); VK_ICD_FILENAMES={icd or 'unset'}. ManiSkill needs one even "
            f"for state observations: run `bash {SETUP_SCRIPT}` (Mesa 25 lavapipe into <venv>/vulkan)",
            details={"icd": icd or ""},
        ) from e


def _leaves(d: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _leaves(value, name + ".")
        else:
            yield name, value


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # torch.Tensor (imported lazily by ManiSkill only)
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _scalar(value: Any, kind: type) -> Any:
    return kind(_to_numpy(value).reshape(-1)[0])


def make_maniskill(
    env_id: str = "maniskill/PickCube-v1", image_size: int | tuple[int, int] | None = None, **kwargs: Any
) -> ManiSkillEnv:
    """Registry factory: kwargs are ManiSkillConfig fields; `image_size` sets height and width."""
    return ManiSkillEnv(config_from_options(ManiSkillConfig, env_id, kwargs, image_size), env_id=env_id)


def describe_maniskill(env_id: str, options: dict[str, Any]) -> EnvFacts:
    """Registry describer: what make_maniskill(env_id, **options) would observe, without
    importing mani_skill (the listed tasks' facts above; another task's: None, known once built)."""
    task = env_id.removeprefix(ENV_ID_PREFIX)

    def facts(cfg: ManiSkillConfig) -> dict[str, Any]:
        names = (RGB_CAMERAS.get(task) if cfg.obs_mode in _CAMERA_MODES else ())
        cameras = None if names is None else tuple(CameraSpec(c, cfg.image_height, cfg.image_width) for c in names)
        actions = _ACTION_NAMES.get(cfg.control_mode)
        # With state_keys the length is known once built (the env worker checks it at start).
        state_dim = None if cfg.state_keys is not None else STATE_DIMS.get(task, {}).get(cfg.obs_mode)
        return dict(cameras=cameras, state_dim=state_dim,
                    action_dim=None if actions is None else len(actions))

    return facts_from_options(ManiSkillConfig, env_id, options, facts)


class PickCubeExpert:
    """Scripted expert for maniskill/PickCube-v1 in pd_ee_delta_pose (reads privileged state).

    Stateless, one rule per call: not grasped -> line up above the cube (position and yaw, modulo
    90 degrees), descend, close the gripper; grasped -> carry the cube to the goal. 100% success
    over 100 seeds, ~21 steps (docs/envs.md). ManiSkill's own motion-planning solutions need
    pd_joint_pos and run whole episodes inside one call, so they do not fit `expert(env)`.
    """

    HOVER_M = 0.05  # above the cube before descending: the fingers clear it
    ALIGN_M = 0.01  # xy error under which the gripper descends
    ALIGN_RAD = 0.05  # yaw error under which it descends
    CLOSE_M = 0.01  # height error under which the gripper closes

    def __call__(self, env: ManiSkillEnv) -> np.ndarray:
        if env.ms_env_id != "PickCube-v1" or env.config.control_mode != "pd_ee_delta_pose":
            raise ConfigError(f"PickCubeExpert: needs PickCube-v1 with control_mode 'pd_ee_delta_pose', got "
                              f"{env.ms_env_id} with {env.config.control_mode!r}")
        b = env.unwrapped
        tcp_p, tcp_q = _to_numpy(b.agent.tcp.pose.p)[0].astype(np.float64), _to_numpy(b.agent.tcp.pose.q)[0]
        cube_p, cube_q = _to_numpy(b.cube.pose.p)[0].astype(np.float64), _to_numpy(b.cube.pose.q)[0]
        goal_p = _to_numpy(b.goal_site.pose.p)[0].astype(np.float64)
        # A cube looks the same every 90 degrees about z; rotation actions turn the downward-
        # facing tcp about its own z, hence the minus sign (checked: +1 never succeeds).
        yaw_err = _wrap(_yaw(cube_q) - _yaw(tcp_q), np.pi / 2)
        action = np.zeros(7, np.float32)
        action[6] = 1.0  # gripper open
        if bool(_to_numpy(b.agent.is_grasping(b.cube)).reshape(-1)[0]):
            target, action[6] = goal_p, -1.0
        else:
            action[5] = np.clip(-yaw_err / 0.1, -1, 1)  # 0.1 rad per step at |action| = 1
            aligned = np.linalg.norm(cube_p[:2] - tcp_p[:2]) <= self.ALIGN_M and abs(yaw_err) <= self.ALIGN_RAD
            target = cube_p if aligned else cube_p + np.array([0.0, 0.0, self.HOVER_M])
            if aligned and abs(tcp_p[2] - cube_p[2]) < self.CLOSE_M:
                action[6] = -1.0
        action[:3] = np.clip((target - tcp_p) / 0.1, -1, 1)  # 0.1 m per step at |action| = 1
        return action


class PushCubeExpert:
    """Scripted expert for maniskill/PushCube-v1 in pd_ee_delta_pose (reads privileged state).

    Stateless, one rule per call, gripper closed (the fingers make one flat pusher): behind the
    cube (on the far side from the goal, low, centred on it) -> push it along the cube-to-goal
    line until its centre is on the goal's; otherwise go behind it, high while still off to the
    side (the fingertips clear the cube) and down once there. The goal lies +x of the cube
    (ManiSkill's reset) and the cube does not turn when pushed through its centre.
    """

    HOVER_Z = 0.08  # tcp height while moving to the push point (cube top: 0.04)
    PUSH_Z = 0.02  # tcp height when pushing (the cube's centre)
    GAP_M = 0.025  # tcp behind the cube's near face at the push point
    LINE_M = 0.012  # |lateral| error under which the tcp counts as on the push line
    XY_M = 0.01  # xy error to the push point under which the tcp descends

    def __call__(self, env: ManiSkillEnv) -> np.ndarray:
        if env.ms_env_id != "PushCube-v1" or env.config.control_mode != "pd_ee_delta_pose":
            raise ConfigError(f"PushCubeExpert: needs PushCube-v1 with control_mode 'pd_ee_delta_pose', got "
                              f"{env.ms_env_id} with {env.config.control_mode!r}")
        b = env.unwrapped
        tcp = _to_numpy(b.agent.tcp.pose.p)[0].astype(np.float64)
        cube = _to_numpy(b.obj.pose.p)[0].astype(np.float64)
        goal = _to_numpy(b.goal_region.pose.p)[0].astype(np.float64)
        half = float(b.cube_half_size)
        to_goal = goal[:2] - cube[:2]
        u = to_goal / max(float(np.linalg.norm(to_goal)), 1e-6)  # push direction
        rel = tcp[:2] - cube[:2]
        along, lateral = float(rel @ u), float(rel @ np.array([-u[1], u[0]]))
        behind = -(half + 2 * self.GAP_M) <= along <= -half and abs(lateral) <= self.LINE_M
        if behind and tcp[2] <= self.PUSH_Z + 0.015:
            # Carry the contact point so the cube's centre ends on the goal's, straight along u.
            target_xy = goal[:2] + along * u
            target = np.array([*target_xy, self.PUSH_Z])
        else:
            push_xy = cube[:2] - (half + self.GAP_M) * u
            over = float(np.linalg.norm(tcp[:2] - push_xy)) > self.XY_M
            target = np.array([*push_xy, self.HOVER_Z if over else self.PUSH_Z])
        action = np.zeros(7, np.float32)
        action[:3] = np.clip((target - tcp) / 0.1, -1, 1)  # 0.1 m per step at |action| = 1
        action[6] = -1.0  # closed
        return action


def _yaw(q_wxyz: np.ndarray) -> float:
    w, x, y, z = (float(v) for v in q_wxyz)
    return float(np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z)))


def _wrap(angle: float, period: float) -> float:
    return (angle + period / 2) % period - period / 2


def main(argv: list[str] | None = None) -> int:
    """Time one task with seeded uniform-random (or expert) actions: construction, reset, ms/step."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m envs.maniskill", description=main.__doc__)
    p.add_argument("task", nargs="?", default="PickCube-v1", help="ManiSkill id, e.g. PickCube-v1")
    p.add_argument("--obs-mode", choices=OBS_MODES, default=OBS_STATE)
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--control-mode", default=ManiSkillConfig.control_mode)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--expert", action="store_true", help="the task's scripted expert's actions instead of random ones")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    env = make_maniskill(ENV_ID_PREFIX + args.task.removeprefix(ENV_ID_PREFIX), obs_mode=args.obs_mode,
                         image_size=args.image_size, control_mode=args.control_mode)
    t_make = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    from envs.registry import make_expert

    expert = make_expert(env.spec.env_id) if args.expert else None
    spec = env.spec
    with env:
        t0 = time.perf_counter()
        obs, _ = env.reset(seed=0)
        t_reset = time.perf_counter() - t0
        step_s, successes, episodes = 0.0, 0, 1
        for _ in range(args.steps):
            action = expert(env) if expert else rng.uniform(spec.action_low, spec.action_high).astype(np.float32)
            t0 = time.perf_counter()
            obs, _, terminated, truncated, info = env.step(action)
            step_s += time.perf_counter() - t0
            successes += info[INFO_SUCCESS]
            if terminated or truncated:
                env.reset(seed=episodes)
                episodes += 1
    cams = ", ".join(f"{c.name} {c.height}x{c.width}" for c in spec.cameras) or "none"
    print(f"{spec.env_id} obs_mode={args.obs_mode} control_mode={args.control_mode} cameras: {cams}; "
          f"state_dim={spec.state_dim} action_dim={spec.action_dim} fps={spec.fps}")
    print(f"make {t_make:.2f} s, reset {t_reset * 1e3:.1f} ms, step {step_s / args.steps * 1e3:.2f} ms/step "
          f"(mean of {args.steps}, {'expert' if expert else 'random'} actions); "
          f"{successes} successes in {episodes} episodes (the last maybe unfinished)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
