"""Built-in lightweight simulators (numpy only). See envs/builtin/reach.py."""

from envs.builtin.expert import ReachExpert
from envs.builtin.reach import ReachConfig, ReachEnv, make_reach

__all__ = ["ReachConfig", "ReachEnv", "ReachExpert", "make_reach"]
