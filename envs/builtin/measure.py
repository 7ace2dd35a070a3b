"""Measure builtin/reach-v0: policy success rates and step times (the numbers in docs/envs.md).

    .venv/bin/python -m envs.builtin.measure [--episodes 1000] [--seed 10000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import envs
from envs.rollout import constant_policy, evaluate, expert_policy, random_policy, zero_policy

ENV_ID = "builtin/reach-v0"
CONSTANT_ACTIONS = [(1, 0), (0, 1), (-1, 0), (0, -1), (1, 1), (-1, -1), (1, -1), (-1, 1)]


def step_time_ms(cameras: tuple[str, ...], steps: int = 5000) -> float:
    env = envs.make(ENV_ID, cameras=cameras)
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, size=(steps, 2)).astype(np.float32)
    t0 = time.perf_counter()
    for a in actions:
        _, _, term, trunc, _ = env.step(a)
        if term or trunc:
            env.reset()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=10_000)
    args = ap.parse_args()
    env = envs.make(ENV_ID, cameras=())
    rows = {
        "expert": expert_policy(env, envs.make_expert(ENV_ID)),
        "zero (constant)": zero_policy(2),
        "uniform random": random_policy(env, seed=1),
    }
    rows.update({f"constant {a}": constant_policy(np.array(a, np.float32)) for a in CONSTANT_ACTIONS})
    print(f"{ENV_ID}: {args.episodes} episodes, seeds {args.seed}..{args.seed + args.episodes - 1}")
    for name, policy in rows.items():
        r = evaluate(env, policy, args.episodes, args.seed)
        print(f"  {name:<22} success {r.success_rate:6.1%}  return {r.mean_return:6.3f}  steps {r.mean_steps:5.1f}")
    for cams in [(), ("top",), ("top", "wrist")]:
        print(f"  step time, cameras {cams or 'none'}: {step_time_ms(cams):.3f} ms")


if __name__ == "__main__":
    main()
