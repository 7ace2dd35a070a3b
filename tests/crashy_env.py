"""A simulator plugin for tests: the built-in task, but `step` blows up on an action of 9.

Loaded into an env worker with NEXUS_ENV_PLUGINS=tests.crashy_env.
"""

from __future__ import annotations

import numpy as np

import envs
from envs.builtin.reach import ReachEnv, make_reach


class CrashyReach(ReachEnv):
    def step(self, action):
        if float(np.asarray(action).reshape(-1)[0]) == 9.0:
            raise RuntimeError("simulated physics blow-up")
        return super().step(action)


def make_crashy(env_id: str = "test/crashy-v0", **kw) -> CrashyReach:
    env = make_reach(env_id=env_id, **kw)
    env.__class__ = CrashyReach  # same state, crashy step
    return env


envs.register("test/crashy-v0", make_crashy, overwrite=True)


class HangyReach(ReachEnv):
    """`step` with an action of 7 sleeps HANG_S (a simulator that hangs past its timeout)."""

    HANG_S = 4.0

    def step(self, action):
        if float(np.asarray(action).reshape(-1)[0]) == 7.0:
            import time

            time.sleep(self.HANG_S)
        return super().step(action)


def make_hangy(env_id: str = "test/hangy-v0", **kw) -> HangyReach:
    env = make_reach(env_id=env_id, **kw)
    env.__class__ = HangyReach
    return env


envs.register("test/hangy-v0", make_hangy, overwrite=True)
