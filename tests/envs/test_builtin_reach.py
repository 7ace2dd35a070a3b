"""builtin/reach-v0: spec, determinism, errors, and the policy success rates docs/envs.md reports."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
import pytest

import envs
from envs.builtin.reach import ReachConfig
from envs.errors import ActionError, ConfigError, EnvStateError, UnknownEnvError, UnknownTaskError
from envs.gym_wrapper import GymEnv
from envs.rollout import constant_policy, evaluate, expert_policy, random_policy, zero_policy

ENV_ID = "builtin/reach-v0"
EVAL_EPISODES = 300
EVAL_SEED = 10_000  # held apart from seeds used to record demonstrations


def test_spec_describes_cameras_state_actions_tasks():
    env = envs.make(ENV_ID)
    spec = env.spec
    assert spec.env_id == ENV_ID
    assert [(c.name, c.height, c.width) for c in spec.cameras] == [("top", 64, 64), ("wrist", 64, 64)]
    assert spec.state_dim == 4 and spec.action_dim == 2
    assert spec.action_low == (-1.0, -1.0) and spec.action_high == (1.0, 1.0)
    assert len(spec.tasks) >= 3 and len(set(spec.instructions)) == len(spec.tasks)
    obs, info = env.reset(seed=0)
    assert obs.images["top"].shape == (64, 64, 3) and obs.images["top"].dtype == np.uint8
    assert obs.state.shape == (4,) and obs.state.dtype == np.float32
    assert obs.instruction in spec.instructions
    assert set(info) >= {envs.INFO_SUCCESS, envs.INFO_TASK, envs.INFO_TASK_INDEX}


def test_configurable_cameras_and_size():
    env = envs.make(ENV_ID, cameras=("top",), image_size=(48, 80))
    obs, _ = env.reset(seed=1)
    assert list(obs.images) == ["top"] and obs.images["top"].shape == (48, 80, 3)
    blind = envs.make(ENV_ID, cameras=())
    assert blind.reset(seed=1)[0].images == {}


def test_same_seed_same_episode_and_layout_independent_of_task():
    a, b = envs.make(ENV_ID), envs.make(ENV_ID)
    oa, _ = a.reset(seed=7)
    ob, _ = b.reset(seed=7)
    assert oa.instruction == ob.instruction
    for _ in range(5):
        act = np.array([0.3, -0.7], np.float32)
        oa, ra, *_ = a.step(act)
        ob, rb, *_ = b.step(act)
        assert ra == rb and np.array_equal(oa.state, ob.state)
        assert all(np.array_equal(oa.images[k], ob.images[k]) for k in oa.images)
    red, _ = a.reset(seed=3, task="red")
    blue, _ = b.reset(seed=3, task="blue")
    assert np.array_equal(red.images["top"], blue.images["top"])  # same scene...
    assert red.instruction != blue.instruction  # ...different instruction


def test_instruction_changes_the_correct_action():
    env = envs.make(ENV_ID, cameras=())
    expert = envs.make_expert(ENV_ID)
    differ = 0
    for seed in range(50):
        actions = set()
        for task in range(len(env.spec.tasks)):
            env.reset(seed=seed, task=task)
            actions.add(tuple(np.round(expert(env), 4)))
        differ += len(actions) > 1
    assert differ >= 45  # same scene, different instruction -> a different first action


def test_ignoring_the_instruction_fails_often():
    """Following the expert for a fixed colour succeeds only when that colour was asked."""
    env = envs.make(ENV_ID, cameras=())
    succ = 0
    n = 150
    for i in range(n):
        env.reset(seed=EVAL_SEED + i)
        wrong = envs.make(ENV_ID, cameras=())
        wrong.reset(seed=EVAL_SEED + i, task="red")
        done = False
        while not done:
            a = np.clip((wrong.target_position - env.agent_position) / env.config.max_step, -1, 1)
            _, _, term, trunc, info = env.step(a)
            done = term or trunc
        succ += info["success"]
    assert succ / n < 0.5  # ~1/3: right only when red was the instructed target


def test_unknown_env_id_lists_known_ids():
    with pytest.raises(UnknownEnvError) as e:
        envs.make("builtin/nope-v0")
    assert "builtin/nope-v0" in e.value.message and ENV_ID in e.value.message
    assert isinstance(e.value, LookupError)


def test_unknown_task_lists_known_tasks():
    env = envs.make(ENV_ID)
    with pytest.raises(UnknownTaskError) as e:
        env.reset(seed=0, task="purple")
    assert "purple" in e.value.message and "red" in e.value.message


def test_wrong_action_shape_names_expected_and_actual():
    env = envs.make(ENV_ID)
    env.reset(seed=0)
    with pytest.raises(ActionError) as e:
        env.step(np.zeros(3))
    assert "(2,)" in e.value.message and "(3,)" in e.value.message
    with pytest.raises(ActionError):
        env.step(np.array([np.nan, 0.0]))


def test_actions_are_clipped_to_bounds():
    env = envs.make(ENV_ID, cameras=())
    obs, _ = env.reset(seed=0)
    x0 = obs.state[:2].copy()
    obs, *_ = env.step(np.array([50.0, -50.0]))
    moved = obs.state[:2] - x0
    assert np.all(np.abs(moved) <= env.config.max_step + 1e-6)
    assert np.allclose(obs.state[2:], [1.0, -1.0])


def test_lifecycle_errors():
    env = envs.make(ENV_ID)
    with pytest.raises(EnvStateError):
        env.step(np.zeros(2))
    env.reset(seed=0)
    env.close()
    with pytest.raises(EnvStateError):
        env.reset(seed=0)


def test_episode_truncates_at_step_limit():
    env = envs.make(ENV_ID, cameras=(), max_episode_steps=7)
    env.reset(seed=0)
    for t in range(7):
        _, _, term, trunc, _ = env.step(np.zeros(2))
    assert trunc and not term
    with pytest.raises(EnvStateError):
        env.step(np.zeros(2))


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="ReachConfig.cameras"):
        ReachConfig(cameras=("top", "side"))
    with pytest.raises(ConfigError, match="ReachConfig.image_height"):
        ReachConfig(image_height=0)
    with pytest.raises(ConfigError, match="unknown option"):
        envs.make(ENV_ID, colour="red")


def test_policy_success_rates():
    """The numbers docs/envs.md reports: expert ~100%, constant and random <= 20%."""
    env = envs.make(ENV_ID, cameras=())  # rendering does not change dynamics; keep the test fast
    expert = evaluate(env, expert_policy(env, envs.make_expert(ENV_ID)), EVAL_EPISODES, EVAL_SEED)
    zero = evaluate(env, zero_policy(2), EVAL_EPISODES, EVAL_SEED)
    rand = evaluate(env, random_policy(env, seed=1), EVAL_EPISODES, EVAL_SEED)
    consts = {d: evaluate(env, constant_policy(np.array(d)), EVAL_EPISODES, EVAL_SEED).success_rate
              for d in [(1, 0), (0, 1), (-1, 0), (0, -1), (1, 1), (-1, -1), (1, -1), (-1, 1)]}
    print(f"expert {expert.success_rate:.3f} zero {zero.success_rate:.3f} random {rand.success_rate:.3f} "
          f"constants {consts}")
    assert expert.success_rate >= 0.99
    assert zero.success_rate <= 0.20
    assert rand.success_rate <= 0.20
    assert max(consts.values()) <= 0.20


def test_step_time_budget():
    """Loose bounds (shared 2-core CI): measured ~0.04 ms/step blind, ~0.4 ms/step with 2 cameras."""
    for cameras, budget_ms in [((), 1.0), (("top", "wrist"), 5.0)]:
        env = envs.make(ENV_ID, cameras=cameras)
        env.reset(seed=0)
        n, t0 = 0, time.perf_counter()
        while n < 2000:
            _, _, term, trunc, _ = env.step(np.array([0.05, -0.05], np.float32))
            n += 1
            if term or trunc:
                env.reset()
        ms = (time.perf_counter() - t0) / n * 1e3
        assert ms < budget_ms, f"{cameras}: {ms:.3f} ms/step"


def test_gymnasium_wrapper():
    env = GymEnv(envs.make(ENV_ID))
    obs, info = env.reset(seed=0, options={"task": "green"})
    assert obs["instruction"] == "reach the green target"
    assert env.observation_space.contains(obs)
    obs, r, term, trunc, info = env.step(env.action_space.sample())
    assert env.observation_space.contains(obs) and isinstance(r, float)
    assert isinstance(env, gym.Env) and env.render().shape == (64, 64, 3)
    env.close()
