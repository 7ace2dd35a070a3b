"""Trainer step benchmark: where one SFT step's time goes, on the trainer's own code path.

    python -m bench.trainer_step                                   # tiny base, CPU, 32 rows
    python -m bench.trainer_step --device cuda --base qwen3-vl-4b --fast on --json $OUT/step.json
    python -m bench.trainer_step --tenants 4 --rows 32 --profile   # + cProfile's top functions

One step is what the trainer's running group does per iteration (`actors.trainer.trainer`): every
tenant's queued micro-batch (the tenant's own schema, uint8 frames: a `QueuePutRequest`) is
canonicalised (`actors.trainer.step.item_to_batch`), then `models.forward_backward` (one grouped
frozen-base forward, each head's loss and backward) and each slot's AdamW step. Each stage is
timed on its own, synchronised on CUDA:

  canonicalise   queued item -> canonical TenantBatch on the device (resize, prompt ids, state)
  base_forward   the grouped frozen-base forward (no grad; the fast engine when enabled)
  head_fwd_bwd   every head's loss and backward
  optimizer      clip + AdamW per slot (the step's .item() syncs are here: loss, grad norm)
  step           the sum: one iteration of the running group
  commit         per job, not per step: the slot's checkpoint bytes (head, moments, RNG),
                 what the trainer writes as a job's commit object

Medians over --steps after --warmup. Prints a table and writes JSON (--json).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from actors.trainer.step import item_to_batch  # noqa: E402
from models import BaseConfig, BaseModel, OptimConfig, TenantSlot, forward_backward  # noqa: E402
from models.testing import libero_schema  # noqa: E402
from protocol.messages import QueuePutRequest  # noqa: E402

STAGES = ("canonicalise", "base_forward", "head_fwd_bwd", "optimizer", "step", "commit")


@dataclass
class Result:
    base: str
    device: str
    dtype: str
    fast: bool
    compile: bool
    head: str
    tenants: int
    rows: int
    steps: int
    ms: dict[str, float]  # stage -> median wall ms
    cpu_ms: dict[str, float]  # stage -> median process CPU ms (host work; steadier on a shared host)
    samples_per_s: float
    host: str


def queued_item(schema, tenant: str, rows: int, seed: int) -> QueuePutRequest:
    """One micro-batch as a workflow queues it (the tenant's schema, uint8 frames)."""
    rng = np.random.default_rng(seed)
    return QueuePutRequest(
        tenant=tenant, job="bench", seq=0,
        images={c.name: rng.integers(0, 256, (rows, c.height, c.width, 3), dtype=np.uint8) for c in schema.cameras},
        state=rng.standard_normal((rows, schema.state_dim)).astype(np.float32),
        instructions=[f"pick up the block number {i % 5} and place it in the bowl" for i in range(rows)],
        actions=rng.uniform(-1, 1, (rows, schema.action_horizon, schema.action_dim)).astype(np.float32))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> Result:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    fast = args.fast == "on" or (args.fast == "auto" and device.startswith("cuda"))
    base = BaseModel.load(BaseConfig(source=args.base, device=device, fast=fast, compile=fast and args.compile))
    schema = libero_schema(horizon=args.horizon)
    slots = [TenantSlot.create(f"t{i}", schema, base, head_kind=args.head, optim=OptimConfig(lr=1e-4), seed=i)
             for i in range(args.tenants)]
    items = [queued_item(schema, s.tenant_id, args.rows, seed=i) for i, s in enumerate(slots)]
    dev = base.device
    times: dict[str, list[float]] = {k: [] for k in STAGES}
    cpu: dict[str, list[float]] = {k: [] for k in STAGES}
    clock = time.process_time
    # The base forward's CPU time: forward_backward reports its wall time only.
    encode_cpu: list[float] = []
    plain_encode = base.encode

    def timed_encode(*a: Any, **kw: Any) -> Any:
        c = clock()
        try:
            return plain_encode(*a, **kw)
        finally:
            encode_cpu.append(clock() - c)

    base.encode = timed_encode  # type: ignore[method-assign]
    prof = cProfile.Profile() if args.profile else None
    for step in range(args.warmup + args.steps):
        if prof is not None and step == args.warmup:
            prof.enable()
        t0, c0 = time.perf_counter(), clock()
        batches = [item_to_batch(s, it) for s, it in zip(slots, items)]
        _sync(dev)
        t1, c1 = time.perf_counter(), clock()
        split: dict[str, float] = {}
        encode_cpu.clear()
        forward_backward(base, list(zip(slots, batches)), grouped=True, timings=split)
        t2, c2 = time.perf_counter(), clock()
        for s in slots:
            s.optimizer_step()
        _sync(dev)
        t3, c3 = time.perf_counter(), clock()
        slots[0].checkpoint()
        t4, c4 = time.perf_counter(), clock()
        if step >= args.warmup:
            for out, (a, b, c, d, e), fwd in ((times, (t0, t1, t2, t3, t4), split["base_s"]),
                                              (cpu, (c0, c1, c2, c3, c4), sum(encode_cpu))):
                out["canonicalise"].append(b - a)
                out["base_forward"].append(fwd)
                out["head_fwd_bwd"].append(c - b - fwd)
                out["optimizer"].append(d - c)
                out["step"].append(d - a)
                out["commit"].append(e - d)
    if prof is not None:
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.profile_top)
        print(out.getvalue())
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    cpu_ms = {k: 1000 * statistics.median(v) for k, v in cpu.items()}
    return Result(base=args.base, device=str(dev), dtype=str(base.dtype).replace("torch.", ""), fast=fast,
                  compile=fast and args.compile, head=args.head, tenants=args.tenants, rows=args.rows, steps=args.steps, ms=ms, cpu_ms=cpu_ms,
                  samples_per_s=args.tenants * args.rows / (ms["step"] / 1000),
                  host=f"{platform.node()} {platform.processor() or platform.machine()}")


def table(r: Result) -> str:
    lines = [f"{r.base} on {r.device} ({r.dtype}, fast={r.fast}, compile={r.compile}), head {r.head}, {r.tenants} tenant(s) x {r.rows} rows,"
             f" median of {r.steps} steps",
             f"| {'stage':<13} | {'wall ms':>9} | {'of step':>7} | {'cpu ms':>9} |",
             f"|{'-' * 15}|{'-' * 11}|{'-' * 9}|{'-' * 11}|"]
    for k in STAGES:
        share = f"{100 * r.ms[k] / r.ms['step']:.0f} %" if k != "commit" else "per job"
        lines.append(f"| {k:<13} | {r.ms[k]:>9.2f} | {share:>7} | {r.cpu_ms[k]:>9.2f} |")
    lines.append(f"samples/s: {r.samples_per_s:.0f}")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--base", default="tiny-qwen3-vl", help="a preset name or a save_pretrained directory")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--fast", choices=("auto", "on", "off"), default="auto",
                   help="the fast engine (models/fast.py) for the base forward; auto: on CUDA (the trainer's rule)")
    p.add_argument("--compile", action="store_true",
                   help="with the fast engine: torch.compile its blocks (the trainer's NEXUS_TRAINER_COMPILE)")
    p.add_argument("--head", default="mlp", choices=("mlp", "flow", "gaussian"))
    p.add_argument("--tenants", type=int, default=1)
    p.add_argument("--rows", type=int, default=32, help="rows per tenant's micro-batch")
    p.add_argument("--horizon", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="cProfile the timed steps; print the top functions")
    p.add_argument("--profile-top", type=int, default=30)
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    for name in ("tenants", "rows", "steps", "horizon"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)}: must be >= 1")
    if args.warmup < 0:
        p.error(f"--warmup={args.warmup}: must be >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    res = run(args)
    print(table(res))
    record = asdict(res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2))
    return record


if __name__ == "__main__":
    main()
