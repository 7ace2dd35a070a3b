"""maniskill/<Task>-v1 (ManiSkill3 on CPU through lavapipe): spec, state and rgb episodes,
determinism, errors, the PickCube expert, and one session through an env worker over NATS.

    .venv/bin/python -m pytest tests/envs/test_maniskill.py -q

Skipped, with the reason, when mani_skill is not installed or no Vulkan device can be had
(probed in a child process, so a crashing driver cannot take pytest down; `bash
deploy/setup/vulkan.sh` provides one). NEXUS_REQUIRE_MANISKILL=1 turns those skips into failures
(CI). Building an env costs ~0.5 s in state mode and ~10 s in rgb mode (lavapipe compiles its
shaders), so the tests share one env of each.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

import envs  # noqa: E402
from envs.errors import ActionError, ConfigError, EnvStateError, UnknownEnvError, UnknownTaskError  # noqa: E402


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("NEXUS_REQUIRE_MANISKILL") == "1":
        pytest.fail(f"NEXUS_REQUIRE_MANISKILL=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


if importlib.util.find_spec("mani_skill") is None:
    _skip_or_fail("mani_skill is not installed (pip install mani-skill==3.0.1; see docs/envs.md)")

from envs.maniskill import INSTRUCTIONS, KNOWN_ENV_IDS, make_maniskill, vulkan_problem  # noqa: E402

_problem = vulkan_problem()
if _problem is not None:
    _skip_or_fail(f"no usable Vulkan device for ManiSkill (run `bash deploy/setup/vulkan.sh`): {_problem}")

# ManiSkill 3.0.1 calls np.isnan on a torch tensor at every step (its own, harmless).
pytestmark = pytest.mark.filterwarnings("ignore:__array_wrap__ must accept context:DeprecationWarning")

PICK = "maniskill/PickCube-v1"
PICK_STATE_DIM = 42  # qpos 9, qvel 9, is_grasped 1, tcp pose 7, goal 3, cube pose 7, two offsets 3+3
PICK_RGB_STATE_DIM = 29  # the same without the cube pose and the offsets (privileged in rgb mode)


@pytest.fixture(scope="module")
def state_env():
    env = envs.make(PICK)
    yield env
    env.close()


@pytest.fixture(scope="module")
def rgb_env():
    env = envs.make(PICK, obs_mode="rgb", image_size=(48, 64))  # H != W: catches a transposed image
    yield env
    env.close()


def test_registered_ids_and_unknown_ones():
    assert set(KNOWN_ENV_IDS) <= set(envs.known_env_ids())
    with pytest.raises(UnknownEnvError, match=r"unknown env id 'maniskill/Nope-v1'.*maniskill/PickCube-v1"):
        envs.make("maniskill/Nope-v1")
    with pytest.raises(UnknownEnvError, match=r"no instruction for ManiSkill task 'PullCube-v1'.*instruction="):
        make_maniskill("maniskill/PullCube-v1")
    with pytest.raises(UnknownEnvError, match=r"unknown ManiSkill task 'Nope-v9'.*maniskill/PushCube-v1"):
        make_maniskill("maniskill/Nope-v9", instruction="do nothing")
    with pytest.raises(UnknownEnvError, match="no scripted expert"):
        envs.make_expert("maniskill/StackCube-v1")


def test_bad_options_name_the_field():
    with pytest.raises(ConfigError, match=r"ManiSkillConfig.obs_mode.*'depth'"):
        envs.make(PICK, obs_mode="depth")
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['cameras'\]"):
        envs.make(PICK, cameras=("top",))
    with pytest.raises(ConfigError, match=r"ManiSkillConfig.image_height"):
        envs.make(PICK, image_size=0)
    with pytest.raises(ConfigError, match=r"bogus not in supported modes.*pd_ee_delta_pose"):
        envs.make(PICK, control_mode="bogus")


def test_state_spec(state_env):
    spec = state_env.spec
    assert spec.env_id == PICK and spec.cameras == ()
    assert spec.state_dim == PICK_STATE_DIM == len(spec.state_names)
    assert spec.state_names[0] == "agent.qpos[0]" and "extra.obj_pose[0]" in spec.state_names
    assert spec.action_dim == 7 and spec.action_low == (-1.0,) * 7 and spec.action_high == (1.0,) * 7
    assert spec.action_names == ("dx", "dy", "dz", "drx", "dry", "drz", "gripper")
    assert spec.fps == 20 and spec.max_episode_steps == 50
    assert [t.instruction for t in spec.tasks] == [INSTRUCTIONS["PickCube-v1"]]


def test_state_reset_step_shapes_dtypes_and_info(state_env):
    obs, info = state_env.reset(seed=0)
    assert obs.images == {} and obs.state.dtype == np.float32 and obs.state.shape == (PICK_STATE_DIM,)
    assert obs.instruction == INSTRUCTIONS["PickCube-v1"]
    assert info["success"] is False and info["task"] == "PickCube-v1" and info["task_index"] == 0
    obs, reward, terminated, truncated, info = state_env.step(np.zeros(7, np.float32))
    assert obs.state.shape == (PICK_STATE_DIM,) and np.all(np.isfinite(obs.state))
    assert type(reward) is float and type(terminated) is bool and type(truncated) is bool
    assert type(info["success"]) is bool and info["elapsed_steps"] == 1


def test_reset_with_a_seed_is_deterministic(state_env):
    actions = np.random.default_rng(0).uniform(-1, 1, (5, 7)).astype(np.float32)

    def rollout(seed: int) -> np.ndarray:
        states = [state_env.reset(seed=seed)[0].state]
        states += [state_env.step(a)[0].state for a in actions]
        return np.stack(states)

    a, b, c = rollout(7), rollout(7), rollout(8)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a[0], c[0])  # another seed, another cube and goal


def test_bad_actions_and_unknown_tasks(state_env):
    state_env.reset(seed=1)
    with pytest.raises(ActionError, match=r"maniskill/PickCube-v1 must have shape \(7,\), got \(3,\)"):
        state_env.step(np.zeros(3))
    with pytest.raises(ActionError, match="non-finite"):
        state_env.step(np.full(7, np.nan))
    state_env.step(np.zeros(7))  # the bad calls left the episode usable
    with pytest.raises(UnknownTaskError, match=r"unknown task 'stack'.*0='PickCube-v1'"):
        state_env.reset(task="stack")
    with pytest.raises(UnknownTaskError):
        state_env.reset(task=1)
    for task in (0, "PickCube-v1", INSTRUCTIONS["PickCube-v1"]):
        assert state_env.reset(seed=1, task=task)[1]["task_index"] == 0


def test_truncation_and_state_errors():
    env = envs.make(PICK, max_episode_steps=3)
    with pytest.raises(EnvStateError, match="reset"):
        env.step(np.zeros(7))
    env.reset(seed=0)
    dones = [env.step(np.zeros(7))[3] for _ in range(3)]
    assert dones == [False, False, True] and env.spec.max_episode_steps == 3
    with pytest.raises(EnvStateError, match="reset"):
        env.step(np.zeros(7))
    env.close()
    with pytest.raises(EnvStateError, match="closed"):
        env.reset()


def test_pick_cube_expert_succeeds(state_env):
    expert = envs.make_expert(PICK)
    for seed in (0, 1, 2):
        state_env.reset(seed=seed)
        for _ in range(state_env.spec.max_episode_steps):
            _, _, terminated, truncated, info = state_env.step(expert(state_env))
            if terminated or truncated:
                break
        assert terminated and info["success"] is True, f"seed {seed}"


def test_push_cube_expert_succeeds_on_most_seeds():
    env = envs.make("maniskill/PushCube-v1")
    expert = envs.make_expert("maniskill/PushCube-v1")
    wins = 0
    try:
        for seed in range(10):
            env.reset(seed=seed)
            for _ in range(env.spec.max_episode_steps):
                _, _, terminated, truncated, info = env.step(expert(env))
                if terminated or truncated:
                    break
            wins += info["success"]
    finally:
        env.close()
    assert wins >= 9, wins


def test_state_keys_keep_the_named_entries(state_env):
    env = envs.make(PICK, state_keys=["extra"])
    try:
        names = env.spec.state_names
        assert env.spec.state_dim == len(names) == 24 and all(n.startswith("extra.") for n in names)
        full = state_env.reset(seed=2)[0].state
        idx = [state_env.spec.state_names.index(n) for n in names]
        # Not is_grasped: after an episode that ended holding the cube (the expert test's),
        # ManiSkill's first observation still says grasped (the contact forces of the last step
        # before the reset; they change only with the next step).
        keep = [i for i, n in enumerate(names) if n != "extra.is_grasped"]
        np.testing.assert_array_equal(env.reset(seed=2)[0].state[keep], full[idx][keep])
    finally:
        env.close()
    with pytest.raises(ConfigError, match=r"ManiSkillConfig.state_keys: \['nope'\] name no state entry"):
        envs.make(PICK, state_keys=["nope"])
    with pytest.raises(ConfigError, match=r"ManiSkillConfig.state_keys: must be a non-empty list"):
        envs.make(PICK, state_keys="extra")


def test_rgb_spec_images_and_determinism(rgb_env):
    spec = rgb_env.spec
    assert [(c.name, c.height, c.width) for c in spec.cameras] == [("base_camera", 48, 64)]
    assert spec.state_dim == PICK_RGB_STATE_DIM and "extra.obj_pose[0]" not in spec.state_names
    obs, info = rgb_env.reset(seed=3)
    image = obs.images["base_camera"]
    assert image.dtype == np.uint8 and image.shape == (48, 64, 3) and image.std() > 5
    assert obs.state.dtype == np.float32 and obs.state.shape == (PICK_RGB_STATE_DIM,)
    obs2, _, _, _, info = rgb_env.step(np.zeros(7))
    assert obs2.images["base_camera"].shape == (48, 64, 3) and type(info["success"]) is bool
    again, _ = rgb_env.reset(seed=3)
    np.testing.assert_array_equal(again.images["base_camera"], image)
    other, _ = rgb_env.reset(seed=4)
    assert not np.array_equal(other.images["base_camera"], image)


def test_rgb_state_has_the_cameras_and_the_full_state(state_env):
    from envs.maniskill import describe_maniskill

    env = envs.make(PICK, obs_mode="rgb+state", image_size=32)
    try:
        assert [(c.name, c.height, c.width) for c in env.spec.cameras] == [("base_camera", 32, 32)]
        assert env.spec.state_names == state_env.spec.state_names  # the state mode's entries, same order
        obs, _ = env.reset(seed=5)
        assert obs.images["base_camera"].shape == (32, 32, 3) and obs.images["base_camera"].std() > 5
        keep = [i for i, n in enumerate(env.spec.state_names) if n != "extra.is_grasped"]  # see test_state_keys_...
        np.testing.assert_array_equal(obs.state[keep], state_env.reset(seed=5)[0].state[keep])
    finally:
        env.close()
    facts = describe_maniskill(PICK, {"obs_mode": "rgb+state", "image_size": 32})
    assert facts.state_dim == PICK_STATE_DIM and [c.name for c in facts.cameras] == ["base_camera"]


def test_session_through_env_worker(roles):
    from protocol.errors import InvalidField, NotFound
    from sdk.client import AsyncClient

    roles.start("env")

    async def go():
        c = await AsyncClient(roles.nats_url, roles.prefix, timeout_s=60).connect()
        try:
            s = await c.env_create(PICK, obs_mode="state")
            assert s.spec["action_dim"] == 7 and s.spec["cameras"] == [] and s.spec["state_dim"] == PICK_STATE_DIM
            first = await c.env_reset(s, seed=3)
            assert first.state.shape == (PICK_STATE_DIM,) and first.state.dtype == np.float32
            assert first.instruction == INSTRUCTIONS["PickCube-v1"] and first.images == {}
            step = await c.env_step(s, np.array([0.5, 0, 0, 0, 0, 0, 1], np.float32))
            assert step.info["success"] is False and step.info["task"] == "PickCube-v1" and not step.terminated
            with pytest.raises(InvalidField, match=r"shape \(7,\)"):
                await c.env_step(s, np.zeros(2, np.float32))
            with pytest.raises(NotFound, match="task"):
                await c.env_reset(s, task="stack")
            again = await c.env_reset(s, seed=3)
            await c.env_close(s)
            return first, again
        finally:
            await c.close()

    first, again = asyncio.run(go())
    np.testing.assert_array_equal(first.state, again.state)


def test_ignore_terminations_runs_a_solved_episode_to_its_step_limit():
    """RL's option (ManiSkill's own PPO trains so): success is reported but ends nothing; the
    episode is truncated at its limit. A non-bool value is refused naming the option."""
    push = "maniskill/PushCube-v1"
    with pytest.raises(ConfigError, match=r"ManiSkillConfig.ignore_terminations: must be true or false"):
        envs.make(push, ignore_terminations="../auth")
    env = envs.make(push, ignore_terminations=True, max_episode_steps=40)
    expert = envs.make_expert(push)
    try:
        env.reset(seed=0)
        ends, solved = [], []
        for _ in range(40):
            _, _, terminated, truncated, info = env.step(expert(env))
            ends.append((terminated, truncated))
            solved.append(info["success"])
        assert any(solved), "the expert solves seed 0 within 40 steps"
        assert ends[:-1] == [(False, False)] * 39 and ends[-1] == (False, True), ends
    finally:
        env.close()
