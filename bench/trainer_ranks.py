"""The trainer's grouped step over N data-parallel ranks: step time against ranks (issue 31 item 4).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.trainer_ranks --ranks 1,2                 # CPU smoke, tiny base
    python3 -m bench.trainer_ranks --device cuda --base qwen3-vl-4b --ranks 1,2,4 \\
        --tenants 8 --rows 32 --json $OUT/trainer_ranks.json                            # a several-GPU machine

Per rank count N, the trainer's own path (`actors.trainer.ranks.RankGroup`, as `NEXUS_TRAINER_RANKS=N`
runs it): rank 0 in this process, ranks 1..N-1 as `actors.trainer.rank` processes (on CUDA, rank r
on cuda:r), ``--tenants`` mlp tenants with ``--rows`` rows each of queued uint8 frames
(`QueuePutRequest`, canonicalised on every rank), ``--warmup`` steps then ``--steps`` timed ones.
N = 1 is one process's plain grouped `models.train_step`. Prints a table (median step, plan and
all-reduce shares, speed-up over N = 1) and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _items(schema: Any, tenants: int, rows: int, step: int) -> list[Any]:
    import numpy as np

    from protocol.messages import QueuePutRequest

    out = []
    for t in range(tenants):
        rng = np.random.default_rng(1000 * step + t)
        out.append(QueuePutRequest(
            tenant=f"bench-{t}", job="j", seq=step,
            images={c.name: rng.integers(0, 256, (rows, c.height, c.width, 3), dtype=np.uint8) for c in schema.cameras},
            state=rng.standard_normal((rows, schema.state_dim)).astype(np.float32),
            instructions=["put the cube in the bowl"] * rows,
            actions=rng.standard_normal((rows, schema.action_horizon, schema.action_dim)).astype(np.float32)))
    return out


def measure(ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from actors.trainer.step import item_to_batch
    from actors.trainer.ranks import Entry, RankGroup, RankSpec
    from models import BaseConfig, BaseModel, OptimConfig, TenantSchema, TenantSlot, train_step
    from models.testing import libero_schema
    from protocol.messages import TenantConfig

    device = "cuda:0" if args.device.startswith("cuda") else "cpu"
    if device != "cpu":
        torch.cuda.set_device(0)
    base = BaseModel.load(BaseConfig(args.base, device=device, image_size=args.image_size))
    schema = libero_schema()
    cfgs = [TenantConfig(name=f"bench-{t}", base=args.base, schema=schema.to_dict(), head="mlp",
                         head_params={"width": 256}, optim={"lr": 1e-4}, seed=t) for t in range(args.tenants)]
    slots = [TenantSlot.create(c.name, TenantSchema.from_dict(c.schema), base, head_kind="mlp",
                               head_options={"width": 256}, optim=OptimConfig(lr=1e-4), seed=c.seed) for c in cfgs]
    group = None
    if ranks > 1:
        group = RankGroup(RankSpec(world=ranks, device=device, timeout_s=args.timeout_s))
        group.spawn()
        group.join()
    times: list[float] = []
    parts: dict[str, list[float]] = {}
    try:
        for step in range(args.warmup + args.steps):
            items = _items(schema, args.tenants, args.rows, step)
            batches = [item_to_batch(s, it) for s, it in zip(slots, items)]
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if group is None:
                train_step(base, list(zip(slots, batches)), grouped=True)
            else:
                group.step(args.base, {"image_size": args.image_size}, base,
                           [Entry(c.name, s, c, it, b) for c, s, it, b in zip(cfgs, slots, items, batches)],
                           grouped=True, resident=[c.name for c in cfgs])
            if device != "cpu":
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
                for k, v in (group.timings if group is not None else {}).items():
                    parts.setdefault(k, []).append(v)
    finally:
        if group is not None:
            group.close()
            if dist.is_initialized():
                dist.destroy_process_group()
    return {"ranks": ranks, "step_s": statistics.median(times), "steps": len(times),
            **{f"{k}_median": statistics.median(v) for k, v in parts.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts, 1 first for the speed-up")
    p.add_argument("--device", default="cpu", help="cpu or cuda (rank r on cuda:r)")
    p.add_argument("--base", default="tiny-qwen3-vl")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--tenants", type=int, default=3)
    p.add_argument("--rows", type=int, default=8, help="rows per tenant per step (split over the ranks)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timeout-s", type=float, default=300.0, help="each collective's timeout")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        counts = [int(x) for x in args.ranks.split(",") if x.strip()]
    except ValueError:
        p.error(f"--ranks {args.ranks!r}: comma-separated integers")
    if not counts or any(not 1 <= n <= 64 for n in counts):
        p.error(f"--ranks {args.ranks!r}: each in 1..64")
    for name in ("tenants", "rows", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: must be >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = [measure(n, args) for n in counts]
    one = next((r["step_s"] for r in rows if r["ranks"] == 1), None)
    print("| ranks | step ms | plan ms | forward/backward ms | all-reduce ms | speed-up over 1 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        r["speedup"] = one / r["step_s"] if one else None
        ms = lambda k: f"{1000 * r[k]:.1f}" if k in r else "-"  # noqa: E731
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        print(f"| {r['ranks']} | {1000 * r['step_s']:.1f} | {ms('plan_s_median')} | {ms('forward_backward_s_median')} | "
              f"{ms('allreduce_s_median')} | {speedup} |")
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
