"""Make the pictures and text views of docs/observability.md from a real short deployment.

1. `nexus up --detach` in a temporary data dir with every trace kept
   (NEXUS_TRACE_SAMPLE_RATIO=1.0) and the Prometheus endpoint on a free port
   (NEXUS_METRICS_PORT=0);
2. the demo's SFT and RL tenants (examples/sft_reach.yaml, examples/rl_reach.yaml) with tiny
   budgets on the built-in reach task, at once, to the end (a few minutes on a loaded CPU);
3. each view saved under docs/views/:
   * ``trace_sft.txt``, ``trace_rl.txt``: `nexus trace --workload W` of each workload;
   * ``timeline_rl.png``: the RL workload's spans, `nexus trace --workload W --png FILE`
     (the `--chrome` JSON Perfetto opens is left in the data dir: megabytes);
   * ``trace_rl_update.txt``, ``timeline_rl_update.png``: one RL update's trace
     (`nexus trace TRACE_ID --png FILE`);
   * ``top.txt``: one `nexus top` frame (`nexus top --once`);
   * ``tensorboard.png``: the tenants' TensorBoard scalars, read back with tensorboard's own
     `EventAccumulator` from ``DATA_DIR/tensorboard/<tenant>/``;
   * ``metrics.txt``: an excerpt of a Prometheus scrape (OpenMetrics text);
4. `nexus down`.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python docs/views/make_views.py [--out docs/views] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from transport.broker import free_port  # noqa: E402
from transport.cluster import ClusterState  # noqa: E402
from sdk.client import AsyncClient  # noqa: E402

# Budgets small enough for a couple of minutes on a CPU: (example, dotted path, value).
SHRINK = [
    ("sft_reach.yaml", "env.demos.episodes", 12), ("sft_reach.yaml", "algorithm.steps", 48),
    ("sft_reach.yaml", "algorithm.batch_size", 16), ("sft_reach.yaml", "algorithm.items_per_job", 8),
    ("sft_reach.yaml", "algorithm.warmup_steps", 0), ("sft_reach.yaml", "schedule.sft_prefetch_items", 8),
    ("sft_reach.yaml", "outputs.export_every_steps", 8), ("sft_reach.yaml", "eval.episodes", 2),
    ("rl_reach.yaml", "algorithm.steps_per_update", 64), ("rl_reach.yaml", "algorithm.micro_batch", 32),
    ("rl_reach.yaml", "algorithm.parallel_envs", 4), ("rl_reach.yaml", "algorithm.epochs", 1),
    ("rl_reach.yaml", "schedule.budget", {"max_episodes": 12, "max_wall_s": 240}), ("rl_reach.yaml", "eval.episodes", 2),
]
SPECS = ("sft_reach.yaml", "rl_reach.yaml")
FAMILIES = ("nexus_queue_depth", "nexus_jobs_in_flight", "nexus_policy_version", "nexus_loss", "nexus_success_rate",
            "nexus_weight_sync_seconds", "nexus_busy_fraction", "nexus_role_up")
ENV = {"NEXUS_TRACE_SAMPLE_RATIO": "1.0", "NEXUS_METRICS_PORT": "0", "OMP_NUM_THREADS": "1", "COLUMNS": "110",
       "NO_COLOR": "1"}


def spec(name: str) -> dict:
    d = yaml.safe_load((ROOT / "examples" / name).read_text())
    for dotted, value in ((d_, v) for n, d_, v in SHRINK if n == name):
        *head, last = dotted.split(".")
        node = d
        for k in head:
            node = node[k]
        node[last] = value
    return d


def nexus(*args: str, out: Path | None = None, check: bool = True) -> str:
    print(f"$ nexus {' '.join(args)}", flush=True)
    res = subprocess.run([sys.executable, "-m", "sdk.cli", *args], cwd=ROOT, env={**os.environ, **ENV},
                         capture_output=True, text=True, timeout=300)
    if res.returncode != 0 and check:
        raise SystemExit(f"nexus {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    if out is not None:
        out.write_text(res.stdout)
        print(f"  -> {out}")
    return res.stdout


async def wait(handle, polls_lost: int = 3):
    """The workload's end; a poll the master does not answer in time (a role restarted by the
    health role on a machine this loaded) is asked again, ``polls_lost`` times at most."""
    from protocol.errors import RequestTimeout

    for attempt in range(polls_lost + 1):
        try:
            return await handle.wait(timeout_s=600, poll_s=2.0)
        except RequestTimeout as exc:
            if attempt == polls_lost:
                raise
            print(f"  {handle.id}: {exc}; asking again", flush=True)


async def run_workloads(state: ClusterState) -> dict[str, str]:
    """Submit both tenants' workloads at once (as the platform), wait; tenant -> workload id."""
    async with AsyncClient(state.nats_url, state.prefix, timeout_s=60) as client:
        handles = [await client.submit(yaml.safe_dump(spec(n))) for n in SPECS]
        recs = await asyncio.gather(*(wait(h) for h in handles))
        for r in recs:
            print(f"  {r.tenant}: {r.state} version {r.step} {dict(list(r.metrics.items())[:4])}")
            if r.state != "completed":
                raise SystemExit(f"workload {r.workload} of {r.tenant} ended {r.state}: {r.message}")
        return {r.tenant: r.workload for r in recs}


def metrics_excerpt(url: str, out: Path) -> None:
    req = urllib.request.Request(url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    keep = [ln for ln in text.splitlines() if ln.split("{")[0].split(" ")[0] in FAMILIES
            or any(ln.startswith(f"# {kind} {f} ") for f in FAMILIES for kind in ("HELP", "TYPE"))]
    out.write_text("\n".join(keep) + "\n# EOF\n")
    print(f"  -> {out} ({len(keep)} of {len(text.splitlines())} lines)")


def boards_png(root: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = ("learning/loss", "learning/success_rate", "learning/mean_return", "control/queue_depth")
    fig, axes = plt.subplots(1, len(tags), figsize=(12, 3), dpi=90)
    for run in sorted(p for p in root.iterdir() if p.is_dir()):
        acc = EventAccumulator(str(run))
        acc.Reload()
        have = set(acc.Tags()["scalars"])
        for ax, tag in zip(axes, tags):
            if tag in have:
                pts = acc.Scalars(tag)
                ax.plot([p.step for p in pts], [p.value for p in pts], marker=".", label=run.name)
    for ax, tag in zip(axes, tags):
        ax.set_title(tag, fontsize=9)
        ax.set_xlabel("seconds" if tag.startswith("control/") else "policy version", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(linewidth=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"TensorBoard scalars (EventAccumulator over {root.name}/<tenant>/)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    print(f"  -> {out}")


async def top_frame(state: ClusterState, out: Path) -> str:
    """`nexus top --once` drawn to text (Console(record=True)); the endpoint's URL."""
    from rich.console import Console

    from sdk.top import build_view, fetch, render

    async with AsyncClient(state.nats_url, state.prefix, timeout_s=10) as client:
        view = build_view(await fetch(client))
    con = Console(record=True, width=100, file=open(os.devnull, "w"), color_system=None)
    con.print(render(view))
    out.write_text(con.export_text())
    print(f"  -> {out}")
    return view["metrics_url"]


def traces(data: Path, out: Path, rl: str) -> None:
    """The RL workload's timeline, and one of its updates (a whole trace across processes)."""
    from sdk.trace_view import load_spans

    d = str(data)
    nexus("trace", "--workload", rl, "--data-dir", d, "--chrome", str(data / "timeline_rl.json"),
          "--png", str(out / "timeline_rl.png"), out=out / "trace_rl.txt")
    updates = sorted((s for s in load_spans(data / "traces")
                      if s.name == "workflow.rl.update" and s.attributes.get("nexus.workload") == rl),
                     key=lambda s: s.start)
    one = updates[len(updates) // 2]  # one from the middle: the policy and the caches warm
    nexus("trace", one.trace_id, "--data-dir", d, "--chrome", str(data / "timeline_rl_update.json"),
          "--png", str(out / "timeline_rl_update.png"), out=out / "trace_rl_update.txt")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "views")
    p.add_argument("--keep", type=Path, default=None, help="use this data dir and leave it (default: a temp dir)")
    args = p.parse_args()
    os.environ.update(ENV)  # this process's clients and the supervisor it starts
    data = args.keep or Path(tempfile.mkdtemp(prefix="nexus-views-"))
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    d = str(data)
    t0 = time.monotonic()
    try:
        # A loaded machine (a test suite beside it) starts six roles slowly: wait longer than 60 s.
        nexus("up", "--detach", "--data-dir", d, "--nats-port", str(free_port()), "--ready-timeout-s", "240")
        state = ClusterState.read(data.resolve())
        assert state is not None
        print(f"up in {time.monotonic() - t0:.0f} s; workloads:", flush=True)
        ids = asyncio.run(run_workloads(state))
        print(f"done in {time.monotonic() - t0:.0f} s", flush=True)
        time.sleep(6)  # span files flush every 0.5 s, event files every 2 s, the monitor beats every 1 s
        url = asyncio.run(top_frame(state, out / "top.txt"))
        metrics_excerpt(url, out / "metrics.txt")
        sft, rl = ids["sft-reach"], ids["rl-reach"]
        nexus("trace", "--workload", sft, "--data-dir", d, out=out / "trace_sft.txt")
        traces(data, out, rl)
        boards_png(data / "tensorboard", out / "tensorboard.png")
    finally:
        print(nexus("down", "--data-dir", d, check=False).strip())  # also after a failed start
        if args.keep is None:
            shutil.rmtree(data, ignore_errors=True)
    for f in sorted(out.iterdir()):
        print(f"{f.name:<20} {f.stat().st_size / 1024:8.1f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
