"""ManiSkill3 PickCube / PushCube SFT through the services (issue 25 item 2): the scripted expert's demos
recorded as a LeRobot dataset (`nexus dataset record`, rgb+state observations, pd_ee_delta_pose,
DART noise), published into one `nexus up` deployment (`nexus dataset publish`), the example SFT
(`examples/sft_maniskill_pickcube.yaml`, or `..._pushcube.yaml` with `--task push`) submitted once per seed as its own tenant, then the
example eval (`examples/eval_maniskill_pickcube.yaml`) of each tenant's final export on held-out
reset seeds (disjoint from every demo attempt's seed), through the real roles: master, trainer,
inferencer, env worker on a real nats-server.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m bench.maniskill_sft --seeds 1,2 \\
        --out docs/results/maniskill_sft.json

`--dataset DIR` trains on a dataset recorded before (recorded there if absent); `--steps`,
`--lr`, `--batch-size` override the example's algorithm (smoke runs, tuning).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from transport.broker import free_port
from bench.chaos_deploy import Deployment, ROOT, stop_on_sigterm

# --task: the example specs (the SFT's and its eval's) and the published dataset's name.
TASKS = {task: (ROOT / "examples" / f"sft_maniskill_{task}cube.yaml", ROOT / "examples" / f"eval_maniskill_{task}cube.yaml",
                f"{task}cube-demos") for task in ("pick", "push")}


def record_demos(out: Path, episodes: int, seed: int, noise: float, options: dict[str, Any], env_id: str,
                 timeout_s: float) -> dict[str, Any]:
    """`nexus dataset record` in a child process: the CLI an operator runs, timed."""
    cmd = [sys.executable, "-m", "sdk.cli", "dataset", "record", "--out", str(out), "--episodes", str(episodes),
           "--env", env_id, "--seed", str(seed), "--noise", str(noise), "--images", "--overwrite"]
    for key, value in options.items():
        cmd += ["--env-option", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]  # read as YAML
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    if res.returncode != 0:
        raise RuntimeError(f"`nexus dataset record` failed ({res.returncode}): {res.stderr[-2000:]}")
    line = res.stdout.strip().splitlines()[-1]  # "wrote N episodes, F frames to DIR (S/A expert attempts succeeded)"
    return {"command": "nexus " + " ".join(cmd[3:]), "wall_s": round(time.monotonic() - t0, 1), "summary": line}


def dataset_facts(root: Path) -> dict[str, Any]:
    from envs.lerobot import LeRobotReader

    with LeRobotReader(str(root)) as ds:
        return {"episodes": ds.meta.total_episodes, "frames": len(ds)}


def sft_spec(base: dict[str, Any], seed: int, root: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(base)
    spec["tenant"], spec["seed"] = f"{base['tenant']}-s{seed}", seed
    spec["dataset"]["root"] = str(root)
    spec["algorithm"].update({k: v for k, v in overrides.items() if v is not None})
    if spec["algorithm"]["warmup_steps"] > spec["algorithm"]["steps"]:
        spec["algorithm"]["warmup_steps"] = spec["algorithm"]["steps"] // 10
    return spec


def eval_spec(base: dict[str, Any], tenant: str, episodes: int, seed: int) -> dict[str, Any]:
    spec = copy.deepcopy(base)
    spec["tenant"] = tenant
    spec["eval"].update(episodes=episodes, seed=seed)
    return spec


def success_rate(rec: Any) -> float | None:
    """A finished workload's success rate (an eval's or an RL window's), None when not measured."""
    m = rec.metrics or {}
    value = m.get("success_rate", m.get("eval_success_rate"))
    return None if value is None else float(value)


def run(args: argparse.Namespace, data_dir: Path) -> dict[str, Any]:
    from sdk import Client

    from master.spec import load_document

    sft_path, eval_path, dataset_name = TASKS[args.task]
    sft_base = load_document(sft_path.read_text())
    ev_base = load_document(eval_path.read_text())
    env_id, options = ev_base["env"]["id"], ev_base["env"]["options"]
    # Demo attempt i resets with seed demo_seed + i, at most 2 x episodes + 10 attempts (record's cap).
    last_demo_seed = args.demo_seed + 2 * args.episodes + 10
    if args.demo_seed <= args.eval_seed < last_demo_seed or args.eval_seed <= args.demo_seed < args.eval_seed + args.eval_episodes:
        raise SystemExit(f"--eval-seed {args.eval_seed}: eval seeds overlap the demo seeds "
                         f"{args.demo_seed}..{last_demo_seed - 1}")
    report: dict[str, Any] = {"task": args.task, "sft_spec": str(sft_path.relative_to(ROOT)),
                              "eval_spec": str(eval_path.relative_to(ROOT)),
                              "env": env_id, "env_options": options, "seeds": args.seeds,
                              "demo_seeds": [args.demo_seed, last_demo_seed - 1],
                              "eval_seeds": [args.eval_seed, args.eval_seed + args.eval_episodes - 1],
                              "eval_episodes": args.eval_episodes, "cpu_threads": os.environ.get("OMP_NUM_THREADS")}
    root = args.dataset or data_dir.parent / f"{data_dir.name}-demos"
    if not (root / "meta" / "info.json").is_file():
        report["record"] = record_demos(root, args.episodes, args.demo_seed, args.noise, options, env_id,
                                        timeout_s=args.timeout_s)
        print(report["record"]["summary"], f"({report['record']['wall_s']} s)", flush=True)
    report["dataset"] = {"root": str(root), **dataset_facts(root)}
    dep = Deployment(data_dir, nats_cluster=1)
    dep.up(free_port())
    rows: list[dict[str, Any]] = []
    try:
        res = dep.nexus("dataset", "publish", str(root), dataset_name, "--data-dir", str(data_dir), "--overwrite",
                        timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"`nexus dataset publish` failed: {res.stderr[-1000:]}")
        published = data_dir / "datasets" / "published" / dataset_name
        overrides = {"steps": args.steps, "lr": args.lr, "batch_size": args.batch_size}
        with Client.from_data_dir(data_dir, timeout_s=30) as client:
            for seed in args.seeds:
                spec = sft_spec(sft_base, seed, published, overrides)
                t0 = time.monotonic()
                rec = client.submit(spec).wait(timeout_s=args.timeout_s)
                row = {"seed": seed, "tenant": spec["tenant"], "state": rec.state, "message": rec.message,
                       "version": rec.step, "sft_wall_s": round(time.monotonic() - t0, 1),
                       "algorithm": spec["algorithm"], "metrics": rec.metrics}
                t0 = time.monotonic()
                ev = client.submit(eval_spec(ev_base, spec["tenant"], args.eval_episodes, args.eval_seed)).wait(
                    timeout_s=args.timeout_s)
                row.update(eval_state=ev.state, eval_message=ev.message, eval_success=success_rate(ev),
                           eval_wall_s=round(time.monotonic() - t0, 1), eval_metrics=ev.metrics)
                print(json.dumps({k: v for k, v in row.items() if k not in ("metrics", "eval_metrics")}), flush=True)
                rows.append(row)
    finally:
        dep.nexus("down", "--data-dir", str(data_dir), timeout=120)
        dep.cleanup()
    report["rows"] = rows
    return report


def table(report: dict[str, Any]) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f} %"

    lines = ["| seed | SFT state | steps | SFT wall | eval state | held-out success | eval wall |",
             "|---|---|---:|---:|---|---:|---:|"]
    for r in report["rows"]:
        lines.append(f"| {r['seed']} | {r['state']} | {r['version']} | {r['sft_wall_s']:.0f} s | {r['eval_state']} "
                     f"| {pct(r['eval_success'])} | {r['eval_wall_s']:.0f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(TASKS), default="pick",
                   help="PickCube-v1 or PushCube-v1 (examples/sft_maniskill_<task>cube.yaml and its eval)")
    p.add_argument("--seeds", default="1,2", help="comma-separated SFT seeds, one tenant each")
    p.add_argument("--episodes", type=int, default=150, help="demo episodes to record")
    p.add_argument("--demo-seed", type=int, default=0, help="demo attempt i resets with this + i")
    p.add_argument("--noise", type=float, default=0.1, help="DART noise on the executed expert action")
    p.add_argument("--dataset", type=Path, default=None, help="a recorded dataset dir (recorded there if absent)")
    p.add_argument("--eval-episodes", type=int, default=50)
    p.add_argument("--eval-seed", type=int, default=100_000, help="held-out reset seeds start here")
    p.add_argument("--steps", type=int, default=None, help="override the example's algorithm.steps")
    p.add_argument("--lr", type=float, default=None, help="override the example's algorithm.lr")
    p.add_argument("--batch-size", type=int, default=None, help="override the example's algorithm.batch_size")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per workload wait")
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--min-success", type=float, default=0.7, help="exit 1 when a seed scores below this")
    p.add_argument("--out", type=Path, default=None, help="write the report JSON here")
    args = p.parse_args(argv)
    stop_on_sigterm()  # a killed run takes its deployment down
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="nexus-maniskill-"))
    t0 = time.monotonic()
    report = run(args, data_dir)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    print(table(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"JSON: {args.out}")
    ok = sum((r["eval_success"] or 0) >= args.min_success for r in report["rows"])
    print(f"held-out success >= {100 * args.min_success:.0f} % on {ok} of {len(report['rows'])} seeds")
    return 0 if ok == len(report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
