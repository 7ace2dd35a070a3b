"""Where the fast engine's grouped forward spends its time (H200 profiling, issue 17 item 5).

    python3 -m bench.fast_profile --preset qwen3-vl-4b --tenants 8 --batch 4 --json $OUT/profile.json

For each engine variant (`--variants`, e.g. `compile,compile+fused`) on one grouped batch of
tenants x batch rows (bench/group_batching.py's workload): the CUDA-graph replay time (median),
the relative error of its hidden states against the plain transformers forward on the same rows
(the numerics check), and per-stage times of one uncaptured forward (CUDA events at the engine's
stage ends: inputs, patch embed, vision blocks + mergers, token embedding, decoder layers). For
the last variant, torch.profiler's kernel table of one uncaptured forward, summed by kind
(matmul, attention, conv, fused elementwise, other). `+fp8` variants (CUDA sm89+ only) run the
big linears as FP8 matmuls (issue 27 item 3; `+fp8row`: row-wise scales, `...dec`: decoder
only); every variant also reports its error against the
first variant's hidden states (`rel_err_vs_first`: the FP8 cost against the bf16 fast path).
`--micro` adds the matmul shapes of one forward timed alone (the reachable floor) and the attention kernels at the text shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.group_batching import PROMPT_TOKENS, bench_schema  # noqa: E402
from models import BaseConfig, BaseModel, TenantSlot, VLABatch  # noqa: E402
from models.fast import FastQwen3VLEncoder  # noqa: E402
from models.testing import random_batch  # noqa: E402


class _HostEvent:
    """torch.cuda.Event's interface on the host clock: the CPU smoke run (`--device cpu`)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3


def _event():
    return torch.cuda.Event(enable_timing=True) if torch.cuda.is_available() else _HostEvent()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def events_ms(fn, warmup: int = 3, repeats: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = _event(), _event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def stage_ms(enc: FastQwen3VLEncoder, c, layout, inputs, repeats: int = 5) -> dict[str, float]:
    """Per-stage times of uncaptured forwards (medians), by CUDA events at the stage ends."""
    runs: list[dict[str, float]] = []
    for _ in range(repeats + 1):
        marks: list[tuple[str, object]] = []

        def mark(name: str) -> None:
            e = _event()
            e.record()
            marks.append((name, e))

        mark("start")
        enc.on_stage = mark
        try:
            with torch.no_grad():
                enc._forward(c, layout, *inputs)
        finally:
            enc.on_stage = None
        _sync()
        runs.append({n: p.elapsed_time(e) for (_, p), (n, e) in zip(marks, marks[1:])})
    runs = runs[1:]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["total"] = sum(out.values())
    return out


KINDS = (("attention", ("fmha", "flash", "attention", "cutlass::Kernel", "efficient")),
         ("matmul", ("gemm", "nvjet", "sm90_xmma", "cublas", "splitk", "magma")),
         ("conv", ("conv", "implicit", "cudnn", "winograd")),
         ("triton (fused)", ("triton",)),)


def kernel_table(enc: FastQwen3VLEncoder, c, layout, inputs, top: int = 18) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        enc._forward(c, layout, *inputs)
    _sync()
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof, torch.no_grad():
        enc._forward(c, layout, *inputs)
        _sync()
    rows = []
    for e in prof.key_averages():
        t = (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) if cuda \
            else e.self_cpu_time_total
        if t > 0:
            rows.append((e.key, t / 1e3, e.count))
    # Kernels only (the profiler also lists the ops that launched them); on CPU, the ops.
    if cuda:
        rows = [r for r in rows if not r[0].startswith("aten::")]
    rows.sort(key=lambda r: -r[1])
    by_kind: dict[str, float] = {}
    for name, ms, _ in rows:
        low = name.lower()
        kind = next((k for k, pats in KINDS if any(p.lower() in low for p in pats)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
    total_ms, launches = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"\n# kernels of one uncaptured forward: {total_ms:.1f} ms in {launches} launches")
    for k, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<16} {ms:8.2f} ms")
    print(f"  {'ms':>8} {'calls':>6}  kernel")
    for name, ms, n in rows[:top]:
        print(f"  {ms:8.2f} {n:6d}  {name[:110]}")
    return {"by_kind_ms": by_kind, "top": [{"kernel": n[:200], "ms": ms, "calls": k} for n, ms, k in rows[:40]]}


def micro(base: BaseModel, rows: int, vision_rows: int) -> dict[str, float]:
    """Each matmul shape of one forward alone (times its count per forward), and text attention."""
    tc = base.core.config.text_config
    vc = base.core.config.vision_config
    d, ff, hd = tc.hidden_size, tc.intermediate_size, tc.head_dim
    nq, nkv = tc.num_attention_heads, tc.num_key_value_heads
    dv, ffv = vc.hidden_size, vc.intermediate_size
    dt = base.dtype
    shapes = {  # name: (M, K, N, count per forward)
        "text q": (rows, d, nq * hd, tc.num_hidden_layers), "text k": (rows, d, nkv * hd, tc.num_hidden_layers),
        "text v": (rows, d, nkv * hd, tc.num_hidden_layers),
        "text qkv fused": (rows, d, (nq + 2 * nkv) * hd, tc.num_hidden_layers),
        "text o": (rows, nq * hd, d, tc.num_hidden_layers), "text gate": (rows, d, ff, tc.num_hidden_layers),
        "text up": (rows, d, ff, tc.num_hidden_layers), "text gate+up fused": (rows, d, 2 * ff, tc.num_hidden_layers),
        "text down": (rows, ff, d, tc.num_hidden_layers),
        "vis qkv": (vision_rows, dv, 3 * dv, vc.depth), "vis proj": (vision_rows, dv, dv, vc.depth),
        "vis fc1": (vision_rows, dv, ffv, vc.depth), "vis fc2": (vision_rows, ffv, dv, vc.depth),
    }
    out: dict[str, float] = {}
    print(f"\n# matmuls alone ({str(dt).removeprefix('torch.')}, random data), per forward")
    print(f"  {'shape':<20} {'M':>6} {'K':>6} {'N':>6} {'ms each':>8} {'x count':>8} {'TFLOP/s':>8}")
    for name, (m, k, n, count) in shapes.items():
        a = torch.randn(m, k, device=base.device, dtype=dt)
        w = torch.randn(n, k, device=base.device, dtype=dt)
        ms = events_ms(lambda: F.linear(a, w), 5, 20)
        out[name] = ms * count
        print(f"  {name:<20} {m:6d} {k:6d} {n:6d} {ms:8.3f} {ms * count:8.2f} {2 * m * k * n / ms / 1e9:8.1f}")
    # Patch embedding: the Conv3d vs the same weights as one matmul.
    proj = base.core.visual.patch_embed.proj
    x = torch.randn(vision_rows, proj.in_channels * proj.kernel_size[0] * proj.kernel_size[1] * proj.kernel_size[2],
                    device=base.device, dtype=dt)
    with torch.no_grad():
        conv = events_ms(lambda: proj(x.view(-1, proj.in_channels, *proj.kernel_size)), 3, 10)
        lin = events_ms(lambda: F.linear(x, proj.weight.reshape(proj.out_channels, -1), proj.bias), 3, 10)
    out["patch conv3d"], out["patch linear"] = conv, lin
    print(f"  patch embed: conv3d {conv:.3f} ms, as a matmul {lin:.3f} ms")
    # Text attention at the grouped shape: masked (what runs) vs causal flash (a floor).
    b, length = rows // 143 or 1, 143
    q = torch.randn(b, nq, length, hd, device=base.device, dtype=dt)
    k = torch.randn(b, nq, length, hd, device=base.device, dtype=dt)
    mask = torch.ones(length, length, dtype=torch.bool, device=base.device).tril()[None, None].expand(b, 1, -1, -1)
    with torch.no_grad():
        masked = events_ms(lambda: F.scaled_dot_product_attention(q, k, k, attn_mask=mask), 3, 20)
        causal = events_ms(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True), 3, 20)
    out["text attn masked x layers"] = masked * tc.num_hidden_layers
    out["text attn causal x layers"] = causal * tc.num_hidden_layers
    print(f"  text attention per layer: bool mask {masked:.3f} ms, is_causal {causal:.3f} ms "
          f"(x {tc.num_hidden_layers})")
    total = sum(v for n, v in out.items() if n in shapes and "fused" not in n)
    fused = total - out["text q"] - out["text k"] - out["text v"] - out["text gate"] - out["text up"] \
        + out["text qkv fused"] + out["text gate+up fused"]
    print(f"  matmul floor per forward: {total:.1f} ms separate, {fused:.1f} ms with fused qkv and gate+up")
    out["matmul_floor_ms"], out["matmul_floor_fused_ms"] = total, fused
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-vl-4b")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--variants", default="graphs,compile,compile+fused",
                    help="comma-separated engines: graphs (no compile), compile, +fused (one matmul for q/k/v "
                         "and for gate/up), +dyn (automatic dynamic shapes, a smaller size compiled first), "
                         "+fp8 (FP8 matmuls, per-tensor scales; CUDA sm89+), +fp8fast (the same, fast accumulation), "
                         "+fp8row (row-wise scales: per token x per output channel; sm90), +fp8rowfast, "
                         "a trailing `dec` (+fp8rowdec, +fp8dec): FP8 in the decoder only, vision blocks bf16")
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda; cpu is a smoke run of the script (host clock)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (--device cpu runs the script as a smoke test)")
    if args.device == "cpu" and "fp8" in args.variants:
        ap.error("--variants +fp8: FP8 matmuls need a CUDA GPU of compute capability 8.9+, not --device cpu")
    base = BaseModel.load(BaseConfig(args.preset, device=args.device, max_prompt_tokens=PROMPT_TOKENS))
    slots = [TenantSlot.create(f"t{i}", bench_schema(i), base, seed=i) for i in range(args.tenants)]
    vla = VLABatch.cat([random_batch(s.preprocessor, args.batch, seed=100 * i).features.to(base.device)
                        for i, s in enumerate(slots)])
    layout = vla.key.layout
    with torch.no_grad():
        ref = base.encode(vla)
    m = ref.mask_B_L
    ref_h = ref.hidden_B_L_D[m].float()
    report: dict = {"preset": args.preset, "rows": len(vla), "tokens": int(m.numel()), "real_tokens": int(m.sum()),
                    "variants": {}}
    print(f"# {args.preset}: {len(vla)} rows x {m.shape[1]} tokens ({int(m.sum())} real), torch {torch.__version__}")
    inputs = [vla.prompt_ids_B_T, vla.prompt_len_B, vla.image_mask_B_S, vla.images_B_S_C_H_W]
    enc, first_h = None, None
    for name in args.variants.split(","):
        enc = None  # the previous engine's graphs and weight copies go before the next is built
        enc = FastQwen3VLEncoder(base, compile="compile" in name, fused="fused" in name,
                                 dynamic=None if "dyn" in name else False,
                                 fp8="rowwise" if "fp8row" in name else "fp8" in name,
                                 fp8_fast_accum="fp8" in name and "fast" in name, fp8_vision=not name.endswith("dec"))
        if "dyn" in name:
            # What a server gets: a smaller size compiled first, so this one runs the kernels
            # of the recompile with a symbolic batch dimension.
            torch._dynamo.reset()
            with torch.no_grad():
                enc(vla.index(slice(0, 3 * len(vla) // 4)))
        c = enc.consts(layout, len(vla))
        with torch.no_grad():
            hidden, _ = enc(vla)
        err = float((hidden[m].float() - ref_h).norm() / ref_h.norm())
        first_h = hidden[m].float() if first_h is None else first_h
        err_first = float((hidden[m].float() - first_h).norm() / first_h.norm())
        graph = events_ms(lambda: enc(vla), 3, 10)
        stages = stage_ms(enc, c, layout, inputs)
        report["variants"][name] = {"graph_ms": graph, "rel_err_vs_eager": err, "rel_err_vs_first": err_first,
                                    "stages_ms": stages}
        print(f"\n## {name}: graph replay {graph:.1f} ms, hidden rel err vs eager {err:.2e}, "
              f"vs the first variant {err_first:.2e}")
        print("  uncaptured stages (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
    if enc is not None:
        report["kernels"] = kernel_table(enc, enc.consts(layout, len(vla)), layout, inputs)
    if args.micro:
        vision_rows = len(vla) * layout.camera_slots * (layout.image_size[0] // 16) * (layout.image_size[1] // 16)
        report["micro_ms"] = micro(base, int(m.numel()), vision_rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
