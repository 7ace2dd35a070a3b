"""Group-batching benchmark: one grouped base forward for many tenants vs one per tenant.

    python -m bench.group_batching                                   # tiny preset, CPU, full grid
    python -m bench.group_batching --preset qwen3-vl-4b --device cuda --fast \
        --tenants 8 --batch 4 --heads mlp,flow --eager-serial --json bench/results/h200.json

For every (head, tenants, local batch) row it times, on pre-built canonical batches already on
the device (preprocessing excluded):
  base     the base forward only: serial (one encode per tenant) vs grouped (one encode);
  stage    the forward stage: base + every tenant's head loss + head backward (no optimizer step).
Tenants alternate LIBERO-like and CALVIN-like schemas (2 cameras -> two 224x224 slots, ~30
instruction tokens). Times are medians over --repeats after --warmup runs; CUDA is synchronized
around each timed region. `--eager-serial` adds the serial times of the plain transformers
forward (same weights) as a second baseline when --fast is on. One JSON record per row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Runnable as a file too (`python bench/group_batching.py`): the repo root holds `models`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from models import BaseConfig, BaseModel, TenantSlot, encode_grouped, encode_serial, forward_backward  # noqa: E402
from models.heads import TenantBatch  # noqa: E402
from models.testing import calvin_schema, libero_schema, random_batch  # noqa: E402
from models.schema import TenantSchema  # noqa: E402

# Bench prompts: the instruction alone, capped at 32 tokens (~30 in the workload).
PROMPT_TOKENS = 32


@dataclass
class Row:
    preset: str
    device: str
    dtype: str
    engine: str
    head: str
    tenants: int
    batch: int
    samples: int
    serial_base_ms: float
    grouped_base_ms: float
    base_speedup: float
    serial_stage_ms: float
    grouped_stage_ms: float
    stage_speedup: float
    serial_samples_per_s: float
    grouped_samples_per_s: float
    serial_eager_base_ms: float | None = None
    serial_eager_stage_ms: float | None = None
    stage_speedup_vs_eager_serial: float | None = None


def engine(args: argparse.Namespace) -> str:
    return ("fast+compile" if args.compile else "fast") if args.fast else "eager"


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def bench_schema(i: int) -> TenantSchema:
    s = libero_schema() if i % 2 == 0 else calvin_schema()
    return TenantSchema(cameras=s.cameras, state_dim=s.state_dim, action_dim=s.action_dim,
                        action_horizon=s.action_horizon, instruction_template="{instruction}")


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-qwen3-vl")
    ap.add_argument("--tenants", type=_ints, default=[2, 4, 6, 8])
    ap.add_argument("--batch", type=_ints, default=[1, 2, 4, 8])
    ap.add_argument("--heads", default="mlp,flow")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--fast", action="store_true", help="optimized encode (batched vision attention, CUDA graphs)")
    ap.add_argument("--compile", action="store_true", help="with --fast: torch.compile vision blocks and decoder layers")
    ap.add_argument("--eager-serial", action="store_true", help="also time serial with the plain transformers forward")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs per measurement (default 0 on cpu, 1 on cuda)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps 2-core hosts responsive)")
    ap.add_argument("--check", action="store_true", help="first compare fast vs eager hidden states (rel. error)")
    ap.add_argument("--json", default=None, help="write one record per row to this path")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    cfg = BaseConfig(args.preset, device=args.device, dtype=args.dtype, image_size=args.image_size,
                     max_prompt_tokens=PROMPT_TOKENS, fast=args.fast, compile=args.compile)
    t0 = time.perf_counter()
    base = BaseModel.load(cfg)
    print(f"# loaded {args.preset} on {base.device} ({base.dtype}) in {time.perf_counter() - t0:.1f}s, "
          f"{base.num_parameters() / 1e9:.2f}B params, engine={engine(args)}", flush=True)
    eager = None
    if args.eager_serial and args.fast:
        eager = BaseModel(base.core, base.family, base.tokenizer, base.lead_ids, base.base_id, base.device,
                          base.dtype, fast=False)
    dev = base.device
    if args.check and eager is not None:
        check_fast(base, eager)
    rows: list[Row] = []
    for head in args.heads.split(","):
        for n in args.tenants:
            slots = [TenantSlot.create(f"t{i}", bench_schema(i), base, head_kind=head, seed=i) for i in range(n)]
            for b in args.batch:
                items = []
                for i, s in enumerate(slots):
                    tb = random_batch(s.preprocessor, b, seed=100 * i + b)
                    items.append((s, TenantBatch(tb.features.to(dev), tb.actions_B_H_A.to(dev))))
                vlas = [tb.features for _, tb in items]
                # The median of 3 already drops a slow first run; on CPU a warm-up only costs time.
                w, r = (args.warmup if args.warmup is not None else int(dev.type == "cuda")), args.repeats
                sb = time_ms(lambda: encode_serial(base, vlas), dev, w, r)
                gb = time_ms(lambda: encode_grouped(base, vlas), dev, w, r)
                ss = time_ms(lambda: forward_backward(base, items, grouped=False), dev, w, r)
                gs = time_ms(lambda: forward_backward(base, items, grouped=True), dev, w, r)
                row = Row(args.preset, str(dev), str(base.dtype).removeprefix("torch."),
                          engine(args), head, n, b, n * b, sb, gb, sb / gb, ss, gs, ss / gs,
                          n * b / ss * 1e3, n * b / gs * 1e3)
                if eager is not None:
                    row.serial_eager_base_ms = time_ms(lambda: encode_serial(eager, vlas), dev, w, r)
                    row.serial_eager_stage_ms = time_ms(lambda: forward_backward(eager, items, grouped=False), dev, w, r)
                    row.stage_speedup_vs_eager_serial = row.serial_eager_stage_ms / gs
                rows.append(row)
                print_row(row, header=len(rows) == 1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
        print(f"# wrote {len(rows)} records to {args.json}")
    return rows


def check_fast(fast: BaseModel, eager: BaseModel) -> None:
    """Relative error of the fast encode against the transformers forward, on real tokens."""
    s = TenantSlot.create("check", bench_schema(0), fast, seed=0)
    vla = random_batch(s.preprocessor, 4, seed=0).features.to(fast.device)
    a, b = eager.encode(vla), fast.encode(vla)
    m = a.mask_B_L
    ha, hb = a.hidden_B_L_D[m].float(), b.hidden_B_L_D[m].float()
    qa, qb = a.query_B_Q_D.float(), b.query_B_Q_D.float()
    # Noise floor of the dtype: the same eager forward, one sample at a time instead of four.
    c = torch.cat([eager.encode(vla.index(slice(i, i + 1))).query_B_Q_D for i in range(4)]).float()
    print(f"# check fast vs eager ({fast.dtype}): hidden rel err {float((ha - hb).norm() / ha.norm()):.2e}, "
          f"query rel err {float((qa - qb).norm() / qa.norm()):.2e}, masks equal {bool(torch.equal(a.mask_B_L, b.mask_B_L))}; "
          f"eager batch-4 vs batch-1 query rel err {float((qa - c).norm() / qa.norm()):.2e}", flush=True)


def print_row(r: Row, header: bool) -> None:
    cols = f"{'head':>5} {'ten':>3} {'b':>2} {'smp':>4} | {'base ser':>9} {'base grp':>9} {'x':>5} | " \
           f"{'stage ser':>9} {'stage grp':>9} {'x':>5} | {'smp/s ser':>9} {'smp/s grp':>9}"
    if header:
        print(cols + (" | eager-ser stage  x" if r.serial_eager_stage_ms is not None else ""))
    line = (f"{r.head:>5} {r.tenants:>3} {r.batch:>2} {r.samples:>4} | {r.serial_base_ms:9.1f} {r.grouped_base_ms:9.1f} "
            f"{r.base_speedup:5.2f} | {r.serial_stage_ms:9.1f} {r.grouped_stage_ms:9.1f} {r.stage_speedup:5.2f} | "
            f"{r.serial_samples_per_s:9.1f} {r.grouped_samples_per_s:9.1f}")
    if r.serial_eager_stage_ms is not None:
        line += f" | {r.serial_eager_stage_ms:9.1f} {r.stage_speedup_vs_eager_serial:5.2f}"
    print(line, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
