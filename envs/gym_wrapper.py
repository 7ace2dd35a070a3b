"""gymnasium.Env view of any EnvAdapter, for code that expects the gymnasium API.

    env = GymEnv(envs.make("builtin/reach-v0"))
    obs, info = env.reset(seed=0, options={"task": "blue"})
    obs["images"]["top"], obs["state"], obs["instruction"]
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from envs.adapter import EnvAdapter, Observation

# gymnasium.spaces.Text needs a bound; instructions are short sentences.
_MAX_INSTRUCTION_CHARS = 512


class GymEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, adapter: EnvAdapter) -> None:
        self.adapter = adapter
        spec = adapter.spec
        self.action_space = gym.spaces.Box(
            np.asarray(spec.action_low, np.float32), np.asarray(spec.action_high, np.float32), dtype=np.float32
        )
        charset = "".join(sorted({ch for t in spec.instructions for ch in t}))
        self.observation_space = gym.spaces.Dict(
            {
                "images": gym.spaces.Dict(
                    {c.name: gym.spaces.Box(0, 255, c.shape_HWC, np.uint8) for c in spec.cameras}
                ),
                "state": gym.spaces.Box(-np.inf, np.inf, (spec.state_dim,), np.float32),
                "instruction": gym.spaces.Text(_MAX_INSTRUCTION_CHARS, charset=charset),
            }
        )
        self.render_mode = "rgb_array"
        self._last: Observation | None = None

    @staticmethod
    def _to_dict(obs: Observation) -> dict[str, Any]:
        return {"images": dict(obs.images), "state": obs.state, "instruction": obs.instruction}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        super().reset(seed=seed)
        obs, info = self.adapter.reset(seed=seed, task=(options or {}).get("task"))
        self._last = obs
        return self._to_dict(obs), info

    def step(self, action: Any) -> tuple[dict, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.adapter.step(action)
        self._last = obs
        return self._to_dict(obs), reward, terminated, truncated, info

    def render(self) -> np.ndarray | None:
        if self._last is None or not self._last.images:
            return None
        return next(iter(self._last.images.values()))

    def close(self) -> None:
        self.adapter.close()
