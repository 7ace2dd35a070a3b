"""Learning across seeds, through the services (issue 25 item 4): one `nexus up`, the example
PPO spec (`examples/rl_reach.yaml`, the built-in reach task) submitted once per seed as its own
tenant, each run to its own end (its target: the last 50 training episodes all succeeded, or
its `max_wall_s` cap), then two read-only evaluations of each tenant's final policy on held-out
seeds: deterministic (the policy's mean action, `eval.sample: false`, what the README's claims
use) and stochastic (sampled actions, as training acts). The table says, per seed, whether the
target was reached, when, and how the last training window compares with each evaluation.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.learning_seeds --seeds 1,2,3 \\
        --out docs/results/learning_seeds.json

``--concurrent`` submits every seed at once (tenants share the services; slower per tenant on
2 cores); the default runs them one after another, each alone on the deployment.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from transport.broker import free_port
from bench.chaos_deploy import Deployment, ROOT, stop_on_sigterm

SPEC = ROOT / "examples" / "rl_reach.yaml"


def rl_spec(base: dict[str, Any], seed: int, max_wall_s: float | None = None) -> dict[str, Any]:
    spec = copy.deepcopy(base)
    spec["tenant"], spec["seed"] = f"rl-reach-s{seed}", seed
    if max_wall_s is not None:  # a smoke run's shorter cap; the recorded runs keep the example's
        spec["schedule"]["budget"]["max_wall_s"] = max_wall_s
    return spec


def eval_spec(rl: dict[str, Any], episodes: int, sample: bool) -> dict[str, Any]:
    return {"tenant": rl["tenant"], "task": "eval", "env": copy.deepcopy(rl["env"]),
            "eval": {"version": "latest", "episodes": episodes, "seed": 100_000, "sample": sample}}


def _rate(rec: Any) -> float | None:
    m = rec.metrics or {}
    value = m.get("success_rate", m.get("eval_success_rate"))
    return None if value is None else float(value)


def run(seeds: list[int], episodes: int, concurrent: bool, data_dir: Path, timeout_s: float,
        max_wall_s: float | None = None) -> dict[str, Any]:
    from sdk import Client

    from master.spec import load_document

    base = load_document(SPEC.read_text())  # the spec loader (YAML 1.2 numbers: lr 5e-4 is a float)
    dep = Deployment(data_dir, nats_cluster=1)
    dep.up(free_port())
    rows: list[dict[str, Any]] = []
    try:
        with Client.from_data_dir(data_dir, timeout_s=30) as client:
            specs = [rl_spec(base, s, max_wall_s) for s in seeds]
            groups = [specs] if concurrent else [[s] for s in specs]
            for group in groups:
                handles = [(spec, client.submit(spec), time.monotonic()) for spec in group]
                for spec, wl, t0 in handles:
                    rec = wl.wait(timeout_s=timeout_s)
                    row = {"seed": spec["seed"], "tenant": spec["tenant"], "workload": wl.id, "state": rec.state,
                           "message": rec.message, "target_reached": rec.message.startswith("target reached"),
                           "wall_s": round(time.monotonic() - t0, 1), "version": rec.step,
                           "episodes": rec.episodes, "train_window_success": _rate(rec)}
                    for sample in (False, True):
                        ev = client.submit(eval_spec(spec, episodes, sample)).wait(timeout_s=timeout_s)
                        row["eval_stochastic" if sample else "eval_deterministic"] = _rate(ev)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        dep.nexus("down", "--data-dir", str(data_dir), timeout=120)
        dep.cleanup()
    return {"spec": str(SPEC.relative_to(ROOT)), "seeds": seeds, "eval_episodes": episodes, "concurrent": concurrent,
            "max_wall_s": max_wall_s or base["schedule"]["budget"]["max_wall_s"], "rows": rows}


def table(report: dict[str, Any]) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f} %"

    lines = ["| seed | state | target reached | wall | version | episodes | last training window | eval, mean action | eval, sampled |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        lines.append(f"| {r['seed']} | {r['state']} | {'yes' if r['target_reached'] else 'no'} | {r['wall_s']:.0f} s "
                     f"| {r['version']} | {r['episodes']} | {pct(r['train_window_success'])} "
                     f"| {pct(r['eval_deterministic'])} | {pct(r['eval_stochastic'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2,3", help="comma-separated seeds, one tenant each")
    p.add_argument("--eval-episodes", type=int, default=20)
    p.add_argument("--concurrent", action="store_true", help="submit every seed at once")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per workload wait")
    p.add_argument("--max-wall-s", type=float, default=None, help="override the spec's wall-clock cap (smoke runs)")
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="write the report JSON here")
    args = p.parse_args(argv)
    stop_on_sigterm()  # a killed run takes its deployment down
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="nexus-seeds-"))
    report = run(seeds, args.eval_episodes, args.concurrent, data_dir, args.timeout_s, args.max_wall_s)
    print(table(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"JSON: {args.out}")
    reached = sum(r["target_reached"] for r in report["rows"])
    print(f"target reached on {reached} of {len(report['rows'])} seeds")
    return 0 if reached == len(report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
