"""Run whole episodes with a policy and score them; used by tests, docs and `record`.

    from envs.rollout import evaluate, zero_policy
    report = evaluate(envs.make("builtin/reach-v0"), zero_policy(2), episodes=200, seed=0)
    report.success_rate, report.mean_return, report.mean_steps

A policy here is `policy(obs) -> action`; a scripted expert, which reads the env's privileged
state, is wrapped with `expert_policy(env, expert)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from envs.adapter import INFO_SUCCESS, EnvAdapter, Observation

Policy = Callable[[Observation], np.ndarray]


@dataclass(frozen=True)
class EvalReport:
    episodes: int
    successes: int
    mean_return: float
    mean_steps: float

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0


def zero_policy(action_dim: int) -> Policy:
    return lambda obs: np.zeros(action_dim, np.float32)


def constant_policy(action: np.ndarray) -> Policy:
    a = np.asarray(action, np.float32)
    return lambda obs: a


def random_policy(env: EnvAdapter, seed: int) -> Policy:
    """Uniform over the action box, from its own seeded generator."""
    rng = np.random.default_rng(seed)
    low = np.asarray(env.spec.action_low, np.float32)
    high = np.asarray(env.spec.action_high, np.float32)
    return lambda obs: rng.uniform(low, high).astype(np.float32)


def expert_policy(env: EnvAdapter, expert: Callable[[EnvAdapter], np.ndarray]) -> Policy:
    return lambda obs: expert(env)


def evaluate(env: EnvAdapter, policy: Policy, episodes: int, seed: int = 0) -> EvalReport:
    """Episode i resets with seed `seed + i` and a seeded task draw, so runs are reproducible."""
    successes, returns, steps = 0, 0.0, 0
    for i in range(episodes):
        obs, info = env.reset(seed=seed + i)
        done = False
        while not done:
            obs, reward, terminated, truncated, info = env.step(policy(obs))
            returns += reward
            steps += 1
            done = terminated or truncated
        successes += bool(info[INFO_SUCCESS])
    return EvalReport(episodes, successes, returns / max(episodes, 1), steps / max(episodes, 1))
