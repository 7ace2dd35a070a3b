"""PPO from an SFT start on ManiSkill3, through the services (issue 25 item 2's RL step): per seed
one tenant with a `gaussian` action module is trained by SFT on the scripted expert's demos
(deliberately short: a start with room to improve), evaluated on held-out reset seeds, then
trained by PPO in rounds of `--round-episodes` rollout episodes, each round a workload of its
own that carries on from the tenant's newest version, each followed by the same evaluation.
The curve is held-out success after SFT and after every round (mean actions, the seeds never
used by demos or rollouts), beside each round's training success (sampled actions); the
headline is the points PPO gained over the SFT start.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m bench.maniskill_rl --task push --seeds 1,2 \\
        --dataset /tmp/push_demos --out docs/results/maniskill_rl_push.json

The dataset is the one `bench.maniskill_sft` records (recorded here when `--dataset` is absent);
the SFT and the PPO specs are the example SFT spec (`examples/sft_maniskill_<task>cube.yaml`)
with a `gaussian` head, and the example eval's env (`examples/eval_maniskill_<task>cube.yaml`)
with ManiSkill's normalised dense reward for PPO. One deployment (master, trainer, inferencer,
env worker on a real nats-server), seeds one after another.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from transport.broker import free_port
from bench.chaos_deploy import Deployment, stop_on_sigterm
from bench.maniskill_sft import TASKS, dataset_facts, eval_spec, record_demos, success_rate

# The action module both stages train: the example's width, PPO's exploration std (e^-1.5 ~
# 0.22 of the [-1, 1] action range: the SFT's NLL learns its own log_std from there).
GAUSSIAN = {"kind": "gaussian", "params": {"width": 256, "init_log_std": -1.5}}
# PPO on the task's normalised dense reward (in [0, 1] per step); short episodes (PushCube's
# expert needs ~10-17 steps of its 50), so a short horizon suffices, as in examples/rl_reach.yaml.
PPO = {"lr": 3e-4, "gamma": 0.9, "gae_lambda": 0.9, "clip_ratio": 0.2, "value_coef": 0.5, "entropy_coef": 0.0,
       "epochs": 2, "steps_per_update": 256, "parallel_envs": 2, "micro_batch": 64, "grad_clip": 0.5}


def action_module(value_detach: bool = False, init_log_std: float | None = None) -> dict[str, Any]:
    """`GAUSSIAN`, with `value_detach` (the value loss kept off the shared trunk) when asked, and
    another starting log-std (the exploration noise SFT starts from and PPO samples with)."""
    module = copy.deepcopy(GAUSSIAN)
    if value_detach:
        module["params"]["value_detach"] = True
    if init_log_std is not None:
        module["params"]["init_log_std"] = init_log_std
    return module


def sft_spec(example: dict[str, Any], tenant: str, seed: int, root: Path, steps: int,
             module: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = copy.deepcopy(example)
    spec.update(tenant=tenant, seed=seed, action_module=copy.deepcopy(module or GAUSSIAN))
    spec["dataset"]["root"] = str(root)
    spec["algorithm"].update(steps=steps, warmup_steps=min(spec["algorithm"]["warmup_steps"], steps // 10))
    spec.setdefault("outputs", {})["export_every_steps"] = max(1, steps)
    return spec


def rl_spec(sft: dict[str, Any], env: dict[str, Any], episodes: int, max_wall_s: float,
            value_warmup_episodes: int = 0, ppo: dict[str, Any] | None = None, kl_coef: float = 0.0,
            kl_anchor_version: int | None = None, max_inflight_jobs: int = 2) -> dict[str, Any]:
    """``ppo``: PPO's settings (default `PPO`; `--lr` / `--epochs` change them). ``kl_coef`` > 0:
    a KL term to the policy at ``kl_anchor_version`` (the SFT version: every round anchors to
    the SFT start, not to the previous round's end, which is where a round starts from)."""
    spec = {k: copy.deepcopy(sft[k]) for k in ("tenant", "base", "seed", "action_module", "observation", "action")}
    algorithm = {**(ppo or PPO), **({"value_warmup_episodes": value_warmup_episodes} if value_warmup_episodes else {})}
    if kl_coef > 0:
        algorithm.update(kl_coef=kl_coef, **({} if kl_anchor_version is None else
                                             {"kl_anchor_version": kl_anchor_version}))
    spec.update(task="rl", env=copy.deepcopy(env), algorithm=algorithm,
                schedule={"max_inflight_jobs": max_inflight_jobs, "staleness_bound": 64,
                          "budget": {"max_episodes": episodes, "max_wall_s": max_wall_s}})
    return spec


def ppo_env(env: dict[str, Any], ignore_terminations: bool) -> dict[str, Any]:
    """PPO's env: the eval's, success not ending an episode when asked (envs.maniskill
    ignore_terminations: how ManiSkill's own PPO trains); the evaluations keep the eval's."""
    out = copy.deepcopy(env)
    if ignore_terminations:
        out.setdefault("options", {})["ignore_terminations"] = True
    return out


def ppo_settings(args: argparse.Namespace) -> dict[str, Any]:
    """`PPO` with the bench's flags; ``--group-size`` > 1: outcome advantages over groups of
    episodes sharing a reset seed (algorithm.advantage group_success), updates of whole groups."""
    out = {**PPO, "lr": args.lr, "epochs": args.epochs, "micro_batch": args.micro_batch,
           "parallel_envs": args.parallel_envs}
    if args.group_size > 1:
        del out["steps_per_update"]
        out.update(advantage="group_success", group_size=args.group_size,
                   episodes_per_update=args.episodes_per_update or 2 * args.group_size)
    return out


def run(args: argparse.Namespace, data_dir: Path) -> dict[str, Any]:
    from sdk import Client

    from master.spec import load_document

    sft_path, eval_path, dataset_name = TASKS[args.task]
    sft_example, ev_example = load_document(sft_path.read_text()), load_document(eval_path.read_text())
    env = copy.deepcopy(ev_example["env"])
    rl_env = ppo_env(env, args.ignore_terminations)
    report: dict[str, Any] = {"task": args.task, "env": env, "seeds": args.seeds, "sft_steps": args.sft_steps,
                              "rounds": args.rounds, "round_episodes": args.round_episodes,
                              "value_warmup_episodes": args.value_warmup_episodes, "kl_coef": args.kl_coef,
                              "rl_env": rl_env, "max_inflight_jobs": args.max_inflight_jobs,
                              "eval_episodes": args.eval_episodes, "eval_seed": args.eval_seed,
                              "action_module": action_module(args.value_detach, args.init_log_std),
                              "ppo": ppo_settings(args),
                              "cpu_threads": os.environ.get("OMP_NUM_THREADS")}
    root = args.dataset or data_dir.parent / f"{data_dir.name}-demos"
    if not (root / "meta" / "info.json").is_file():
        report["record"] = record_demos(root, args.demo_episodes, 0, 0.1, env["options"], env["id"],
                                        timeout_s=args.timeout_s)
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
        with Client.from_data_dir(data_dir, timeout_s=30) as client:
            def evaluate(tenant: str) -> float | None:
                ev = client.submit(eval_spec(ev_example, tenant, args.eval_episodes, args.eval_seed)).wait(
                    timeout_s=args.timeout_s)
                return success_rate(ev) if ev.state == "completed" else None

            for seed in args.seeds:
                tenant = f"ppo-{args.task}cube-s{seed}"
                sft = sft_spec(sft_example, tenant, seed, published, args.sft_steps,
                               action_module(args.value_detach, args.init_log_std))
                t0 = time.monotonic()
                rec = client.submit(sft).wait(timeout_s=args.timeout_s)
                row: dict[str, Any] = {"seed": seed, "tenant": tenant, "sft_state": rec.state, "sft_version": rec.step,
                                       "sft_wall_s": round(time.monotonic() - t0, 1), "sft_eval": evaluate(tenant),
                                       "rounds": []}
                print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
                episodes = 0
                anchor = None  # the first round's own start: the SFT version, as the master records it
                for i in range(args.rounds):
                    t0 = time.monotonic()
                    # The value warm-up (if asked) in the first round only: the policy then starts
                    # from its SFT version with a value head that has seen that policy's returns.
                    warm = args.value_warmup_episodes if i == 0 else 0
                    # The KL anchor (if asked) is the SFT version in every round: a later round
                    # starts from the last one's end, but stays pulled toward the SFT policy (the
                    # version the first round started from, which its trainer copied).
                    spec = rl_spec(sft, rl_env, args.round_episodes, args.round_wall_s, warm, ppo_settings(args),
                                   kl_coef=args.kl_coef, kl_anchor_version=anchor,
                                   max_inflight_jobs=args.max_inflight_jobs)
                    rl = client.submit(spec).wait(timeout_s=args.timeout_s)
                    if anchor is None and args.kl_coef > 0:
                        anchor = row["kl_anchor_version"] = rl.start_version
                    episodes += rl.episodes or 0
                    rnd = {"round": i + 1, "state": rl.state, "message": rl.message, "version": rl.step,
                           "episodes": rl.episodes, "episodes_total": episodes, "train_success": success_rate(rl),
                           "wall_s": round(time.monotonic() - t0, 1), "eval": evaluate(tenant)}
                    print(json.dumps({"seed": seed, **rnd}), flush=True)
                    row["rounds"].append(rnd)
                    if rl.state != "completed":
                        break
                evals = [r["eval"] for r in row["rounds"] if r["eval"] is not None]
                row["gain_points"] = (None if row["sft_eval"] is None or not evals
                                      else round(100 * (evals[-1] - row["sft_eval"]), 1))
                rows.append(row)
    finally:
        dep.nexus("down", "--data-dir", str(data_dir), timeout=120)
        dep.cleanup()
    report["rows"] = rows
    return report


def table(report: dict[str, Any]) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f} %"

    n = max((len(r["rounds"]) for r in report["rows"]), default=0)
    head = "| seed | after SFT | " + " | ".join(f"round {i + 1} (train / eval)" for i in range(n)) + " | PPO episodes | gain |"
    lines = [head, "|---|---:|" + "---:|" * n + "---:|---:|"]
    for r in report["rows"]:
        cells = [f"{pct(x['train_success'])} / {pct(x['eval'])}" for x in r["rounds"]] + ["-"] * (n - len(r["rounds"]))
        total = r["rounds"][-1]["episodes_total"] if r["rounds"] else 0
        gain = "-" if r.get("gain_points") is None else f"{r['gain_points']:+.0f} pts"
        lines.append(f"| {r['seed']} | {pct(r['sft_eval'])} | " + " | ".join(cells) + f" | {total} | {gain} |")
    return "\n".join(lines)


# What must agree for runs to be merged into one report (seeds and round counts may differ).
SAME_SETTINGS = ("task", "env", "rl_env", "sft_steps", "round_episodes", "value_warmup_episodes", "kl_coef",
                 "max_inflight_jobs", "eval_episodes", "eval_seed", "action_module", "ppo")


def merge(paths: list[Path]) -> dict[str, Any]:
    """Reports of the same settings run apart (one process a seed, side by side) as one: their
    rows together. A setting that differs is refused naming it and both values."""
    reports = [json.loads(path.read_text()) for path in paths]
    first = reports[0]
    for path, rep in zip(paths[1:], reports[1:]):
        for key in SAME_SETTINGS:
            if rep.get(key) != first.get(key):
                raise ValueError(f"{path}: {key} is {rep.get(key)!r}, but {paths[0]} has {first.get(key)!r}: "
                                 "only runs of the same settings merge")
    merged = {**first, "rows": [row for rep in reports for row in rep["rows"]],
              "seeds": [s for rep in reports for s in rep["seeds"]], "merged_from": [str(p) for p in paths],
              "wall_s": max(rep.get("wall_s", 0.0) for rep in reports)}
    return merged


def plot(report: dict[str, Any], path: Path) -> Path | None:
    """Held-out success (mean actions) after SFT and after every PPO round, per seed, against
    PPO episodes; each round's training success (sampled actions) dashed; the seeds' mean bold."""
    try:
        import matplotlib
    except ImportError:
        print(f"no matplotlib here: no figure ({path}); the JSON has every number")
        return None
    matplotlib.use("Agg")  # files only: no display on a bench machine
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    curves = []
    for i, row in enumerate(report["rows"]):
        color = f"C{i}"
        xs = [0] + [r["episodes_total"] for r in row["rounds"]]
        ys = [row["sft_eval"]] + [r["eval"] for r in row["rounds"]]
        pts = [(x, 100 * y) for x, y in zip(xs, ys) if y is not None]
        ax.plot(*zip(*pts), "-o", color=color, ms=3, label=f"seed {row['seed']}: held-out (mean action)")
        train = [(r["episodes_total"], 100 * r["train_success"]) for r in row["rounds"]
                 if r["train_success"] is not None]
        if train:
            ax.plot(*zip(*train), "--", color=color, alpha=0.5, lw=1)
        curves.append(pts)
    n = min(len(c) for c in curves)
    if len(curves) > 1 and n:
        mean = [(curves[0][k][0], sum(c[k][1] for c in curves) / len(curves)) for k in range(n)]
        ax.plot(*zip(*mean), "-", color="k", lw=2.5, label=f"mean of {len(curves)} seeds")
    ax.set_xlabel("PPO rollout episodes (0: the SFT start)")
    ax.set_ylabel("success %")
    ax.set_ylim(-2, 102)
    ax.set_title(f"PPO from a {report['sft_steps']}-step SFT start, {report['task']} cube "
                 f"(dashed: training success, sampled actions)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(TASKS), default="push")
    p.add_argument("--seeds", default="1,2", help="comma-separated seeds, one tenant each")
    p.add_argument("--dataset", type=Path, default=None, help="a recorded dataset dir (recorded there if absent)")
    p.add_argument("--demo-episodes", type=int, default=150, help="demos to record when --dataset is absent")
    p.add_argument("--sft-steps", type=int, default=300, help="the SFT start's optimizer steps (short on purpose)")
    p.add_argument("--rounds", type=int, default=4, help="PPO workloads, each followed by an evaluation")
    p.add_argument("--round-episodes", type=int, default=100, help="rollout episodes per PPO round")
    p.add_argument("--round-wall-s", type=float, default=1200.0, help="each PPO round's wall-clock cap")
    p.add_argument("--eval-episodes", type=int, default=30)
    p.add_argument("--value-warmup-episodes", type=int, default=0,
                   help="the first round's first episodes train the value head only (algorithm.value_warmup_episodes)")
    p.add_argument("--kl-coef", type=float, default=0.0,
                   help="weight of a KL term to the SFT policy in every round (algorithm.kl_coef; 0: none)")
    p.add_argument("--ignore-terminations", action="store_true",
                   help="PPO's episodes run to their step limit past success (the env's ignore_terminations, as "
                        "ManiSkill's PPO baselines train); evaluations end at success as before")
    p.add_argument("--value-detach", action="store_true",
                   help="the gaussian head's value_detach: PPO's value loss trains the value net only, not the "
                        "trunk the SFT policy's mean reads")
    p.add_argument("--init-log-std", type=float, default=None,
                   help=f"the gaussian head's init_log_std (default {GAUSSIAN['params']['init_log_std']}): "
                        "PPO's sampling noise around the SFT mean")
    p.add_argument("--lr", type=float, default=PPO["lr"], help="PPO's learning rate")
    p.add_argument("--epochs", type=int, default=PPO["epochs"], help="PPO epochs per update")
    p.add_argument("--micro-batch", type=int, default=PPO["micro_batch"],
                   help="samples per optimizer step (256 = a whole update's rollout in one step)")
    p.add_argument("--group-size", type=int, default=1,
                   help="> 1: algorithm.advantage group_success, this many episodes per reset seed")
    p.add_argument("--episodes-per-update", type=int, default=0,
                   help="with --group-size: episodes per update, whole groups (default 2 groups)")
    p.add_argument("--parallel-envs", type=int, default=PPO["parallel_envs"], help="PPO's episodes at once")
    p.add_argument("--max-inflight-jobs", type=int, default=2,
                   help="PPO jobs queued ahead of the trainer (1: each rollout acts with the newest policy)")
    p.add_argument("--eval-seed", type=int, default=100_000, help="held-out reset seeds start here")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per workload wait")
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="write the report JSON here (and its figure beside)")
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="no run: merge these reports (same settings, seeds run apart) into --out, with the figure")
    args = p.parse_args(argv)
    if args.merge:
        if not args.out:
            p.error("--merge needs --out (the merged JSON; the figure goes beside it)")
        try:
            report = merge(args.merge)
        except (ValueError, OSError, KeyError) as exc:
            p.error(f"--merge: {exc}")
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(table(report))
        print(f"JSON: {args.out}; figure: {plot(report, args.out.with_suffix('.png'))}")
        return 0
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not 0 < args.lr <= 1:
        p.error(f"--lr {args.lr}: must be in (0, 1]")
    if not 0 <= args.kl_coef < float("inf"):
        p.error(f"--kl-coef {args.kl_coef}: must be >= 0 (0: no KL term)")
    for name in ("sft_steps", "rounds", "round_episodes", "eval_episodes", "epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if not 0 <= args.value_warmup_episodes < args.round_episodes:
        p.error(f"--value-warmup-episodes {args.value_warmup_episodes}: allowed 0..{args.round_episodes - 1} "
                "(within the first round, leaving it policy updates)")
    stop_on_sigterm()  # a killed run takes its deployment down
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="nexus-maniskill-rl-"))
    t0 = time.monotonic()
    report = run(args, data_dir)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    print(table(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"JSON: {args.out}; figure: {plot(report, args.out.with_suffix('.png'))}")
    gains = [r["gain_points"] for r in report["rows"] if r.get("gain_points") is not None]
    print(f"PPO gained {', '.join(f'{g:+.0f}' for g in gains) or 'nothing measured'} points over the SFT start")
    return 0 if len(gains) == len(report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
