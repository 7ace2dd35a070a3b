"""A tenant's own env, hosted on its own machine: "move the dot onto the green square".

A plain gymnasium env (no platform imports): one 64x64 camera ``top`` (a green target and a
black dot on grey), state ``[dot_x, dot_y, target_x, target_y]``, action a 2-D velocity in
[-1, 1]. The reward is the tenant's own, computed here and never on the platform: progress
towards the target (x10), a small cost per step, +1 on success (the dot within
``success_radius``; the episode then terminates). ``info["success"]`` tells the platform's
workflow (success rate, budget targets) whether the episode succeeded.

Served to the platform with the tenant's credentials (docs/hosted_envs.md):

    cd examples/hosted_env
    nexus env serve --creds alice.creds --nats-url nats://HOST:4222 reach_dot:make_env
    nexus --creds alice.creds submit rl_reach_dot.yaml --wait     # from another shell
"""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

GREEN = np.array([40, 170, 60], np.uint8)
DOT = np.array([20, 20, 20], np.uint8)
FLOOR = np.array([205, 205, 200], np.uint8)


class ReachDot(gym.Env):
    metadata: ClassVar[dict[str, Any]] = {"render_fps": 10}
    instruction = "move the dot onto the green square"

    def __init__(self, image_size: int = 64, max_steps: int = 20, success_radius: float = 0.2,
                 speed: float = 0.25) -> None:
        self.size, self.max_steps, self.radius, self.speed = int(image_size), int(max_steps), float(success_radius), float(speed)
        self.observation_space = gym.spaces.Dict({
            "top": gym.spaces.Box(0, 255, (self.size, self.size, 3), np.uint8),
            "state": gym.spaces.Box(-1.0, 1.0, (4,), np.float32),
        })
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.dot = np.zeros(2, np.float32)
        self.target = np.zeros(2, np.float32)
        self.t = 0

    def _pixel(self, p: np.ndarray) -> tuple[int, int]:
        col, row = ((p + 1.0) / 2.0 * (self.size - 1)).round().astype(int)
        return int(row), int(col)

    def _obs(self) -> dict[str, Any]:
        img = np.empty((self.size, self.size, 3), np.uint8)
        img[:] = FLOOR
        r, c = self._pixel(self.target)
        img[max(0, r - 3):r + 4, max(0, c - 3):c + 4] = GREEN
        r, c = self._pixel(self.dot)
        img[max(0, r - 2):r + 3, max(0, c - 2):c + 3] = DOT
        return {"top": img, "state": np.concatenate([self.dot, self.target]).astype(np.float32)}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.dot = self.np_random.uniform(-0.8, 0.8, 2).astype(np.float32)
        self.target = self.np_random.uniform(-0.8, 0.8, 2).astype(np.float32)
        self.t = 0
        return self._obs(), {"success": False}

    def step(self, action):
        before = float(np.linalg.norm(self.target - self.dot))
        a = np.clip(np.asarray(action, np.float32), -1.0, 1.0)
        self.dot = np.clip(self.dot + self.speed * a, -1.0, 1.0).astype(np.float32)
        self.t += 1
        after = float(np.linalg.norm(self.target - self.dot))
        success = after < self.radius
        reward = 10.0 * (before - after) - 0.01 + (1.0 if success else 0.0)  # the tenant's own reward
        return self._obs(), reward, success, self.t >= self.max_steps and not success, {"success": success}


def make_env(**options: Any) -> ReachDot:
    """The factory `nexus env serve reach_dot:make_env` names; env.options are its keywords."""
    return ReachDot(**options)
