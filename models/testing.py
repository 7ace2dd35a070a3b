"""Synthetic tenants and data for tests and benchmarks (deterministic from a seed).

LIBERO-like: 2 cameras 128x128 (agentview, wrist), state 8, action 7.
CALVIN-like: 2 cameras (static 200x200, gripper 84x84), state 15, action 7.
"""

from __future__ import annotations

import numpy as np
import torch

from models.heads import TenantBatch
from models.preprocess import Observation, TenantPreprocessor
from models.schema import CameraSpec, TenantSchema

INSTRUCTIONS = [
    "pick up the black bowl and place it on the plate",
    "open the top drawer of the cabinet",
    "push the red block to the left",
    "turn on the stove and put the pot on it",
    "lift the blue block from the table",
    "put the cream cheese in the basket",
]


def libero_schema(horizon: int = 8) -> TenantSchema:
    return TenantSchema(
        cameras=(CameraSpec("agentview", 128, 128), CameraSpec("wrist", 128, 128)),
        state_dim=8, action_dim=7, action_horizon=horizon,
        instruction_template="What action should the robot take to {instruction}?",
    )


def calvin_schema(horizon: int = 8) -> TenantSchema:
    return TenantSchema(
        cameras=(CameraSpec("static", 200, 200), CameraSpec("gripper", 84, 84)),
        state_dim=15, action_dim=7, action_horizon=horizon,
        instruction_template="{instruction}",
    )


def random_observations(schema: TenantSchema, n: int, rng: np.random.Generator) -> list[Observation]:
    obs = []
    for _ in range(n):
        images = {c.name: rng.integers(0, 256, (c.height, c.width, 3), dtype=np.uint8) for c in schema.cameras}
        state = rng.normal(size=schema.state_dim).astype(np.float32)
        obs.append(Observation(images, state, INSTRUCTIONS[int(rng.integers(len(INSTRUCTIONS)))]))
    return obs


def random_batch(pre: TenantPreprocessor, n: int, seed: int) -> TenantBatch:
    rng = np.random.default_rng(seed)
    vla = pre(random_observations(pre.schema, n, rng))
    s = pre.schema
    actions = torch.from_numpy(rng.uniform(-1, 1, (n, s.action_horizon, s.action_dim)).astype(np.float32))
    return TenantBatch(vla, actions)
