"""Simulators behind one adapter interface, and LeRobot v3.0 datasets.

    import envs
    env = envs.make("builtin/reach-v0")            # see envs/builtin/reach.py
    envs.known_env_ids()
    expert = envs.make_expert("builtin/reach-v0")  # expert(env) -> action

    from envs.lerobot import LeRobotReader, LeRobotWriter, record   # datasets (lazy: pyarrow, av)
"""

from envs.adapter import (
    INFO_SUCCESS,
    INFO_TASK,
    INFO_TASK_INDEX,
    CameraSpec,
    EnvAdapter,
    EnvSpec,
    Observation,
    TaskSpec,
)
from envs.errors import (
    ActionError,
    DatasetError,
    EnvError,
    EnvStateError,
    UnknownEnvError,
    UnknownTaskError,
)
from envs.registry import known_env_ids, make, make_expert, register

__all__ = [
    "INFO_SUCCESS",
    "INFO_TASK",
    "INFO_TASK_INDEX",
    "ActionError",
    "CameraSpec",
    "DatasetError",
    "EnvAdapter",
    "EnvError",
    "EnvSpec",
    "EnvStateError",
    "Observation",
    "TaskSpec",
    "UnknownEnvError",
    "UnknownTaskError",
    "known_env_ids",
    "make",
    "make_expert",
    "register",
]
