"""Mixed-LoRA benchmark: N tenants, each with its own adapter, in one grouped base forward vs
one forward per tenant (models/lora.py's segmented LoRA).

    python -m bench.lora_group                                          # tiny preset, CPU
    python -m bench.lora_group --preset qwen3-vl-4b --device cuda --tenants 8 --batch 4 \
        --rank 8 --targets q_proj,k_proj,v_proj,o_proj --json bench/results/lora_h200.json

Per row, on canonical batches already on the device (preprocessing excluded), medians over
--repeats after --warmup runs, CUDA synchronized around each timed region:
  infer   base forward with every tenant's adapter (inference_mode): serial vs grouped;
  train   forward + every tenant's head loss + one backward into heads and adapters (no
          optimizer step): serial vs grouped.
`--frozen K` makes the last K tenants frozen-base (no adapter) to show what they pay.
One JSON record per row.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tenant_group import GroupRow, add_common_args, build, emit, time_ms  # noqa: E402
from models import forward_backward  # noqa: E402
from models.lora import AdapterConfig  # noqa: E402


@dataclass
class Row(GroupRow):
    rank: int
    targets: str
    serial_infer_ms: float
    grouped_infer_ms: float
    infer_speedup: float
    serial_train_ms: float
    grouped_train_ms: float
    train_speedup: float


def run(args: argparse.Namespace) -> Row:
    adapter = AdapterConfig(rank=args.rank, alpha=2.0 * args.rank, target_modules=tuple(args.targets.split(",")))
    group = build(args, lambda i: {"head_kind": "mlp",
                                   "adapter": None if i >= args.tenants - args.frozen else adapter})
    base = group.base
    times = {}
    for grouped in (False, True):
        name = "grouped" if grouped else "serial"
        times[f"{name}_infer"] = time_ms(lambda: group.encode(grouped), base.device, args.warmup, args.repeats)
        times[f"{name}_train"] = time_ms(lambda: forward_backward(base, group.items, grouped=grouped), base.device,
                                         args.warmup, args.repeats)
    return Row(args.preset, str(base.device), args.tenants, args.frozen, args.batch, args.rank, args.targets,
               round(times["serial_infer"], 2), round(times["grouped_infer"], 2),
               round(times["serial_infer"] / times["grouped_infer"], 2),
               round(times["serial_train"], 2), round(times["grouped_train"], 2),
               round(times["serial_train"] / times["grouped_train"], 2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, tenants=8, batch=4)
    p.add_argument("--frozen", type=int, default=0, help="of the tenants, how many have no adapter")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    args = p.parse_args(argv)
    if not 0 <= args.frozen <= args.tenants:
        p.error(f"--frozen={args.frozen}: allowed 0..{args.tenants}")
    emit(asdict(run(args)), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
