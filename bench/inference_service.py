"""Inference service benchmark: M tenants x C closed-loop clients over NATS, grouping on vs off.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.inference_service --preset tiny-qwen3-vl \
        --tenants 8 --clients 4 --duration-s 10 --grouping on,off --json bench/results/infer.json

``--lora 8,0`` gives every other tenant a rank-8 LoRA adapter (q/k/v/o): a mixed group on one
forward; the inferencer warms the adapted graphs before ready (its `info.extra.engine`).

For each grouping mode it starts a fresh nats-server (embedded), a master and one inferencer
process (grouping off = max_batch_size 1), creates the tenants (alternating LIBERO- and
CALVIN-like schemas, 2 cameras), and runs tenants x clients closed-loop clients (each sends
its next request when the last reply came) for --duration-s after a warm-up. It reports
throughput, p50 / p99 latency as the client sees it, the group sizes the server formed in the
measured window, and the in-process ceiling: that same distribution of group sizes run through
the same code path (`Inferencer._run_group`, and `_forward` alone on canonicalised batches)
without NATS or codec, so service / ceiling is the NATS + codec + batching overhead as a ratio. Prints a table, writes JSON (one record per mode).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from transport.broker import EmbeddedBroker, free_port
from protocol.messages import PredictRequest, RoleInfo, TenantConfig
from sdk.client import AsyncClient

LIBERO = {"cameras": [{"name": "agentview", "height": 128, "width": 128}, {"name": "wrist", "height": 128, "width": 128}],
          "state_dim": 8, "action_dim": 7, "action_horizon": 8, "instruction_template": "{instruction}"}
CALVIN = {"cameras": [{"name": "static", "height": 200, "width": 200}, {"name": "gripper", "height": 84, "width": 84}],
          "state_dim": 15, "action_dim": 7, "action_horizon": 8, "instruction_template": "{instruction}"}


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def tenant_cfgs(preset: str, n: int, head: str, camera_px: int = 0, lora: tuple[int, ...] = ()) -> list[TenantConfig]:
    """Alternating LIBERO- / CALVIN-like tenants; ``camera_px`` > 0 makes every camera that size;
    ``lora``: LoRA ranks the tenants take in turn (on q/k/v/o; 0 = frozen base)."""
    out = []
    for i in range(n):
        schema = json.loads(json.dumps(LIBERO if i % 2 == 0 else CALVIN))
        if camera_px:
            for cam in schema["cameras"]:
                cam["height"] = cam["width"] = camera_px
        rank = lora[i % len(lora)] if lora else 0
        adapter = {"rank": rank, "alpha": 2.0 * rank, "target_modules": LORA_TARGETS} if rank else {}
        out.append(TenantConfig(name=f"bench{i:02d}", base=preset, schema=schema, head=head, seed=i,
                                base_adapter=adapter))
    return out


def observation(cfg: TenantConfig, rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    images = {c["name"]: rng.integers(0, 256, (c["height"], c["width"], 3), dtype=np.uint8) for c in cfg.schema["cameras"]}
    return images, rng.standard_normal(cfg.schema["state_dim"]).astype(np.float32)


def start_role(role: str, url: str, prefix: str, data_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    log = open(data_dir / f"{role}.log", "ab")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen([sys.executable, "-m", "actors.run", role, "--nats-url", url, "--prefix", prefix,
                             "--data-dir", str(data_dir), "--instance", f"{role}-bench"],
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env}, stdout=log, stderr=subprocess.STDOUT)


async def wait_ready(c: AsyncClient, role: str, timeout_s: float = 600) -> RoleInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = await c.info(role)
            if info.state == "ready":
                return info
        except Exception:  # not up yet
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


async def measure(args, c: AsyncClient, cfgs: list[TenantConfig]) -> dict:
    """len(cfgs) x --clients closed-loop clients: --warmup-s, then --duration-s measured."""
    latencies: list[float] = []
    measuring = {"on": False}
    stop = asyncio.Event()

    async def client(k: int) -> None:
        cfg = cfgs[k % len(cfgs)]
        rng = np.random.default_rng(k)
        images, state = observation(cfg, rng)
        while not stop.is_set():
            t0 = time.perf_counter()
            await c.predict(cfg.name, images, state, "pick up the red block and put it in the bowl", timeout_s=60)
            if measuring["on"]:
                latencies.append(time.perf_counter() - t0)

    tasks = [asyncio.ensure_future(client(k)) for k in range(len(cfgs) * args.clients)]
    await asyncio.sleep(args.warmup_s)
    before = (await c.info("inferencer")).extra
    measuring["on"] = True
    t0 = time.perf_counter()
    await asyncio.sleep(args.duration_s)
    measuring["on"] = False
    elapsed = time.perf_counter() - t0
    after = (await c.info("inferencer")).extra
    stop.set()
    await asyncio.gather(*tasks)
    groups = after["groups"] - before["groups"]
    served = after["served"] - before["served"]
    sizes = {int(k): v - before["group_sizes"].get(k, 0) for k, v in after["group_sizes"].items()}
    sizes = {k: v for k, v in sorted(sizes.items()) if v > 0}
    lat = sorted(latencies)
    return {
        "requests": len(lat), "duration_s": elapsed, "throughput_rps": len(lat) / elapsed,
        "p50_ms": 1000 * lat[len(lat) // 2], "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "mean_ms": 1000 * statistics.fmean(lat), "server_mean_batch": served / groups if groups else 0.0,
        "server_group_sizes": sizes,
    }


async def run_mode(args, grouping: bool, data_dir: Path) -> list[dict]:
    broker = EmbeddedBroker(data_dir=data_dir / "nats", port=free_port())
    broker.start()
    procs = []
    try:
        from transport.bus import Bus
        from transport.layout import ensure_layout
        from protocol.subjects import Names

        prefix = "bench"
        bus = await Bus.connect(broker.url, name="bench", reconnect_forever=False)
        await ensure_layout(bus.js, Names(prefix))
        await bus.close()
        env = {"NEXUS_INFER_BASE": args.preset,
               "NEXUS_INFER_MAX_BATCH_SIZE": str(args.max_batch_size if grouping else 1),
               "NEXUS_INFER_BATCH_WAIT_TIMEOUT_S": str(args.batch_wait_timeout_s if grouping else 0.0)}
        if args.device:
            env["NEXUS_INFER_DEVICE"] = args.device
        if args.fast:
            env["NEXUS_INFER_FAST"] = "1"
        if args.compile:
            env["NEXUS_INFER_COMPILE"] = "1"
        procs.append(start_role("master", broker.url, prefix, data_dir, {}))
        c = await AsyncClient(broker.url, prefix, timeout_s=60).connect()
        await wait_ready(c, "master")
        cfgs = tenant_cfgs(args.preset, max(args.curve or [args.tenants]), args.head, args.camera_px, args.lora)
        for cfg in cfgs:
            await c.create_tenant(cfg, exist_ok=True)
        procs.append(start_role("inferencer", broker.url, prefix, data_dir, env))
        await wait_ready(c, "inferencer")

        engine = (await c.info("inferencer")).extra.get("engine", {})
        print(f"inferencer ready: engine {engine}", flush=True)
        counts = args.curve or [args.tenants]
        points = []
        for n in counts:
            points.append(await measure(args, c, cfgs[:n]))
            pt = points[-1]  # as it comes: a run cut short still shows its points
            print(f"  {n} tenants: {pt['throughput_rps']:.1f} req/s, p50 {pt['p50_ms']:.1f} ms, "
                  f"p99 {pt['p99_ms']:.1f} ms, mean group {pt['server_mean_batch']:.1f}", flush=True)
        await c.close()
        for n, pt in zip(counts, points):
            pt.update({"grouping": "on" if grouping else "off", "preset": args.preset, "head": args.head,
                       "lora_ranks": list(args.lora),
                       "fast": args.fast, "compile": args.compile, "engine": engine,
                       "tenants": n, "clients_per_tenant": args.clients,
                       "max_batch_size": args.max_batch_size if grouping else 1,
                       "batch_wait_timeout_s": args.batch_wait_timeout_s if grouping else 0.0})
        return points
        await c.close()
    except BaseException:
        for log in sorted(data_dir.glob("*.log")):  # say why, then fail
            print(f"--- {log.name} (last lines)\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        broker.stop()


def in_process_ceiling(args, sizes: dict[int, int]) -> tuple[float, float, dict[int, dict[str, float]]]:
    """Requests/s of the inferencer's own group path, in-process, over the same distribution of
    group sizes the service formed (``sizes``: group size -> groups in the measured window):
    (canonicalise + forward, forward alone, per-size seconds per group). Replaying the
    distribution, not its mean, matters with CUDA graphs: groups are padded to capture sizes,
    so a mean of 10.7 costs what 16 does while a real mix of 8s and 16s costs less."""
    import torch

    from actors.inferencer.batching import Pending
    from actors.inferencer.inferencer import Inferencer
    from models import BaseConfig, BaseModel, TenantSchema, TenantSlot

    torch.set_num_threads(1)
    base = BaseModel.load(BaseConfig(source=args.preset, device=args.device or None, fast=args.fast,
                                     compile=args.fast and args.compile))
    cfgs = tenant_cfgs(args.preset, args.tenants, args.head, args.camera_px, args.lora)
    slots = [TenantSlot.create(c.name, TenantSchema.from_dict(c.schema), base, head_kind=c.head, seed=c.seed,
                               adapter=c.base_adapter or None) for c in cfgs]
    rng = np.random.default_rng(0)
    group = []
    for k in range(max(sizes)):
        cfg, slot = cfgs[k % len(cfgs)], slots[k % len(cfgs)]
        images, state = observation(cfg, rng)
        req = PredictRequest(tenant=cfg.name, images=images, state=state,
                             instruction="pick up the red block and put it in the bowl", timeout_s=1e9)
        group.append(Pending(req=req, msg=None, slot=slot, version=0, arrived=time.monotonic()))

    class _Heads:
        def __init__(self, base):
            self.base = base

    fake = Inferencer.__new__(Inferencer)
    fake.heads = _Heads(base)  # only .base (and .fast) are used by the group path
    fake.fast = args.fast
    fake.warmup = False  # the bench's own warm-up (`timed`) runs each size first
    from opentelemetry import trace

    fake.tracer = trace.get_tracer("bench")
    from actors.metering import Meter

    fake.meter = Meter()  # the group path charges each forward to its tenants
    fake.heads_in_forward = 0  # groups whose heads ran inside the forward (the group path counts them)

    def timed(fn, batch: int) -> float:
        """Seconds per call."""
        for _ in range(3):
            fn()
        reps = max(4, int(40 / batch))
        if base.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if base.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    # Full: canonicalise + forward in series. Forward: the grouped forward (base + heads) on
    # batches already canonicalised: the "in-process grouped forward throughput".
    per: dict[int, dict[str, float]] = {}
    for size in sizes:
        g = group[:size]
        full = timed(lambda: Inferencer._run_group(fake, g, time.monotonic()), size)
        prepared = Inferencer._prepare(fake, g, time.monotonic())
        forward = timed(lambda: Inferencer._forward(fake, g, *prepared), size)
        per[size] = {"full_s": full, "forward_s": forward}
    requests = sum(s * n for s, n in sizes.items())
    full_rps = requests / sum(n * per[s]["full_s"] for s, n in sizes.items())
    forward_rps = requests / sum(n * per[s]["forward_s"] for s, n in sizes.items())
    return full_rps, forward_rps, per


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-qwen3-vl")
    p.add_argument("--head", default="mlp")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--clients", type=int, default=4, help="closed-loop clients per tenant")
    p.add_argument("--duration-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--grouping", default="on,off")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--batch-wait-timeout-s", type=float, default=0.005)
    p.add_argument("--device", default="")
    p.add_argument("--fast", action="store_true", help="the inferencer's optimized encode (CUDA graphs)")
    p.add_argument("--compile", action="store_true", help="with --fast: compiled blocks (NEXUS_INFER_COMPILE)")
    p.add_argument("--camera-px", type=int, default=0,
                   help="square camera frames of this size (0: LIBERO 128x128 and CALVIN 200x200 / 84x84)")
    p.add_argument("--curve", default="", help="tenant counts, e.g. 1,2,4,8,16: a load-latency curve on one "
                   "deployment per grouping mode (clients per tenant from --clients; no in-process ceiling)")
    p.add_argument("--lora", default="", help="LoRA ranks (q/k/v/o) the tenants take in turn, 0 = frozen base: "
                   "e.g. 8,0 alternates adapted and frozen tenants (default: all frozen)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    try:
        args.lora = tuple(int(x) for x in args.lora.split(",") if x.strip())
    except ValueError:
        p.error(f"--lora: {args.lora!r} is not a comma-separated list of ranks")
    if any(r < 0 or r > 256 for r in args.lora):
        p.error(f"--lora: ranks must be 0..256 (0 = frozen base), got {list(args.lora)}")
    try:
        args.curve = sorted({int(x) for x in args.curve.split(",") if x.strip()})
    except ValueError:
        p.error(f"--curve: {args.curve!r} is not a comma-separated list of tenant counts")
    if any(n < 1 or n > 256 for n in args.curve):
        p.error(f"--curve: tenant counts must be 1..256, got {args.curve}")
    modes = [m.strip() for m in args.grouping.split(",") if m.strip()]
    for m in modes:
        if m not in ("on", "off"):
            p.error(f"--grouping: {m!r} is not on or off")
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in modes:
            d = Path(tmp) / m
            d.mkdir()
            for rec in asyncio.run(run_mode(args, m == "on", d)):
                if args.curve:  # the load-latency curve: the service alone, no in-process ceiling
                    rec["ceiling_full_rps"] = rec["ceiling_forward_rps"] = float("nan")
                else:
                    rec["ceiling_full_rps"], rec["ceiling_forward_rps"], rec["ceiling_per_size"] = \
                        in_process_ceiling(args, rec["server_group_sizes"] or {1: 1})
                rec["service_over_full"] = rec["throughput_rps"] / rec["ceiling_full_rps"]
                rec["service_over_forward"] = rec["throughput_rps"] / rec["ceiling_forward_rps"]
                records.append(rec)
                print(f"[{m}, {rec['tenants']} tenants] {rec['throughput_rps']:.1f} req/s, p50 {rec['p50_ms']:.1f} ms, "
                      f"p99 {rec['p99_ms']:.1f} ms, mean group {rec['server_mean_batch']:.1f}", flush=True)
    print()
    head = (f"{'grouping':>8} {'tenants':>7} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'group':>6} "
            f"{'full ceil':>10} {'fwd ceil':>9} {'svc/full':>9} {'svc/fwd':>8}")
    print(head)
    for r in records:
        print(f"{r['grouping']:>8} {r['tenants']:>7} {r['throughput_rps']:>9.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
              f"{r['server_mean_batch']:>6.1f} {r['ceiling_full_rps']:>10.1f} {r['ceiling_forward_rps']:>9.1f} "
              f"{r['service_over_full']:>9.2f} {r['service_over_forward']:>8.2f}")
    by = {r["grouping"]: r for r in records if r["tenants"] == (args.curve or [args.tenants])[-1]}
    if "on" in by and "off" in by:
        ratio = by["on"]["throughput_rps"] / by["off"]["throughput_rps"]
        print(f"\ngrouped / ungrouped throughput: {ratio:.2f}x; p99 on {by['on']['p99_ms']:.1f} ms vs off {by['off']['p99_ms']:.1f} ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
