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
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from models import BaseConfig, BaseModel, TenantSlot, encode_grouped, encode_serial, forward_backward  # noqa: E402
from models.lora import AdapterConfig  # noqa: E402
from models.testing import calvin_schema, libero_schema, random_batch  # noqa: E402


@dataclass
class Row:
    preset: str
    device: str
    tenants: int
    frozen: int
    batch: int
    rank: int
    targets: str
    serial_infer_ms: float
    grouped_infer_ms: float
    infer_speedup: float
    serial_train_ms: float
    grouped_train_ms: float
    train_speedup: float


def _time(fn, device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(args: argparse.Namespace) -> Row:
    base = BaseModel.load(BaseConfig(args.preset, device=args.device))
    adapter = AdapterConfig(rank=args.rank, alpha=2.0 * args.rank, target_modules=tuple(args.targets.split(",")))
    slots = []
    for i in range(args.tenants):
        schema = libero_schema() if i % 2 == 0 else calvin_schema()
        slots.append(TenantSlot.create(f"t{i}", schema, base, head_kind="mlp", seed=i,
                                       adapter=None if i >= args.tenants - args.frozen else adapter))
    batches = [random_batch(s.preprocessor, args.batch, seed=i) for i, s in enumerate(slots)]
    for b in batches:
        b.features = b.features.to(base.device)
    vlas = [b.features for b in batches]
    items = list(zip(slots, batches))

    def infer(grouped: bool):
        with torch.inference_mode():
            return (encode_grouped(base, vlas, inference=True, slots=slots) if grouped
                    else encode_serial(base, vlas, inference=True, slots=slots))

    times = {}
    for grouped in (False, True):
        name = "grouped" if grouped else "serial"
        times[f"{name}_infer"] = _time(lambda: infer(grouped), base.device, args.warmup, args.repeats)
        times[f"{name}_train"] = _time(lambda: forward_backward(base, items, grouped=grouped), base.device,
                                       args.warmup, args.repeats)
    return Row(args.preset, str(base.device), args.tenants, args.frozen, args.batch, args.rank, args.targets,
               round(times["serial_infer"], 2), round(times["grouped_infer"], 2),
               round(times["serial_infer"] / times["grouped_infer"], 2),
               round(times["serial_train"], 2), round(times["grouped_train"], 2),
               round(times["serial_train"] / times["grouped_train"], 2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-qwen3-vl-64")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--frozen", type=int, default=0, help="of the tenants, how many have no adapter")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="write the row here")
    args = p.parse_args(argv)
    if not 0 <= args.frozen <= args.tenants:
        p.error(f"--frozen={args.frozen}: allowed 0..{args.tenants}")
    row = run(args)
    d = asdict(row)
    print(" | ".join(f"{k}" for k in d))
    print(" | ".join(f"{v}" for v in d.values()))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(d, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
