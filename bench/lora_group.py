"""Mixed-LoRA benchmark: grouped vs serial, and the fast engine's LoRA group vs its frozen base.

N tenants, each with its own adapter, in one grouped base forward vs one forward per tenant
(models/lora.py's segmented LoRA), and on the fast engine (the adapter pool, models/fast.py)
against the frozen-base fast forward of the same rows.

    python -m bench.lora_group                                          # tiny preset, CPU
    python -m bench.lora_group --preset qwen3-vl-4b --device cuda --tenants 8 --batch 4 \
        --rank 8 --targets q_proj,k_proj,v_proj,o_proj --compile --json bench/results/lora_h200.json

Per row, on canonical batches already on the device (preprocessing excluded), medians over
--repeats after --warmup runs, CUDA synchronized around each timed region:
  infer   plain base forward with every tenant's adapter (inference_mode): serial vs grouped;
  train   forward + every tenant's head loss + one backward into heads and adapters (no
          optimizer step): serial vs grouped on the plain path (segmented hooks), and the
          grouped step on the fast engine (`train_forward`: uncaptured, the tenants' own A and
          B stacked inside the autograd graph; compiled blocks with --compile) beside the same
          rows' frozen-base step on that engine (heads only), with the largest gradient
          difference against the plain path (relative to each gradient's largest entry) and
          the smallest cosine between the two, beside the frozen group's own head-gradient
          difference (fast vs plain forward: what the engine's rounding alone does);
  fast    the grouped inference forward on the fast engine (CUDA graphs on CUDA): the mixed-LoRA
          group vs the same rows with no adapter (frozen base), and their ratio (issue 27's
          target: <= 1.15); with --compile the same on the compiled engine;
  diff    max |fast-LoRA - plain-LoRA| over every tenant's valid positions, beside the same
          figure for the frozen base (fast vs plain) as its yardstick, and the fast-LoRA rows
          against each tenant's own fast forward (grouped == serial).
`--frozen K` makes the last K tenants frozen-base (no adapter); `--ranks 8,4,16` gives the
adapted tenants these ranks in turn (default: all --rank). One JSON record per row.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.tenant_group import GroupRow, add_common_args, build, emit, time_ms  # noqa: E402
from models import TenantSlot, encode_grouped, encode_serial, forward_backward  # noqa: E402
from models.fast import FastQwen3VLEncoder  # noqa: E402
from models.lora import AdapterConfig  # noqa: E402


@dataclass
class Row(GroupRow):
    rank: int
    ranks: str
    targets: str
    serial_infer_ms: float
    grouped_infer_ms: float
    infer_speedup: float
    serial_train_ms: float
    grouped_train_ms: float
    train_speedup: float
    frozen_fast_ms: float
    lora_fast_ms: float
    fast_ratio: float
    frozen_compiled_ms: float | None
    lora_compiled_ms: float | None
    compiled_ratio: float | None
    max_abs_diff_lora_fast_vs_plain: float
    max_abs_diff_frozen_fast_vs_plain: float
    max_abs_diff_lora_fast_grouped_vs_serial: float
    pool_fallbacks: int
    frozen_train_fast_ms: float
    lora_train_fast_ms: float
    frozen_train_compiled_ms: float | None
    lora_train_compiled_ms: float | None
    train_fast_speedup: float  # plain grouped train / the fast engine's (the compiled one's with --compile)
    max_rel_grad_diff_train_fast_vs_plain: float
    min_cos_grad_train_fast_vs_plain: float  # over every trainable tensor of the adapted group
    max_rel_grad_diff_frozen_train_fast_vs_plain: float  # the yardstick: heads of a frozen-base group


def _max_diff(outs: list, refs: list) -> float:
    d = 0.0
    for o, r in zip(outs, refs, strict=True):
        m = r.mask_B_L
        d = max(d, float((o.hidden_B_L_D[m].float() - r.hidden_B_L_D[m].float()).abs().max()))
    return d


def run(args: argparse.Namespace) -> Row:
    targets = tuple(args.targets.split(","))
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else [args.rank]
    adapted = args.tenants - args.frozen
    adapters = [AdapterConfig(rank=ranks[i % len(ranks)], alpha=2.0 * ranks[i % len(ranks)], target_modules=targets)
                for i in range(adapted)]
    group = build(args, lambda i: {"head_kind": "mlp", "adapter": adapters[i] if i < adapted else None})
    base = group.base
    base.lora_pool_size = max(base.lora_pool_size, args.tenants)
    vlas, slots = group.vlas, group.slots

    def lora(grouped: bool = True) -> list:
        with torch.inference_mode():
            return (encode_grouped(base, vlas, inference=True, slots=slots) if grouped
                    else encode_serial(base, vlas, inference=True, slots=slots))

    def frozen() -> list:
        with torch.inference_mode():
            return encode_grouped(base, vlas, inference=True)

    frozen_slots = [TenantSlot.create(f"f{i}", s.schema, base, seed=i, head_kind="mlp")
                    for i, s in enumerate(slots)]
    frozen_items = list(zip(frozen_slots, group.batches))

    def train(items: list) -> None:
        forward_backward(base, items, grouped=True)

    def grads(of: list | None = None) -> list:
        return [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
                for s in (slots if of is None else of) for _, p in s.named_trainable()]

    def rel_diff(got: list, ref: list) -> float:
        return max(float((g - r).abs().max()) / max(float(r.abs().max()), 1e-12) for g, r in zip(got, ref))

    times = {}
    for grouped in (False, True):  # the plain path (base._fast is None: the engines come below)
        name = "grouped" if grouped else "serial"
        times[f"{name}_infer"] = time_ms(lambda: group.encode(grouped), base.device, args.warmup, args.repeats)
        times[f"{name}_train"] = time_ms(lambda: forward_backward(base, group.items, grouped=grouped), base.device,
                                         args.warmup, args.repeats)
    plain_lora, plain_frozen = lora(), frozen()
    train(group.items)
    plain_grads = grads()
    train(frozen_items)
    plain_frozen_grads = grads(frozen_slots)
    engines = [("fast", FastQwen3VLEncoder(base))]
    if args.compile:
        engines.append(("compiled", FastQwen3VLEncoder(base, compile=True)))
    diffs = {}
    fallbacks = 0
    for name, engine in engines:
        base._fast = engine
        try:
            times[f"frozen_{name}"] = time_ms(frozen, base.device, args.warmup, args.repeats)
            times[f"lora_{name}"] = time_ms(lora, base.device, args.warmup, args.repeats)
            if name == "fast":
                out = lora()
                diffs["lora"] = _max_diff(out, plain_lora)
                diffs["frozen"] = _max_diff(frozen(), plain_frozen)
                diffs["serial"] = _max_diff(out, lora(grouped=False))
            times[f"frozen_train_{name}"] = time_ms(lambda: train(frozen_items), base.device, args.warmup,
                                                    args.repeats)
            times[f"lora_train_{name}"] = time_ms(lambda: train(group.items), base.device, args.warmup,
                                                  args.repeats)
            if name == "fast":
                train(group.items)
                got = grads()
                diffs["grad"] = rel_diff(got, plain_grads)
                diffs["cos"] = min(float(torch.nn.functional.cosine_similarity(g.flatten(), r.flatten(), dim=0))
                                   for g, r in zip(got, plain_grads) if float(r.abs().max()) > 0)
                train(frozen_items)
                diffs["frozen_grad"] = rel_diff(grads(frozen_slots), plain_frozen_grads)
            fallbacks += engine.lora_pool.fallbacks if engine.lora_pool is not None else 0
        finally:
            base._fast = None
    r2 = lambda x: round(x, 2)  # noqa: E731
    comp = args.compile
    return Row(args.preset, str(base.device), args.tenants, args.frozen, args.batch, args.rank,
               ",".join(map(str, ranks)), args.targets,
               r2(times["serial_infer"]), r2(times["grouped_infer"]), r2(times["serial_infer"] / times["grouped_infer"]),
               r2(times["serial_train"]), r2(times["grouped_train"]), r2(times["serial_train"] / times["grouped_train"]),
               r2(times["frozen_fast"]), r2(times["lora_fast"]), round(times["lora_fast"] / times["frozen_fast"], 3),
               r2(times["frozen_compiled"]) if comp else None, r2(times["lora_compiled"]) if comp else None,
               round(times["lora_compiled"] / times["frozen_compiled"], 3) if comp else None,
               diffs["lora"], diffs["frozen"], diffs["serial"], fallbacks,
               r2(times["frozen_train_fast"]), r2(times["lora_train_fast"]),
               r2(times["frozen_train_compiled"]) if comp else None, r2(times["lora_train_compiled"]) if comp else None,
               r2(times["grouped_train"] / times["lora_train_compiled" if comp else "lora_train_fast"]),
               diffs["grad"], diffs["cos"], diffs["frozen_grad"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, tenants=8, batch=4)
    p.add_argument("--frozen", type=int, default=0, help="of the tenants, how many have no adapter")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--ranks", default="", help="comma-separated ranks the adapted tenants take in turn "
                   "(default: all --rank)")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--compile", action="store_true", help="also time the compiled fast engine (compiles first)")
    args = p.parse_args(argv)
    if not 0 <= args.frozen <= args.tenants:
        p.error(f"--frozen={args.frozen}: allowed 0..{args.tenants}")
    try:
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else [args.rank]
    except ValueError:
        p.error(f"--ranks={args.ranks!r}: comma-separated integers >= 1")
    if any(r < 1 for r in ranks):
        p.error(f"--ranks={args.ranks!r}: every rank must be >= 1")
    emit(asdict(run(args)), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
