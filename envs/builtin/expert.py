"""Scripted expert for builtin/reach-v0: head straight for the instructed target.

    from envs.builtin.expert import ReachExpert
    expert = ReachExpert()
    action = expert(env)        # needs the ReachEnv itself (privileged state), not the obs

The action points straight at the target, scaled so its larger axis is 1 (full speed) until
the target is within one step, where it lands exactly. A straight line (rather than per-axis
saturation) keeps the action a smooth function of the target direction, which is what a
policy learns from the images; any target is reached in at most 20 steps at `max_step` 0.1.
"""

from __future__ import annotations

import numpy as np

from envs.builtin.reach import ReachEnv


class ReachExpert:
    def __call__(self, env: ReachEnv) -> np.ndarray:
        delta = env.target_position - env.agent_position
        scale = max(float(np.abs(delta).max()), env.config.max_step)
        return (delta / scale).astype(np.float32)
