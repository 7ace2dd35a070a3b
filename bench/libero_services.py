"""LIBERO through the services (issue 25 item 3): one `nexus up`; an SFT tenant trained from a
LIBERO-format LeRobot dataset (the `libero_like` fixture: cameras `observation.images.image` /
`observation.images.wrist_image` mapped onto the libero env's `agentview` / `robot0_eye_in_hand`,
state (8,), action (7,)), then an eval workload of its final export on a `libero/*` suite
through the inferencer, whose report carries the per-task success table.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.libero_services --steps 20 --tasks 0,1,2 \\
        --episodes-per-task 1 --max-episode-steps 60 --out docs/results/libero_services.json

The dataset has 3 demonstration episodes: the score is expected to be ~0. What this shows is
the path (dataset -> trainer -> export -> inferencer -> LIBERO simulator -> per-task report),
not a policy. LIBERO renders on CPU (llvmpipe), a few hundred ms per step with two cameras:
keep `--max-episode-steps` and the task count small on a small machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from transport.broker import free_port
from bench.chaos_deploy import Deployment, ROOT, stop_on_sigterm

FIXTURE = ROOT.parent / "shared" / "fixtures" / "lerobot" / "libero_like"
# The libero env's two cameras, in the order the dataset's are mapped onto them.
CAMERA_MAP = {"observation.images.image": "agentview", "observation.images.wrist_image": "robot0_eye_in_hand"}


def sft_spec(tenant: str, dataset: Path, steps: int, image_size: int = 64, state_dim: int = 8) -> dict[str, Any]:
    """SFT of a small flow head on the frozen tiny base from a LIBERO-format dataset, its
    observation the libero env's (cameras by name and size, the 8-d eef state)."""
    return {
        "tenant": tenant, "task": "sft", "base": "tiny-qwen3-vl-64",
        "action_module": {"kind": "flow", "params": {"width": 128, "depth": 2, "euler_steps": 4}},
        "observation": {"cameras": [{"name": n, "height": image_size, "width": image_size}
                                    for n in CAMERA_MAP.values()],
                        "state_dim": state_dim,
                        "instruction_template": "What action should the robot take to {instruction}?"},
        "action": {"dim": 7, "horizon": 4},
        "dataset": {"root": str(dataset), "camera_map": dict(CAMERA_MAP),
                    "state_key": "observation.state", "action_key": "action"},
        "algorithm": {"lr": 1e-4, "batch_size": 8, "steps": steps, "items_per_job": min(steps, 8)},
    }


def eval_spec(tenant: str, suite: str, tasks: list[int], episodes: int, max_episode_steps: int,
              image_size: int = 64) -> dict[str, Any]:
    """An eval of the tenant's latest export on a libero suite: ``episodes`` episodes spread
    round-robin over ``tasks``; short episodes (max_episode_steps) and no warm-up keep it cheap."""
    return {
        "tenant": tenant, "task": "eval",
        "env": {"id": f"libero/{suite}",
                "options": {"image_size": image_size, "max_episode_steps": max_episode_steps,
                            "task_cache_size": len(tasks)}},
        "eval": {"version": "latest", "episodes": episodes, "seed": 0, "tasks": list(tasks)},
    }


def run(args: argparse.Namespace, data_dir: Path) -> dict[str, Any]:
    from sdk import Client

    dep = Deployment(data_dir, nats_cluster=1)
    dep.up(free_port())
    out: dict[str, Any] = {"dataset": str(args.dataset), "suite": args.suite, "tasks": args.tasks,
                           "episodes_per_task": args.episodes_per_task, "sft_steps": args.steps,
                           "max_episode_steps": args.max_episode_steps}
    try:
        with Client.from_data_dir(data_dir, timeout_s=60) as client:
            t0 = time.monotonic()
            rec = client.submit(sft_spec(args.tenant, args.dataset, args.steps)).wait(timeout_s=args.timeout_s)
            out["sft"] = {"workload": rec.workload, "state": rec.state, "message": rec.message, "version": rec.step,
                          "loss": rec.metrics.get("loss"), "wall_s": round(time.monotonic() - t0, 1)}
            print(json.dumps(out["sft"]), flush=True)
            if rec.state != "completed":
                return out
            t0 = time.monotonic()
            episodes = args.episodes_per_task * len(args.tasks)
            wl = client.submit(eval_spec(args.tenant, args.suite, args.tasks, episodes, args.max_episode_steps))
            ev = wl.wait(timeout_s=args.timeout_s)
            report = client.download_report(wl.id, data_dir / "downloads")
            per_task = json.loads(Path(report).read_text()).get("per_task", [])
            out["eval"] = {"workload": ev.workload, "state": ev.state, "message": ev.message,
                           "version": int(ev.metrics.get("version", -1)),
                           "episodes": ev.episodes, "success_rate": ev.metrics.get("success_rate"),
                           "mean_return": ev.metrics.get("mean_return"), "wall_s": round(time.monotonic() - t0, 1),
                           "per_task": per_task}
    finally:
        dep.nexus("down", "--data-dir", str(data_dir), timeout=120)
        dep.cleanup()
    return out


def table(report: dict[str, Any]) -> str:
    rows = (report.get("eval") or {}).get("per_task") or []
    lines = ["| task | name | instruction | episodes | successes | success rate |", "|---:|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['task_index']} | {r['task']} | {r['instruction']} | {r['episodes']} | {r['successes']} "
                     f"| {100 * r['success_rate']:.0f} % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", type=Path, default=FIXTURE, help="a LIBERO-format LeRobot v3.0 root")
    p.add_argument("--suite", default="libero_spatial")
    p.add_argument("--tasks", default="0,1", help="comma-separated task indices of the suite")
    p.add_argument("--episodes-per-task", type=int, default=1)
    p.add_argument("--steps", type=int, default=8, help="SFT optimizer steps")
    p.add_argument("--max-episode-steps", type=int, default=40)
    p.add_argument("--tenant", default="libero-sft")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per workload wait")
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="write the report JSON here")
    args = p.parse_args(argv)
    stop_on_sigterm()  # a killed run takes its deployment down
    args.tasks = [int(t) for t in args.tasks.split(",") if t.strip()]
    if not (args.dataset / "meta" / "info.json").exists():
        print(f"no LeRobot dataset at {args.dataset} (meta/info.json): pass --dataset", file=sys.stderr)
        return 2
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="nexus-libero-"))
    report = run(args, data_dir)
    print(table(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"JSON: {args.out}")
    ev = report.get("eval") or {}
    ok = ev.get("state") == "completed" and sum(r["episodes"] for r in ev.get("per_task", [])) == ev.get("episodes")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
