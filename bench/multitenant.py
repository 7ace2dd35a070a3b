"""Multi-tenant vs isolated: the same tenants on one shared deployment, and each alone on its own.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python -m bench.multitenant                 # 3 RL + 1 SFT, CPU, tiny base
    .venv/bin/python -m bench.multitenant --mix rl-reach:12,sft-reach:32 --out /tmp/mt.json
    .venv/bin/python -m bench.multitenant --scaling 1,2,4,8,16                       # shared side only
    .venv/bin/python -m bench.multitenant --replot bench/results/multitenant.json    # figures from a JSON
    NEXUS_SIM_TIMEOUT_S=600 .venv/bin/python -m bench.multitenant --seeds 1,2 \
        --mix rl-reach:1300,rl-reach-easy:600,rl-reach-top:1300,sft-pick:3000 \
        --rl-steps-per-update 512 --rl-parallel-envs 8 --rl-epochs 2 --pick-dataset DIR   # with learning
    python3 -m bench.multitenant --base qwen3-vl-4b --fast ...                       # on a GPU (docs/results.md)

What it does (issue 14, items 3-6):
  1. The tenant mix (``--mix``): each entry ``KIND[:BUDGET]``, KIND one of `TENANT_KINDS`
     (RL tenants on different tasks / task variants, ``rl-push`` on ManiSkill's PushCube,
     ``sft-pick``: SFT on ManiSkill's PickCube from the scripted expert's demos, recorded once per
     invocation with `nexus dataset record` or given with ``--pick-dataset``, published into each
     deployment that holds it, then an eval workload on held-out seeds), the budget a fixed
     amount of work: episodes for an RL tenant, optimizer steps for an SFT one (never wall
     time). Default 3 RL + 1 SFT, as in the reference system; where ManiSkill cannot run (no package or no Vulkan device), ``rl-push`` becomes ``rl-reach-top`` and the
     report says so (``--maniskill on`` makes that an error instead).
  2. (a) **shared**: one ``nexus up`` (a fresh temp data dir, a free port), every tenant
     submitted at once; (b) **alone**: for each tenant, a fresh ``nexus up`` holding only it,
     one after another. The deployment settings are the same for every run.
  3. While a run goes, every ``--poll-s`` (default ``POLL.every_s``): each service's metered busy seconds (its
     `info` op: the meter that charges tenants, `actors.metering`: each grouped train step or
     forward, ended by a device synchronize on a GPU) -> the busy timeline; the weight-sync
     lags the inferencers publish (``metrics.weight_sync_s.<tenant>``); workload states.
  4. At the end of a run (every workload terminal): held seconds per service (process start,
     from /proc, to the end), busy seconds, each tenant's result (RL: the success rate of its
     last training episodes; SFT: the closing evaluation's success rate and its loss), usage
     rows, curves from the workload events; then ``nexus down``.
  5. `bench.mt_report.compare`: device time shared vs the sum of the isolated runs
     (efficiency), utilisation per service and its gain, learning deltas, against issue 14's
     targets; JSON (``--out``), a PNG beside it (busy timelines of both runs; every tenant's
     learning curve, shared solid and alone dashed, on one axis: the paper's Fig. 12 view), and
     a table on stdout.
  6. ``--seeds 1,2``: steps 2-5 once per seed (each as ``--seed``); the JSON keeps the first
     seed's runs and comparison where a single-seed file has them, lists every seed under
     ``seeds`` and adds ``summary`` (`bench.mt_report.summarize`): per tenant the mean result
     shared vs alone and whether they are within 10 points, efficiency per seed and its mean.

Bad input: the mix, budgets, base and scaling list are checked before anything starts (exit 2,
one line naming the argument). Every deployment is stopped on the way out, on failure, Ctrl-C
or SIGTERM too (``nexus down``, then SIGKILL of whatever it left). A run that fails (``nexus up``
failed, a workload did not complete, a role restarted, the run timed out) stops the experiment;
the JSON then has ``"comparison": null`` and ``"refused"`` says which run failed and why, and
the exit status is 1. ``--resume THAT.json`` (the same command otherwise; another config is
refused naming what differs) keeps its successful shared run and the successful alone runs
before the failed one, lists them under the seed's ``resumed``, and runs the rest.

Beside this file: the tenant mix (bench/mt_mix.py), one run on one deployment (bench/mt_run.py)
and the report (bench/mt_report.py); this one runs the experiment and its command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from bench.mt_mix import (DEFAULT_MIX, DEFAULT_SCALING_KINDS, PICK_DATASET_NAME, PICK_DEMO_NOISE, PICK_DEMO_SEED,
                          PICK_DEMOS, PICK_EVAL_SEED, PICK_SFT, BadArgument, Sizes, TenantPlan, sft_pick, check_base,
                          parse_mix, parse_scaling, pick_env, scaled_mix)
from bench.mt_report import (compare, failures, merge_compare, planned_tenants, plot, plot_scaling, scaling,
                              scaling_table, summarize, summary_table, table)
from bench.mt_run import POLL, RESULTS, Config, MtDeployment, Runner, RunRecord

LIVE: list[MtDeployment] = []


def one_run(name: str, plans: list[TenantPlan], cfg: Config, n_for_settings: int, seed: int | None = None
            ) -> dict[str, Any]:
    data_dir = Path(tempfile.mkdtemp(prefix=f"nexus-mt-{name.replace(':', '-')}-")).resolve()
    dep = MtDeployment(data_dir, cfg.settings(n_for_settings))
    LIVE.append(dep)
    rec: RunRecord | None = None
    try:
        rec = asyncio.run(Runner(name, plans, cfg, dep, seed=seed).run())
    finally:
        notes = dep.cleanup()
        LIVE.remove(dep)
        # A failed run keeps its data dir: the roles' logs there (a crashed role's fault
        # handler dump) are the only record of why; the error line names one log line only.
        failed = rec is None or not rec.ok
        if not cfg.keep_data and not failed:
            shutil.rmtree(data_dir, ignore_errors=True)
    out = asdict(rec)
    out["cleanup"] = notes
    if failed:
        out["data_dir"] = str(data_dir)
    print(f"[multitenant {name}] {'ok' if rec.ok else 'FAILED: ' + '; '.join(failures([out]))} "
          f"(wall {rec.wall_s:.1f} s){'' if rec.ok else f'; logs kept in {data_dir}/logs'}", flush=True)
    return out


def _write(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))


def compare_seed(cfg: Config, seed: int, saved: Callable[[dict[str, Any]], None] = lambda entry: None,
                 done: dict[str, Any] | None = None) -> dict[str, Any]:
    """One seed: the shared run, then each tenant alone (stops at the first failed run);
    ``saved`` gets the seed's entry after each run (to put it on disk). ``done``: this seed's
    runs of an earlier invocation (`--resume`): its successful shared run and the successful
    prefix of its alone runs are kept (listed in the entry's ``resumed``), the rest run now."""
    entry: dict[str, Any] = {"seed": seed, "runs": {"shared": None, "alone": []}, "comparison": None, "refused": [],
                             "resumed": []}
    n = len(cfg.plans)
    tag = f" s{seed}" if len(cfg.run_seeds) > 1 else ""
    before = done or {"shared": None, "alone": []}
    kept_alone: list[dict[str, Any]] = []
    if before["shared"] is not None and not failures([before["shared"]]):
        shared = before["shared"]
        entry["resumed"].append(shared["name"])
        for r in before["alone"]:
            if failures([r]):
                break
            kept_alone.append(r)
    else:
        shared = one_run("shared" + tag, cfg.plans, cfg, n, seed)
    entry["runs"]["shared"] = shared
    saved(entry)
    if not failures([shared]):
        for i, p in enumerate(cfg.plans):
            if i < len(kept_alone):
                entry["runs"]["alone"].append(kept_alone[i])
                entry["resumed"].append(kept_alone[i]["name"])
                continue
            # Same settings as the shared run: only the number of tenants differs.
            r = one_run(f"alone:{p.name}" + tag, [p], cfg, n, seed)
            entry["runs"]["alone"].append(r)
            saved(entry)
            if failures([r]):
                break
    try:
        entry["comparison"] = compare(shared, entry["runs"]["alone"])
    except ValueError as exc:
        entry["refused"] = failures([shared, *entry["runs"]["alone"]]) or [str(exc)]
        skipped = [p.name for p in cfg.plans][len(entry["runs"]["alone"]):]
        if skipped:
            entry["refused"].append(f"not run (an earlier run failed): alone runs of {skipped}")
    return entry


def assemble(cfg: Config, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The compare report of these seeds. The first seed's runs, comparison and refusals stay
    at the top level (the single-seed layout other code reads); ``seeds`` lists every seed (the
    first one's runs are not repeated there), ``summary`` the per-tenant means across seeds."""
    report: dict[str, Any] = {"kind": "compare", "config": _config_json(cfg),
                              "runs": {"shared": None, "alone": []}, "comparison": None, "refused": [],
                              "seeds": [], "summary": summarize(entries)}
    for k, entry in enumerate(entries):
        if k == 0:
            report.update(runs=entry["runs"], comparison=entry["comparison"], refused=list(entry["refused"]))
            report["seeds"].append({**{key: v for key, v in entry.items() if key != "runs"}, "runs": "top-level runs"})
        else:
            report["seeds"].append(entry)
            report["refused"] += [f"seed {entry['seed']}: {r}" for r in entry["refused"]]
    return report


# Config keys a resumed invocation may change: notes say what this invocation noticed.
RESUME_FREE = frozenset({"notes"})


def resumed_runs(cfg: Config) -> dict[int, dict[str, Any]]:
    """Seed -> its runs in the `--resume` JSON (an earlier invocation of the same config that
    stopped or failed part-way). A JSON of another config is refused naming what differs."""
    if cfg.resume is None:
        return {}
    try:
        report = json.loads(cfg.resume.read_text())
    except (OSError, ValueError) as exc:
        raise BadArgument(f"--resume {cfg.resume}: not a readable JSON report ({exc})") from None
    if not isinstance(report, dict) or report.get("kind") != "compare":
        raise BadArgument(f"--resume {cfg.resume}: not a shared-vs-alone report (kind {report.get('kind')!r})"
                          if isinstance(report, dict) else f"--resume {cfg.resume}: not a report object")
    mine, theirs = _config_json(cfg), report.get("config", {})
    differ = sorted(k for k in set(mine) | set(theirs) if k not in RESUME_FREE and mine.get(k) != theirs.get(k))
    if differ:
        raise BadArgument(f"--resume {cfg.resume}: made with other settings ({', '.join(differ)} differ); "
                          "resume it with the same command")
    out: dict[int, dict[str, Any]] = {}
    for k, entry in enumerate(report.get("seeds", [])):
        runs = report["runs"] if k == 0 else entry.get("runs")
        if isinstance(runs, dict) and "seed" in entry:
            out[int(entry["seed"])] = {"shared": runs.get("shared"), "alone": list(runs.get("alone") or [])}
    return out


def run_compare(cfg: Config) -> tuple[int, dict[str, Any]]:
    """Every seed a full shared + alone pair (`assemble` says where each lands in the JSON).
    The JSON is rewritten after every run, so an invocation stopped half-way keeps the runs
    it finished (the unfinished seed marked incomplete)."""
    entries: list[dict[str, Any]] = []
    runs_per_seed = 1 + len(cfg.plans)

    def saved(entry: dict[str, Any]) -> None:
        done = (entry["runs"]["shared"] is not None) + len(entry["runs"]["alone"])
        partial = {**entry, "refused": [f"incomplete: {done} of {runs_per_seed} runs done (the invocation was "
                                        "still running, or was stopped)"]}
        _write(assemble(cfg, [*entries, partial]), cfg.out)

    earlier = resumed_runs(cfg)
    for seed in cfg.run_seeds:
        entry = compare_seed(cfg, seed, saved, earlier.get(seed))
        entries.append(entry)
        if entry["comparison"] is None:
            break
    report = assemble(cfg, entries)
    rest = cfg.run_seeds[len(entries):]
    if rest:
        report["refused"].append(f"not run (seed {entries[-1]['seed']} failed): seeds {rest}")
    _write(report, cfg.out)
    png = _plotted(plot, report, cfg.out)
    if report["comparison"] is not None:
        print("\n" + table(report["comparison"]))
    if len(cfg.run_seeds) > 1 or any(p.dataset for p in cfg.plans):
        print("\n" + summary_table(report["summary"]))
    for note in cfg.notes:
        print(f"note: {note}")
    print(f"\nJSON: {cfg.out}\nPNG:  {png}")
    if report["refused"]:
        print("\nNO COMPARISON for a seed: a run failed\n  " + "\n  ".join(report["refused"]), file=sys.stderr)
        return 1, report
    return 0, report


def _plotted(fn: Callable[..., Path], *args: Any) -> str:
    """The PNG beside the JSON; where matplotlib is missing (a bare GPU machine), say how to
    make it later from the JSON instead of losing the run."""
    *rest, out = args
    try:
        return str(fn(*rest, out.with_suffix(".png")))
    except ImportError as exc:
        return f"not drawn ({exc}); draw it with: python -m bench.multitenant --replot {out}"


def run_scaling(cfg: Config) -> tuple[int, dict[str, Any]]:
    report: dict[str, Any] = {"kind": "scaling", "config": _config_json(cfg), "runs": [], "rows": [], "refused": []}
    for n in cfg.scaling:
        r = one_run(f"scale:{n}", scaled_mix(cfg.plans, n), cfg, n)
        report["runs"].append(r)
        if failures([r]):
            report["refused"] = failures([r]) + [f"not run: {[m for m in cfg.scaling if m > n]}"]
            break
    report["rows"] = scaling(report["runs"])
    _write(report, cfg.out)
    png = _plotted(plot_scaling, report["rows"], report["runs"], cfg.out)
    print("\n" + scaling_table(report["rows"]))
    print(f"\nJSON: {cfg.out}\nPNG:  {png}")
    if report["refused"]:
        print("\nFAILED RUN: " + " | ".join(report["refused"]), file=sys.stderr)
        return 1, report
    return 0, report


def _config_json(cfg: Config) -> dict[str, Any]:
    return {"plans": [asdict(p) for p in cfg.plans], "base": cfg.base, "fast": cfg.fast, "sizes": asdict(cfg.sizes),
            "run_timeout_s": cfg.run_timeout_s, "poll_s": cfg.poll_s, "seed": cfg.seed, "scaling": cfg.scaling, "notes": cfg.notes,
            "settings_shared": cfg.settings(max([len(cfg.plans), *cfg.scaling])), "seeds": cfg.run_seeds,
            "datasets": {k: str(v) for k, v in cfg.datasets.items()}, "dataset_facts": cfg.dataset_facts}


# -- the PickCube dataset (sft-pick) -----------------------------------------------------------
def pick_dataset_problem(root: Path) -> str | None:
    """Why ``root`` cannot train sft-pick (None: it can): no LeRobot dataset there, or features
    that do not fit the tenant's spec (the master's own check, before anything starts)."""
    from master.spec import dataset_errors, parse_spec

    info = root / "meta" / "info.json"
    if not info.is_file():
        return f"{str(root)!r} holds no LeRobot dataset (no meta/info.json); record one with --pick-demos, or give its root"
    try:
        json.loads(info.read_text())
    except ValueError as exc:
        return f"{str(info)!r} is not JSON: {exc}"
    errors = dataset_errors(parse_spec(sft_pick("check", 1, "tiny-qwen3-vl-64", 0, Sizes())), root)
    if errors:
        return (f"{str(root)!r} does not fit sft-pick ({PICK_SFT}): "
                + "; ".join(f"{field}: {why}" for field, why, _ in errors)
                + " (record it with --env-option 'state_keys=[\"extra\"]', as bench.maniskill_sft does)")
    return None


def prepare_datasets(cfg: Config) -> None:
    """The PickCube demos, once per invocation: --pick-dataset as given (checked in
    build_config), else recorded now with `nexus dataset record` (every seed and run publishes
    the same one)."""
    if not any(p.dataset == PICK_DATASET_NAME for p in cfg.plans):
        return
    from bench.maniskill_sft import dataset_facts, record_demos

    root = cfg.pick_dataset
    facts: dict[str, Any] = {}
    if root is None:
        root = Path(tempfile.mkdtemp(prefix="nexus-mt-pick-demos-")).resolve()
        env_id, options = pick_env()
        print(f"[multitenant] recording {cfg.pick_demos} PickCube demos into {root} (reuse: --pick-dataset {root})",
              flush=True)
        try:
            facts["record"] = record_demos(root, cfg.pick_demos, PICK_DEMO_SEED, PICK_DEMO_NOISE, options, env_id,
                                           timeout_s=6 * 3600)
            problem = pick_dataset_problem(root)
            if problem:
                raise RuntimeError(f"the recorded dataset: {problem}")
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)  # nothing half-written left behind (Ctrl-C too)
            raise
        print(f"[multitenant] {facts['record']['summary']} ({facts['record']['wall_s']} s)", flush=True)
    last_demo_seed = PICK_DEMO_SEED + 2 * dataset_facts(root)["episodes"] + 10  # record's attempt cap
    if last_demo_seed > PICK_EVAL_SEED:
        raise BadArgument(f"--pick-demos: demo seeds up to {last_demo_seed} would reach the eval seeds {PICK_EVAL_SEED}..")
    facts.update(root=str(root), **dataset_facts(root))
    cfg.datasets[PICK_DATASET_NAME] = root
    cfg.dataset_facts[PICK_DATASET_NAME] = facts


def replot(paths: list[Path], out: Path | None = None) -> int:
    """The PNG and table again from saved JSON. Several scaling files (counts run in separate
    invocations) merge into one curve, several compare files of one mix (seeds run in separate
    invocations) into one report with the summary across their seeds; written to ``out``."""
    reports = [json.loads(p.read_text()) for p in paths]
    if len(reports) > 1:
        kinds = {r.get("kind") for r in reports}
        if len(kinds) != 1 or kinds - {"scaling", "compare"}:
            print("error: --replot: only files of one kind can be merged: scaling files (--scaling runs), or "
                  "compare files of the same mix (e.g. one seed each)", file=sys.stderr)
            return 2
        if out is None or out.suffix != ".json":
            print("error: --out: merging several files needs --out FILE.json", file=sys.stderr)
            return 2
    if len(reports) > 1 and reports[0].get("kind") == "compare":
        try:
            merged = merge_compare(reports, [str(p) for p in paths])
        except ValueError as exc:
            print(f"error: --replot: {exc}", file=sys.stderr)
            return 2
        _write(merged, out)
        reports, paths = [merged], [out]
    elif len(reports) > 1:
        runs = [run for r in reports for run in r["runs"]]
        good = {run["name"] for run in runs if not failures([run])}
        # A count that failed in one invocation and ran clean in another: the clean run counts.
        dropped = [run["name"] for run in runs if failures([run]) and run["name"] in good]
        runs = sorted((run for run in runs if not (failures([run]) and run["name"] in good)), key=planned_tenants)
        merged = {"kind": "scaling", "config": [r["config"] for r in reports], "runs": runs,
                  "rows": scaling(runs), "refused": failures(runs),
                  "replaced_failed_runs": [f"{n}: failed in one file, ran clean in another" for n in dropped],
                  "merged_from": [str(p) for p in paths]}
        _write(merged, out)
        reports, paths = [merged], [out]
    report, path = reports[0], paths[0]
    if report.get("kind") == "scaling":
        report["rows"] = scaling(report["runs"])  # the current definitions, not the file's
        print(scaling_table(report["rows"]))
        print(f"PNG: {_plotted(plot_scaling, report['rows'], report['runs'], path)}")
    else:
        print(table(report["comparison"]) if report.get("comparison")
              else "NO COMPARISON: " + " | ".join(report.get("refused", [])))
        if report.get("summary"):
            print("\n" + summary_table(report["summary"]))
        print(f"PNG: {_plotted(plot, report, path)}")
    return 0


def build_config(args: argparse.Namespace) -> Config:
    """Every argument checked before anything starts (BadArgument names the one at fault)."""
    check_base(args.base)
    if not 0 < args.run_timeout_s <= 86400:
        raise BadArgument(f"--run-timeout-s: {args.run_timeout_s}: must be in (0, 86400]")
    scaling_counts = parse_scaling(args.scaling) if args.scaling else []
    mix = args.mix or (DEFAULT_SCALING_KINDS if scaling_counts else DEFAULT_MIX)
    plans, notes = parse_mix(mix, args.maniskill)
    sizes = Sizes(sft_demos=args.sft_demos, sft_eval_episodes=args.sft_eval_episodes,
                  rl_steps_per_update=args.rl_steps_per_update, rl_parallel_envs=args.rl_parallel_envs,
                  rl_epochs=args.rl_epochs, pick_eval_episodes=args.pick_eval_episodes)
    for name, value, lo, hi in (("--sft-demos", sizes.sft_demos, 1, 10_000),
                                ("--sft-eval-episodes", sizes.sft_eval_episodes, 1, 1000),
                                ("--rl-steps-per-update", sizes.rl_steps_per_update, 8, 100_000),
                                ("--rl-parallel-envs", sizes.rl_parallel_envs, 1, 64),
                                ("--rl-epochs", sizes.rl_epochs, 1, 16),
                                ("--pick-eval-episodes", sizes.pick_eval_episodes, 1, 1000),
                                ("--pick-demos", args.pick_demos, 1, 10_000)):
        if not lo <= value <= hi:
            raise BadArgument(f"{name}: {value} is outside {lo}..{hi}")
    seeds = parse_seeds(args.seeds) if args.seeds else []
    if seeds and scaling_counts:
        raise BadArgument("--seeds: the scaling curve (--scaling) runs one seed (--seed)")
    has_pick = any(p.kind == "sft-pick" for p in plans)
    pick_dataset = None
    if args.pick_dataset is not None:
        if not has_pick:
            raise BadArgument(f"--pick-dataset: no sft-pick tenant in the mix ({mix!r}) to train from it")
        pick_dataset = args.pick_dataset.resolve()
        problem = pick_dataset_problem(pick_dataset)
        if problem:
            raise BadArgument(f"--pick-dataset: {problem}")
    if not 0.1 <= args.poll_s <= 10:
        raise BadArgument(f"--poll-s: {args.poll_s}: must be in [0.1, 10]")
    if not 0 <= args.trainer_group_max <= 256:
        raise BadArgument(f"--trainer-group-max: {args.trainer_group_max} is outside 0..256 (0: fit the tenants)")
    out = args.out or RESULTS / ("multitenant-scaling.json" if scaling_counts else "multitenant.json")
    if out.suffix != ".json":
        raise BadArgument(f"--out: {str(out)!r} must end in .json (the PNG goes beside it)")
    return Config(plans=plans, base=args.base, fast=args.fast, sizes=sizes, run_timeout_s=args.run_timeout_s,
                  seed=args.seed, out=out, scaling=scaling_counts, notes=notes, keep_data=args.keep_data,
                  resume=args.resume,
                  trainer_group_max=args.trainer_group_max, poll_s=args.poll_s, seeds=seeds,
                  pick_dataset=pick_dataset, pick_demos=args.pick_demos)


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise BadArgument(f"--seeds: {text!r}: need comma-separated integers, e.g. 1,2") from None
    if len(set(seeds)) != len(seeds) or any(not 0 <= x <= 1_000_000 for x in seeds):
        raise BadArgument(f"--seeds: {text!r}: seeds must be distinct, each in 0..1000000")
    return seeds


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.multitenant", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mix", help=f"KIND[:BUDGET],... (default {DEFAULT_MIX}; with --scaling, the kinds cycled: "
                                 f"{DEFAULT_SCALING_KINDS}); budgets: RL episodes, SFT optimizer steps")
    p.add_argument("--maniskill", default="auto", help="auto | on | off: rl-push on ManiSkill (auto: a stand-in where it cannot run)")
    p.add_argument("--base", default="tiny-qwen3-vl-64", help="base preset or directory (every tenant's, and the inferencer's)")
    p.add_argument("--fast", action="store_true", help="the inferencer's fast engine (CUDA graphs; NEXUS_INFER_FAST)")
    p.add_argument("--scaling", help="tenant counts, e.g. 1,2,4,8,16: the shared side only, per count")
    p.add_argument("--sft-demos", type=int, default=Sizes.sft_demos)
    p.add_argument("--sft-eval-episodes", type=int, default=Sizes.sft_eval_episodes)
    p.add_argument("--rl-steps-per-update", type=int, default=Sizes.rl_steps_per_update)
    p.add_argument("--rl-parallel-envs", type=int, default=Sizes.rl_parallel_envs)
    p.add_argument("--trainer-group-max", type=int, default=0,
                   help="jobs per trainer round in every run (default: the shared run's tenant count, at least 4)")
    p.add_argument("--poll-s", type=float, default=POLL.every_s,
                   help="seconds between samples of the services' busy time (each an info request)")
    p.add_argument("--run-timeout-s", type=float, default=600.0, help="one run (deployment) at most this long")
    p.add_argument("--seed", type=int, default=0, help="tenant i's spec seed is 1 + i + this")
    p.add_argument("--seeds", help="e.g. 1,2: each seed (as --seed) a full shared + alone pair; a summary across them")
    p.add_argument("--rl-epochs", type=int, default=Sizes.rl_epochs, help="PPO epochs per update of the RL tenants")
    p.add_argument("--pick-dataset", type=Path, default=None,
                   help="sft-pick: a PickCube LeRobot dataset recorded before (default: record --pick-demos now)")
    p.add_argument("--pick-demos", type=int, default=PICK_DEMOS, help="sft-pick: demo episodes to record")
    p.add_argument("--pick-eval-episodes", type=int, default=Sizes.pick_eval_episodes,
                   help=f"sft-pick: closing eval episodes on held-out seeds ({PICK_EVAL_SEED}..)")
    p.add_argument("--out", type=Path, help="JSON path (PNG beside it); default bench/results/multitenant[-scaling].json")
    p.add_argument("--keep-data", action="store_true", help="keep each run's temp data dir (logs)")
    p.add_argument("--resume", type=Path, default=None, metavar="JSON",
                   help="an earlier invocation's JSON (same command): its successful shared run and alone runs "
                        "are kept, the missing or failed ones run now")
    p.add_argument("--replot", type=Path, nargs="+", metavar="JSON",
                   help="rebuild the PNG and table from saved JSON (several scaling files: merged into --out); runs nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.replot:
        return replot(args.replot, args.out)
    try:
        cfg = build_config(args)
    except BadArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in cfg.notes:
        print(f"note: {note}", flush=True)

    # SIGTERM (a timeout, a CI cancel) unwinds like Ctrl-C, so every finally cleans up.
    def _term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        try:
            prepare_datasets(cfg)
        except BadArgument as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"error: the PickCube demos could not be recorded: {exc}", file=sys.stderr)
            return 1
        try:
            code, _ = run_scaling(cfg) if cfg.scaling else run_compare(cfg)
        except BadArgument as exc:  # --resume of another config, or not a report
            print(f"error: {exc}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        for dep in list(LIVE):  # a deployment whose own finally was cut short
            dep.cleanup()
        print(f"[multitenant] interrupted; every deployment it started was stopped; the runs it finished are in "
              f"{cfg.out}", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
