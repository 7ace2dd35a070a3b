"""Where an action expert's grouped Euler loop spends its time, and what each lever buys
(issue 27 item 2: grouped expert `predict` at 8 tenants x 4 rows, 10 steps, <= 250 ms).

    python -m bench.expert_profile --tenants 4 --batch 2 --variants fp32,compile --profile   # CPU smoke
    python -m bench.expert_profile --preset qwen3-vl-4b --device cuda --tenants 8 --batch 4 --width 256 \
        --euler-steps 10 --variants fp32,tf32,compile,compile+tf32 --profile --json $OUT/expert_profile.json

The base's cache forward runs once on the fast engine (its time is `bench.expert_group`'s);
here only the heads' part of a grouped `predict` (`models.group.predict_heads`): each bucket of
equal-shaped experts loads its inputs into fixed buffers (`EulerBucket.load`: the stacked
weights, restacked only when a tenant's weights changed, the prefix KV copied in float32, the
mask) and runs the Euler loop (`EulerBucket.run`: a CUDA graph replay on CUDA). Per variant
(`models.heads.expert.EulerOptions`: `tf32` matmuls, `compile`d layer math), medians over
--repeats after --warmup:

  capture_s         the first call of every bucket (warm-up, compile, graph capture)
  heads_ms          `predict_heads` as a grouped predict runs it (noise, load, run)
  load_ms           the buckets' loads with unchanged weights (the weights not restacked)
  load_restack_ms   the same, weights restacked (what every call paid before)
  run_ms            the loops alone; run_step_ms = run_ms / euler steps
  max_abs_diff      max |actions - the fp32 variant's actions| from the same noise

`--profile`: one eager (uncaptured) loop of the first variant under torch.profiler: device
kernels by kind (matmul, attention, elementwise / reduction, copy), their count and time per
Euler step, the ten costliest kernels; on CUDA also one graph replay (its kernels' summed time
against its wall time: the gap is what launches inside the graph cost). Prints tables, writes
one JSON record.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.tenant_group import add_common_args, build, time_ms  # noqa: E402
from models.fast import FastQwen3VLEncoder  # noqa: E402
from models.group import predict_heads  # noqa: E402
from models.heads.base import randn  # noqa: E402
from models.heads.expert import EulerBucket, EulerOptions, set_euler_options  # noqa: E402

VARIANTS = {name: EulerOptions.parse(name) for name in ("fp32", "tf32", "compile", "compile+tf32")}


def _buckets(slots: list, vlas: list, feats: list) -> list[tuple[list, list, list, list]]:
    """The group's experts split as `predict_heads` splits them: (heads, feats, vlas, slots) per key."""
    by_key: dict[Any, list[int]] = defaultdict(list)
    for j, (s, f) in enumerate(zip(slots, feats)):
        by_key[s.head.batch_key(f)].append(j)
    return [([slots[j].head for j in idx], [feats[j] for j in idx], [vlas[j] for j in idx], [slots[j] for j in idx])
            for idx in by_key.values()]


def _kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "bmm", "matmul", "addmm", "mm_")):
        return "matmul"
    if any(k in n for k in ("fmha", "attention", "flash", "sdpa", "softmax")):
        return "attention"
    if any(k in n for k in ("memcpy", "memset", "copy", "cat", "stack")):
        return "copy"
    return "elementwise/reduction"


def _kernel_table(prof: Any, cuda: bool, steps: int) -> dict[str, Any]:
    """Kernels (CUDA) or aten ops (CPU) by kind: count and ms per Euler step, and the top ten."""
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if cuda:
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        else:
            if not ev.name.startswith("aten::"):
                continue
            us = ev.self_cpu_time_total  # self time: an op's children count once, as themselves
        per_name[ev.name][0] += 1
        per_name[ev.name][1] += us
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, (n, us) in per_name.items():
        kinds[_kind(name)][0] += n
        kinds[_kind(name)][1] += us
    total_us = sum(us for _, us in per_name.values())
    top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:10]
    return {
        "kernels_per_step": round(sum(n for n, _ in per_name.values()) / steps, 1),
        "kernel_ms_per_step": round(total_us / steps / 1e3, 3),
        "by_kind": {k: {"count_per_step": round(n / steps, 1), "ms_per_step": round(us / steps / 1e3, 3)}
                    for k, (n, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1])},
        "top10": [{"name": name[:120], "count": int(n), "ms_total": round(us / 1e3, 3)} for name, (n, us) in top],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    options = {"width": args.width, "euler_steps": args.euler_steps}
    if args.depth:
        options["depth"] = args.depth
    group = build(args, lambda i: {"head_kind": "expert", "head_options": options})
    base, slots, vlas = group.base, group.slots, group.vlas
    dev = base.device
    cuda = dev.type == "cuda"
    base._fast = FastQwen3VLEncoder(base)  # the cache forward as the service runs it
    feats = group.encode(True)
    buckets = _buckets(slots, vlas, feats)
    pairs = list(zip(slots, vlas))
    h = slots[0].head
    # Fixed noise per bucket: every variant samples from the same x0.
    x0s = [torch.stack([randn((len(f), h.dims.action_horizon, h.dims.action_dim), s.generator, dev)
                        for s, f in zip(sl, fe)]) for _, fe, _, sl in buckets]
    record: dict[str, Any] = {"preset": args.preset, "device": str(dev), "tenants": args.tenants, "batch": args.batch,
                              "width": args.width, "depth": len(h.layers), "euler_steps": args.euler_steps,
                              "buckets": [len(b[0]) for b in buckets], "variants": {}}

    def load_all(restack: bool) -> list[EulerBucket]:
        out = []
        for (heads, fe, vl, _), x0 in zip(buckets, x0s):
            bucket = EulerBucket.get(heads[0], len(heads), fe[0], states=bool(heads[0].dims.state_dim))
            if restack:
                bucket._src = []
            with torch.inference_mode(False), torch.no_grad():
                bucket.load(heads, fe, vl, x0)
            out.append(bucket)
        return out

    def run_all(bs: list[EulerBucket]) -> list[torch.Tensor]:
        with torch.inference_mode(False), torch.no_grad():
            return [b.run(heads[0]) for b, (heads, *_rest) in zip(bs, buckets)]

    reference = None
    for name in args.variants:
        set_euler_options(VARIANTS[name])
        EulerBucket._cache.clear()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        acts = run_all(load_all(restack=True))
        if cuda:
            torch.cuda.synchronize(dev)
        capture_s = time.perf_counter() - t0
        acts = [a.float().cpu() for a in run_all(load_all(restack=False))]
        reference = reference or acts
        bs = load_all(restack=False)
        row = {
            "capture_s": round(capture_s, 2),
            "heads_ms": round(time_ms(lambda: predict_heads(pairs, feats), dev, args.warmup, args.repeats), 2),
            "load_ms": round(time_ms(lambda: load_all(False), dev, args.warmup, args.repeats), 2),
            "load_restack_ms": round(time_ms(lambda: load_all(True), dev, args.warmup, args.repeats), 2),
            "run_ms": round(time_ms(lambda: run_all(bs), dev, args.warmup, args.repeats), 2),
            "max_abs_diff": float(max((a - r).abs().max() for a, r in zip(acts, reference))),
        }
        row["run_step_ms"] = round(row["run_ms"] / args.euler_steps, 3)
        record["variants"][name] = row
        print(f"{name:>14}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    if args.profile:
        record["profile"] = _profile(args, buckets, x0s, cuda, dev)
    set_euler_options(EulerOptions())
    return record


def _profile(args: argparse.Namespace, buckets: list, x0s: list, cuda: bool, dev: torch.device) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    set_euler_options(VARIANTS[args.variants[0]])
    EulerBucket._cache.clear()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out: dict[str, Any] = {"variant": args.variants[0]}
    eager = []
    for heads, fe, vl, _ in buckets:
        b = EulerBucket(heads[0], len(heads), len(fe[0]), fe[0].mask_B_L.shape[1], bool(heads[0].dims.state_dim),
                        VARIANTS[args.variants[0]])
        b.use_graph = False  # the loop's kernels one by one
        eager.append(b)
    with torch.inference_mode(False), torch.no_grad():
        for b, (heads, fe, vl, _), x0 in zip(eager, buckets, x0s):
            b.load(heads, fe, vl, x0)
        for b, (heads, *_r) in zip(eager, buckets):
            b.run(heads[0])  # warm
        if cuda:
            torch.cuda.synchronize(dev)
        with profile(activities=activities) as prof:
            for b, (heads, *_r) in zip(eager, buckets):
                b.run(heads[0])
            if cuda:
                torch.cuda.synchronize(dev)
    out["eager"] = _kernel_table(prof, cuda, args.euler_steps)
    if cuda:
        graphs = []
        with torch.inference_mode(False), torch.no_grad():
            for (heads, fe, vl, _), x0 in zip(buckets, x0s):
                b = EulerBucket.get(heads[0], len(heads), fe[0], states=bool(heads[0].dims.state_dim))
                b.load(heads, fe, vl, x0)
                b.run(heads[0])
                graphs.append(b)
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            with profile(activities=activities) as prof:
                for b, (heads, *_r) in zip(graphs, buckets):
                    b.run(heads[0])
                torch.cuda.synchronize(dev)
            wall = time.perf_counter() - t0
        out["replay"] = _kernel_table(prof, cuda, args.euler_steps)
        out["replay"]["wall_ms_per_step_profiled"] = round(wall * 1e3 / args.euler_steps, 3)
    for part in ("eager", "replay"):
        if part in out:
            t = out[part]
            print(f"\n{part}: {t['kernels_per_step']} kernels / step, {t['kernel_ms_per_step']} ms of kernels / step")
            print("| kind | per step | ms / step |\n|---|---:|---:|")
            for k, v in t["by_kind"].items():
                print(f"| {k} | {v['count_per_step']} | {v['ms_per_step']} |")
            print("top: " + "; ".join(f"{e['name'][:60]} x{e['count']} {e['ms_total']} ms" for e in t["top10"][:5]))
    return out


def main(argv: list[str] | None = None) -> int:
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, tenants=4, batch=2)
    p.add_argument("--width", type=int, default=64, help="expert hidden size")
    p.add_argument("--depth", type=int, default=0, help="expert layers (0: the base's text layers)")
    p.add_argument("--euler-steps", type=int, default=10)
    p.add_argument("--variants", type=lambda v: v.split(","), default=["fp32", "compile"],
                   help=f"comma-separated, the first is the reference: {', '.join(VARIANTS)}")
    p.add_argument("--profile", action="store_true", help="kernel tables of one loop (eager; on CUDA a replay too)")
    args = p.parse_args(argv)
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        p.error(f"--variants: unknown {bad}; allowed: {', '.join(VARIANTS)}")
    record = run(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
