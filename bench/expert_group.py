"""Action-expert benchmark: N tenants with pi0-style experts (models/heads/expert.py) on one
grouped base forward that computes the per-layer prefix KV cache once for all rows, vs one
base forward (and cache) per tenant.

    python -m bench.expert_group                                         # tiny preset, CPU
    python -m bench.expert_group --preset qwen3-vl-4b --device cuda --tenants 8 --batch 4 \
        --width 256 --euler-steps 10 --json bench/results/expert_h200.json

Per row, on canonical batches already on the device (preprocessing excluded), medians over
--repeats after --warmup runs, CUDA synchronized around each timed region:
  cache   base forward returning the prefix KV cache (inference_mode): serial vs grouped;
  infer   `predict`: that forward, then the experts' Euler steps: serial (one tenant at a time)
          vs grouped (experts of one shape with equal rows sample together, stacked weights);
  train   `forward_backward`: the forward, each expert's flow-matching loss and backward (no
          optimizer step): serial vs grouped;
  experts the experts' Euler sampling alone: together on the features of one grouped forward
          vs one tenant at a time on those of serial forwards (both orders, the better per side).
`--frozen K` makes the last K tenants frozen-base mlp tenants sharing the group.
Prints a table and writes one JSON record.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.tenant_group import GroupRow, add_common_args, build, emit, time_ms  # noqa: E402
from models import forward_backward, predict  # noqa: E402
from models.group import predict_heads  # noqa: E402


@dataclass
class Row(GroupRow):
    expert_width: int
    expert_depth: int
    euler_steps: int
    expert_params_m: float
    serial_cache_ms: float | None
    grouped_cache_ms: float | None
    cache_speedup: float | None
    serial_infer_ms: float | None
    grouped_infer_ms: float | None
    infer_speedup: float | None
    serial_train_ms: float | None
    grouped_train_ms: float | None
    train_speedup: float | None
    serial_experts_ms: float | None
    grouped_experts_ms: float | None
    experts_speedup: float | None


def run(args: argparse.Namespace) -> Row:
    options = {"width": args.width, "euler_steps": args.euler_steps}
    if args.depth:
        options["depth"] = args.depth

    def slot_options(i: int) -> dict:
        expert = i < args.tenants - args.frozen
        return {"head_kind": "expert" if expert else "mlp", "head_options": options if expert else None}

    group = build(args, slot_options)
    base, slots, vlas, items = group.base, group.slots, group.vlas, group.items
    pairs = list(zip(slots, vlas))
    cache = group.encode

    def experts(feats, grouped: bool):
        with torch.inference_mode():
            if grouped:  # what a grouped predict does: experts of one shape sample together
                return predict_heads(pairs, feats)
            return [s.head.predict(f, v, s.generator) for s, v, f in zip(slots, vlas, feats)]

    stages = {
        "cache": lambda grouped: lambda: cache(grouped),
        "infer": lambda grouped: lambda: predict(base, pairs, grouped=grouped),
        "train": lambda grouped: lambda: forward_backward(base, items, grouped=grouped),
    }
    t: dict[str, float] = {}
    for grouped in (False, True):
        name = "grouped" if grouped else "serial"
        for stage in args.stages:
            if stage in stages:
                t[f"{name}_{stage}"] = time_ms(stages[stage](grouped), base.device, args.warmup, args.repeats)
    if "experts" in args.stages:
        # The heads alone, on features of one grouped forward (sampled together, as a grouped
        # predict does) and of one serial forward (one tenant at a time), timed in both orders
        # (the better of the two per side).
        feats = {g: cache(g) for g in (False, True)}
        for order in ((False, True), (True, False)):
            for g in order:
                key = f"{'grouped' if g else 'serial'}_experts"
                ms = time_ms(lambda: experts(feats[g], g), base.device, args.warmup, args.repeats)
                t[key] = min(t.get(key, ms), ms)
    expert_slots = [s for s in slots if s.head_kind == "expert"]
    params = sum(p.numel() for p in expert_slots[0].head.parameters()) / 1e6 if expert_slots else 0.0
    depth = len(expert_slots[0].head.layers) if expert_slots else 0
    return Row(args.preset, str(base.device), args.tenants, args.frozen, args.batch, args.width, depth,
               args.euler_steps, round(params, 2),
               *(v for stage in ("cache", "infer", "train", "experts") for v in _triple(t, stage)))


def _triple(t: dict[str, float], stage: str) -> tuple[float | None, float | None, float | None]:
    """(serial ms, grouped ms, speedup) of a stage, None where it was not run."""
    s, g = t.get(f"serial_{stage}"), t.get(f"grouped_{stage}")
    if s is None or g is None:
        return None, None, None
    return round(s, 2), round(g, 2), round(s / g, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, tenants=4, batch=2)
    p.add_argument("--frozen", type=int, default=0, help="of the tenants, how many are frozen-base mlp tenants")
    p.add_argument("--width", type=int, default=64, help="expert hidden size")
    p.add_argument("--depth", type=int, default=0, help="expert layers (0: the base's text layers)")
    p.add_argument("--euler-steps", type=int, default=10)
    p.add_argument("--stages", type=lambda v: v.split(","), default=["cache", "infer", "train", "experts"],
                   help="comma-separated: cache, infer, train, experts (the heads alone on precomputed features)")
    args = p.parse_args(argv)
    if not 0 <= args.frozen < args.tenants:
        p.error(f"--frozen={args.frozen}: allowed 0..{args.tenants - 1} (at least one expert)")
    emit(asdict(run(args)), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
