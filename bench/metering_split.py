"""How far the metering rule (a grouped step's busy time split by rows) is from each tenant's
true cost: the shared base forward split by rows plus the tenant's own head work.

    python -m bench.metering_split                                    # tiny preset, CPU
    python -m bench.metering_split --preset qwen3-vl-4b --device cuda --rows 1,4,16 \
        --json bench/results/metering_split_h200.json

For each head kind, tenants with the given rows each share one grouped training step. Timed
(medians over --repeats, CUDA synchronized): the grouped base forward, and each tenant's
private part (head loss, backward, AdamW step) alone. "true" charge of tenant i = base * r_i / R
+ private_i; "rows" charge = (base + sum private) * r_i / R (what the trainer charges). The
table prints both and the relative error of the rows rule; the per-tenant charges of both add
up to the same step time. One JSON record per (head, tenant).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.group_batching import PROMPT_TOKENS, bench_schema  # noqa: E402
from models import BaseConfig, BaseModel, TenantSlot, encode_grouped  # noqa: E402
from models.heads import TenantBatch  # noqa: E402
from models.testing import random_batch  # noqa: E402


@dataclass
class Row:
    preset: str
    device: str
    head: str
    tenant: int
    rows: int
    base_ms: float  # the grouped base forward (all tenants)
    private_ms: float  # this tenant's head loss + backward + optimizer step
    true_ms: float
    rows_rule_ms: float
    rel_error: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny-qwen3-vl")
    ap.add_argument("--rows", default="1,2,3", help="rows of each tenant in the grouped step")
    ap.add_argument("--heads", default="mlp,flow,gaussian")
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = BaseModel.load(BaseConfig(args.preset, device=args.device, max_prompt_tokens=PROMPT_TOKENS))
    dev = base.device
    rows_per = [int(x) for x in args.rows.split(",")]
    out: list[Row] = []
    print(f"# {args.preset} on {dev}; rows {rows_per}")
    print(f"{'head':>8} {'ten':>3} {'rows':>4} | {'base ms':>8} {'priv ms':>8} | {'true ms':>8} {'rows ms':>8} {'err':>7}")
    for head in args.heads.split(","):
        slots = [TenantSlot.create(f"t{i}", bench_schema(0), base, head_kind=head, seed=i) for i in range(len(rows_per))]
        items = []
        for i, (s, r) in enumerate(zip(slots, rows_per)):
            tb = random_batch(s.preprocessor, r, seed=i)
            items.append((s, TenantBatch(tb.features.to(dev), tb.actions_B_H_A.to(dev))))
        vlas = [b.features for _, b in items]
        feats = encode_grouped(base, vlas)
        timed(lambda: encode_grouped(base, vlas), dev, 2)  # warm-up

        def private(i: int) -> None:
            slot, batch = items[i]
            slot.zero_grad()
            slot.head.loss(feats[i], batch, slot.generator).loss.backward()
            slot.optimizer_step()

        for i in range(len(items)):
            timed(lambda i=i: private(i), dev, 2)  # warm-up
        base_ms = timed(lambda: encode_grouped(base, vlas), dev, args.repeats)
        priv = [timed(lambda i=i: private(i), dev, args.repeats) for i in range(len(items))]
        step_ms, total_rows = base_ms + sum(priv), sum(rows_per)
        for i, r in enumerate(rows_per):
            true = base_ms * r / total_rows + priv[i]
            rule = step_ms * r / total_rows
            row = Row(args.preset, str(dev), head, i, r, base_ms, priv[i], true, rule, (rule - true) / true)
            out.append(row)
            print(f"{head:>8} {i:>3} {r:>4} | {base_ms:8.2f} {priv[i]:8.2f} | {true:8.2f} {rule:8.2f} {row.rel_error:+7.1%}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([asdict(r) for r in out], indent=1))
        print(f"# wrote {len(out)} records to {args.json}")
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
