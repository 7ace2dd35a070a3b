"""A custom training loop built only from the low-level primitives (no workload spec).

Behaviour cloning on a LeRobot dataset, driven step by step by the client:

    for each step:  reserve(auto=False) -> queue_put -> mark_ready -> queue_get (inspect)
                    -> train_batch (the trainer trains exactly this job, now)
    export_params -> evaluate with env sessions + predict pinned to the exported version
    load_weights  (roll the tenant back to its first export, to show it)

    .venv/bin/python examples/custom_loop.py --data-dir .nexus          # a running cluster
    .venv/bin/python examples/custom_loop.py --nats-url nats://127.0.0.1:4222 --dataset PATH

Without --dataset it records 10 scripted-expert episodes of the built-in task first.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import numpy as np

from protocol.messages import QueuePutRequest, TenantConfig
from sdk.client import AsyncClient, resolve_cluster

SCHEMA = {
    "cameras": [{"name": "top", "height": 64, "width": 64}, {"name": "wrist", "height": 64, "width": 64}],
    "state_dim": 4, "action_dim": 2, "action_horizon": 1, "instruction_template": "{instruction}",
}


async def run(url: str, prefix: str, dataset: Path, tenant: str, steps: int, episodes: int) -> dict:
    from envs.lerobot import LeRobotReader

    async with AsyncClient(url, prefix, timeout_s=60) as c:
        await c.create_tenant(TenantConfig(name=tenant, base="tiny-qwen3-vl-64", schema=SCHEMA, head="mlp",
                                           optim={"lr": 1e-3}), exist_ok=True)
        reader = LeRobotReader(dataset)
        rng = np.random.default_rng(0)
        losses, first_export = [], None
        for step in range(steps):
            # 1. a job only this loop trains (auto=False: the scheduler never leases it)
            job = await c.reserve(tenant, "sft", auto=False, wait_s=30)
            b = reader.sample(16, rng)
            await c.queue_put(QueuePutRequest(
                tenant=tenant, job=job.job, seq=0,
                images={k.removeprefix("observation.images."): v for k, v in b.images.items()},
                state=b.state_B_S.astype(np.float32), instructions=list(b.task_B),
                actions=b.action_B_A[:, None, :].astype(np.float32)))
            await c.mark_ready(tenant, job.job)
            back = await c.queue_get(tenant, job.job)  # what the trainer will see
            assert back.total == 1 and len(back.items[0].instructions) == 16
            # 2. train it now
            result = await c.train_batch(tenant, job.job)
            losses.append(result.metrics["loss"])
            if first_export is None:
                first_export = await c.export_params(tenant)
        reader.close()
        final = await c.export_params(tenant)
        # 3. evaluate the exported version with env sessions and pinned predictions
        session = await c.env_create("builtin/reach-v0")
        successes = 0
        for ep in range(episodes):
            obs = await c.env_reset(session, seed=50_000 + ep)
            while True:
                act = await c.predict(tenant, obs.images, obs.state, obs.instruction, version=final.version)
                obs = await c.env_step(session, np.clip(act.actions[0], -1, 1))
                if obs.terminated or obs.truncated:
                    successes += int(bool(obs.info.get("success")))
                    break
        await c.env_close(session)
        # 4. roll back to the first export (load_weights), to show the primitive
        await c.load_weights(tenant, first_export.object_name)
        return {"losses": losses, "version": final.version, "success_rate": successes / max(1, episodes)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=Path(".nexus"))
    p.add_argument("--nats-url")
    p.add_argument("--prefix")
    p.add_argument("--dataset", type=Path, help="LeRobot v3.0 root with top/wrist 64x64 cameras")
    p.add_argument("--tenant", default="custom-bc")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--episodes", type=int, default=5)
    args = p.parse_args()
    url, prefix = resolve_cluster(args.data_dir, args.nats_url, args.prefix)
    dataset = args.dataset
    if dataset is None:
        from envs.lerobot import record
        from envs.lerobot.record import RecordConfig

        dataset = Path(tempfile.mkdtemp()) / "demos"
        record(RecordConfig(out=dataset, episodes=10))
    out = asyncio.run(run(url, prefix, dataset, args.tenant, args.steps, args.episodes))
    print(f"loss {out['losses'][0]:.4f} -> {out['losses'][-1]:.4f} over {len(out['losses'])} steps; "
          f"version {out['version']}; success {out['success_rate']:.0%}")


if __name__ == "__main__":
    main()
