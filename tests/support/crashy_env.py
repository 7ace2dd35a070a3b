"""Simulator plugins for tests that fail the ways real simulators do.

Loaded into an env worker with NEXUS_ENV_PLUGINS=tests.support.crashy_env (its simulator children
import it too). Each simulator runs in a child process (envs/simproc.py):

    test/crashy-v0      `step` raises on an action of 9; its process exits (os._exit) on 8
    test/hangy-v0       `step` with an action of 7 sleeps HANG_S (past any test's timeout)
    test/slow-make-v0   the built-in task whose make (scene build) takes ``make_s`` seconds
    test/dying-v0       its process exits mid-episode (at step ``die_at_step`` of episodes
                        reset with a seed in ``die_seeds``; every episode when empty)
"""

from __future__ import annotations

import os
import time

import numpy as np

import envs
from envs.builtin.reach import ReachEnv, make_reach


class CrashyReach(ReachEnv):
    def step(self, action):
        first = float(np.asarray(action).reshape(-1)[0])
        if first == 9.0:
            raise RuntimeError("simulated physics blow-up")
        if first == 8.0:
            os._exit(3)  # the simulator's process dies (a segfault, an OOM kill)
        return super().step(action)


def make_crashy(env_id: str = "test/crashy-v0", **kw) -> CrashyReach:
    env = make_reach(env_id=env_id, **kw)
    env.__class__ = CrashyReach  # same state, crashy step
    return env


envs.register("test/crashy-v0", make_crashy, overwrite=True)


class HangyReach(ReachEnv):
    """`step` with an action of 7 sleeps HANG_S (a simulator that hangs past its timeout)."""

    HANG_S = 3600.0

    def step(self, action):
        if float(np.asarray(action).reshape(-1)[0]) == 7.0:
            time.sleep(self.HANG_S)
        return super().step(action)


def make_hangy(env_id: str = "test/hangy-v0", **kw) -> HangyReach:
    env = make_reach(env_id=env_id, **kw)
    env.__class__ = HangyReach
    return env


envs.register("test/hangy-v0", make_hangy, overwrite=True)


def make_slow(env_id: str = "test/slow-make-v0", make_s: float = 3.0, **kw) -> ReachEnv:
    """A scene build that holds its process for ``make_s`` seconds (time.sleep, and a busy
    loop for half of it: a C extension building a scene holds the GIL)."""
    time.sleep(make_s / 2)
    end = time.monotonic() + make_s / 2
    while time.monotonic() < end:
        pass
    return make_reach(env_id=env_id, **kw)


envs.register("test/slow-make-v0", make_slow, overwrite=True)


class DyingReach(ReachEnv):
    """Its process exits at step ``die_at_step`` of an episode reset with a seed in
    ``die_seeds`` (every episode when that is empty): a simulator that segfaults mid-episode."""

    def step(self, action):
        self._dying_steps += 1
        if self._dying_steps >= self._die_at_step and (not self._die_seeds or self._dying_seed in self._die_seeds):
            os._exit(3)
        return super().step(action)

    def reset(self, seed=None, task=None):
        self._dying_seed, self._dying_steps = seed, 0
        return super().reset(seed=seed, task=task)


def make_dying(env_id: str = "test/dying-v0", die_seeds: tuple[int, ...] = (), die_at_step: int = 2,
               **kw) -> DyingReach:
    env = make_reach(env_id=env_id, **kw)
    env.__class__ = DyingReach
    env._die_seeds, env._die_at_step = {int(s) for s in die_seeds}, int(die_at_step)
    env._dying_seed, env._dying_steps = None, 0
    return env


envs.register("test/dying-v0", make_dying, overwrite=True)
