"""The report half of `bench.multitenant`: run records in, comparison, table and figures out.

Pure functions over plain dicts (what the runner writes as JSON), so a report can be rebuilt
from a saved JSON (`python -m bench.multitenant --replot FILE`) and tested without a deployment.

A *run record* (one deployment, `RunRecord.asdict()` in bench/mt_run.py):

    {"name": "shared" | "alone:<tenant>" | "scale:<n>", "ok": bool, "error": str,
     "wall_s": float, "up_s": float,
     "services": {"trainer": {"held_s", "held_ready_s", "busy_s", "pid"}, "inferencer": {...}},
     "timeline": {"trainer": [[t, busy_s_cumulative], ...], "inferencer": [...]},   # t: s since up began
     "tenants": {name: {"kind", "task", "state", "message", "version", "episodes", "success",
                        "loss", "train_rows", "infer_rows", "curve": [[t, work, value], ...]}},
     "weight_sync_s": [float, ...]}

Definitions (docs/results.md, "Multi-tenant vs isolated"):
* held device-seconds: the service's process lifetime, from its start to the end of the run
  (model load included: a private deployment holds its device from the start);
  ``held_ready_s``: the same from the moment the deployment was ready.
* busy device-seconds: the role's own meter (`actors.metering`: each grouped train step /
  forward, ended by a device synchronize on a GPU).
* total device time of a run: the sum of its services' held seconds (each service on its own
  device, as in the reference system); efficiency = sum over the isolated runs / shared run.
* utilisation = busy / held; gain = shared utilisation / the isolated runs' pooled utilisation.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

SERVICES = ("trainer", "inferencer")
# Issue 14, item 5 (the reference system's figures in brackets in the doc).
TARGETS = {"efficiency": 1.6, "trainer_util_gain": 2.5, "inferencer_util_gain": 1.5, "learning_points": 10.0}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def run_totals(run: dict[str, Any]) -> dict[str, Any]:
    """Device time and utilisation of one run."""
    out: dict[str, Any] = {"services": {}}
    total = total_ready = 0.0
    for svc in SERVICES:
        s = run["services"].get(svc, {})
        held, held_ready, busy = float(s.get("held_s", 0.0)), float(s.get("held_ready_s", 0.0)), float(s.get("busy_s", 0.0))
        total += held
        total_ready += held_ready
        out["services"][svc] = {"held_s": held, "held_ready_s": held_ready, "busy_s": busy,
                                "utilisation": _ratio(busy, held), "utilisation_ready": _ratio(busy, held_ready)}
    out["device_s"], out["device_ready_s"] = total, total_ready
    out["wall_s"] = float(run.get("wall_s", 0.0))
    return out


def tenant_work(run: dict[str, Any]) -> dict[str, float]:
    """Work the run's tenants did: optimizer steps, trained rows, predicted rows (env steps)."""
    steps = rows = infer = 0.0
    for t in run.get("tenants", {}).values():
        steps += float(t.get("version") or 0)
        rows += float(t.get("train_rows") or 0)
        infer += float(t.get("infer_rows") or 0)
    return {"optimizer_steps": steps, "train_rows": rows, "infer_rows": infer}


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "p95": None, "max": None, "mean": None}
    v = sorted(values)
    return {"n": len(v), "p50": v[len(v) // 2], "p95": v[min(len(v) - 1, math.ceil(0.95 * len(v)) - 1)],
            "max": v[-1], "mean": statistics.fmean(v)}


def failures(runs: list[dict[str, Any]]) -> list[str]:
    """One line per failed run: which, and why (its own error, or each unfinished tenant)."""
    out = []
    for r in runs:
        why = [r["error"]] if r.get("error") else []
        for name, t in r.get("tenants", {}).items():
            if t.get("state") != "completed":
                why.append(f"tenant {name} {t.get('state') or 'unknown'}: {t.get('message') or 'no message'}")
        if why or not r.get("ok", False):
            out.append(f"{r['name']}: " + ("; ".join(why) or "marked failed"))
    return out


def learning_value(t: dict[str, Any]) -> float | None:
    """The tenant's learning result in points (success rate x 100), where it has one."""
    s = t.get("success")
    return None if s is None else 100.0 * float(s)


def compare(shared: dict[str, Any], alone: list[dict[str, Any]]) -> dict[str, Any]:
    """The shared run against its isolated runs. Raises ValueError if any run failed (a
    comparison of a failed run would be a wrong figure, not a weak one)."""
    bad = failures([shared, *alone])
    if bad:
        raise ValueError("no comparison: " + " | ".join(bad))
    alone_by_tenant = {}
    for r in alone:
        if len(r["tenants"]) != 1:
            raise ValueError(f"{r['name']}: an isolated run must hold one tenant, holds {sorted(r['tenants'])}")
        alone_by_tenant.update(r["tenants"])
    missing = sorted(set(shared["tenants"]) - set(alone_by_tenant))
    extra = sorted(set(alone_by_tenant) - set(shared["tenants"]))
    if missing or extra:
        raise ValueError(f"tenants differ: no isolated run for {missing}, isolated only {extra}")
    a = run_totals(shared)
    bs = [run_totals(r) for r in alone]
    b_total = sum(b["device_s"] for b in bs)
    b_ready = sum(b["device_ready_s"] for b in bs)
    services = {}
    for svc in SERVICES:
        held = sum(b["services"][svc]["held_s"] for b in bs)
        busy = sum(b["services"][svc]["busy_s"] for b in bs)
        held_r = sum(b["services"][svc]["held_ready_s"] for b in bs)
        ua, ub = a["services"][svc]["utilisation"], _ratio(busy, held)
        services[svc] = {"shared": a["services"][svc],
                         "alone": {"held_s": held, "held_ready_s": held_r, "busy_s": busy, "utilisation": ub,
                                   "utilisation_ready": _ratio(busy, held_r)},
                         "util_gain": _ratio(ua or 0.0, ub or 0.0) if ub else None,
                         "util_gain_ready": _ratio(a["services"][svc]["utilisation_ready"] or 0.0,
                                                   _ratio(busy, held_r) or 0.0) if held_r and busy else None}
    wa, wb = tenant_work(shared), {k: sum(tenant_work(r)[k] for r in alone) for k in ("optimizer_steps", "train_rows", "infer_rows")}
    tenants = {}
    for name, ts in shared["tenants"].items():
        tb = alone_by_tenant[name]
        va, vb = learning_value(ts), learning_value(tb)
        tenants[name] = {"kind": ts.get("kind"), "task": ts.get("task"),
                         "shared": {k: ts.get(k) for k in ("success", "loss", "version", "episodes", "infer_rows")},
                         "alone": {k: tb.get(k) for k in ("success", "loss", "version", "episodes", "infer_rows")},
                         "delta_points": None if va is None or vb is None else va - vb}
    eff = _ratio(b_total, a["device_s"])
    eff_ready = _ratio(b_ready, a["device_ready_s"])
    deltas = [abs(t["delta_points"]) for t in tenants.values() if t["delta_points"] is not None]
    worst = max(deltas) if deltas else None
    targets = {
        "efficiency": {"value": eff, "target": TARGETS["efficiency"], "met": eff is not None and eff >= TARGETS["efficiency"]},
        "trainer_util_gain": {"value": services["trainer"]["util_gain"], "target": TARGETS["trainer_util_gain"],
                              "met": (services["trainer"]["util_gain"] or 0) >= TARGETS["trainer_util_gain"]},
        "inferencer_util_gain": {"value": services["inferencer"]["util_gain"], "target": TARGETS["inferencer_util_gain"],
                                 "met": (services["inferencer"]["util_gain"] or 0) >= TARGETS["inferencer_util_gain"]},
        "learning_points": {"value": worst, "target": TARGETS["learning_points"],
                            "met": worst is not None and worst <= TARGETS["learning_points"]},
    }
    return {"device_s": {"shared": a["device_s"], "alone_sum": b_total, "efficiency": eff,
                         "shared_ready": a["device_ready_s"], "alone_sum_ready": b_ready, "efficiency_ready": eff_ready},
            "wall_s": {"shared": a["wall_s"], "alone_sum": sum(b["wall_s"] for b in bs)},
            "work": {"shared": wa, "alone_sum": wb},
            "services": services, "tenants": tenants,
            "weight_sync_s": {"shared": percentiles(shared.get("weight_sync_s", [])),
                              "alone": percentiles([x for r in alone for x in r.get("weight_sync_s", [])]),
                              "stages_shared": shared.get("weight_sync_stages", {})},
            "breakdown": {"shared": breakdown(shared), "alone": [breakdown(r) for r in alone]},
            "targets": targets}


def breakdown(run: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Where each service's held seconds went: start-up (process start -> deployment ready),
    busy (metered), idle (the rest), each in seconds."""
    out = {}
    for svc in SERVICES:
        s = run["services"].get(svc, {})
        held, ready, busy = float(s.get("held_s", 0)), float(s.get("held_ready_s", 0)), float(s.get("busy_s", 0))
        out[svc] = {"held_s": held, "startup_s": max(0.0, held - ready), "busy_s": busy,
                    "idle_s": max(0.0, ready - busy)}
    return out


def planned_tenants(run: dict[str, Any]) -> int:
    """Tenants of a scaling run: those it recorded, else the count in its name (``scale:<n>``:
    a run that failed before recording them)."""
    if run.get("tenants"):
        return len(run["tenants"])
    _, _, n = run["name"].partition(":")
    return int(n) if n.isdigit() else 0


def scaling(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per shared run of the scaling curve: tenants, device time, per-unit cost, util."""
    rows = []
    for r in runs:
        tot, work = run_totals(r), tenant_work(r)
        rows.append({"tenants": planned_tenants(r), "ok": not failures([r]), "wall_s": tot["wall_s"],
                     "device_s": tot["device_s"], "device_ready_s": tot["device_ready_s"], **work,
                     "device_s_per_opt_step": _ratio(tot["device_s"], work["optimizer_steps"]),
                     "device_s_per_1k_env_steps": _ratio(1000 * tot["device_s"], work["infer_rows"]),
                     "trainer_util": tot["services"]["trainer"]["utilisation"],
                     "inferencer_util": tot["services"]["inferencer"]["utilisation"],
                     "errors": failures([r])})
    return rows


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Across seeds (each ``{"seed", "comparison", ...}``, a comparison None where a run of that
    seed failed): per tenant its result (points) shared and alone per seed, their means, the
    difference of the means and whether it is within ``TARGETS["learning_points"]``; the
    efficiency (total and from ready) per seed and its mean. Only compared seeds count."""
    done = [e for e in entries if e.get("comparison")]
    eff = {str(e["seed"]): {"total": e["comparison"]["device_s"]["efficiency"],
                            "ready": e["comparison"]["device_s"]["efficiency_ready"]} for e in done}
    tenants: dict[str, dict[str, Any]] = {}
    for e in done:
        for name, t in e["comparison"]["tenants"].items():
            row = tenants.setdefault(name, {"kind": t.get("kind"), "task": t.get("task"), "shared": {}, "alone": {},
                                            "loss_shared": {}, "loss_alone": {}})
            for side in ("shared", "alone"):
                v = learning_value(t[side])
                if v is not None:
                    row[side][str(e["seed"])] = v
                if t[side].get("loss") is not None:
                    row["loss_" + side][str(e["seed"])] = float(t[side]["loss"])
    limit = TARGETS["learning_points"]
    for row in tenants.values():
        ma, mb = _mean(list(row["shared"].values())), _mean(list(row["alone"].values()))
        row.update(shared_mean=ma, alone_mean=mb, delta_points=None if ma is None or mb is None else ma - mb)
        row["within_target"] = None if row["delta_points"] is None else abs(row["delta_points"]) <= limit
    mean_total = _mean([v["total"] for v in eff.values() if v["total"] is not None])
    mean_ready = _mean([v["ready"] for v in eff.values() if v["ready"] is not None])
    verdicts = [r["within_target"] for r in tenants.values()]
    return {"seeds": [e["seed"] for e in entries], "compared_seeds": [e["seed"] for e in done],
            "efficiency": {"per_seed": eff, "mean": {"total": mean_total, "ready": mean_ready}},
            "tenants": tenants,
            "targets": {
                "efficiency_ready": {"value": mean_ready, "target": TARGETS["efficiency"],
                                     "met": mean_ready is not None and mean_ready >= TARGETS["efficiency"]},
                "learning_points": {"value": max((abs(r["delta_points"]) for r in tenants.values()
                                                  if r["delta_points"] is not None), default=None),
                                    "target": limit, "met": bool(verdicts) and all(v is True for v in verdicts)}}}


def seed_runs(report: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(seed, runs) of every seed in a compare report; a file from before ``seeds`` existed is
    one seed (its config's)."""
    seed0 = (report.get("config") or {}).get("seed", 0) if isinstance(report.get("config"), dict) else 0
    seeds = report.get("seeds") or []
    if not seeds:
        return [(seed0, report["runs"])]
    return [(e["seed"], report["runs"] if k == 0 else e["runs"]) for k, e in enumerate(seeds) if e.get("runs")]


def seed_entries(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every seed of a compare report as ``{"seed", "runs", "comparison", "refused"}`` (a file
    from before ``seeds`` existed: one seed, its config's)."""
    runs = dict(seed_runs(report))
    seeds = report.get("seeds") or [{"seed": seed_runs(report)[0][0], "comparison": report.get("comparison"),
                                     "refused": report.get("refused", [])}]
    return [{"seed": e["seed"], "runs": runs.get(e["seed"]), "comparison": e.get("comparison"),
             "refused": e.get("refused", [])} for e in seeds]


def merge_compare(reports: list[dict[str, Any]], sources: list[str]) -> dict[str, Any]:
    """Compare reports of the same mix run in separate invocations (e.g. one seed each) as one
    report of all their seeds, in the single-invocation layout. Raises ValueError when the
    mixes differ or a seed repeats."""
    plans = [[(p["name"], p["kind"], p["budget"]) for p in (r.get("config") or {}).get("plans", [])] for r in reports]
    if any(pl != plans[0] for pl in plans):
        raise ValueError(f"the files' tenant mixes differ: {plans}")
    entries = [e for r in reports for e in seed_entries(r)]
    seeds = [e["seed"] for e in entries]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"a seed repeats across the files: {seeds}")
    first = entries[0]
    return {"kind": "compare", "config": reports[0]["config"], "configs": [r["config"] for r in reports],
            "runs": first["runs"], "comparison": first["comparison"],
            "refused": list(first["refused"]) + [f"seed {e['seed']}: {x}" for e in entries[1:] for x in e["refused"]],
            "seeds": [{**{k: v for k, v in first.items() if k != "runs"}, "runs": "top-level runs"}, *entries[1:]],
            "summary": summarize(entries), "merged_from": list(sources)}


# -- text --------------------------------------------------------------------------------------
def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(cmp: dict[str, Any]) -> str:
    lines = ["| service | held s shared | held s alone (sum) | busy s shared | busy s alone | util shared | util alone | gain |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for svc, s in cmp["services"].items():
        lines.append(f"| {svc} | {s['shared']['held_s']:.1f} | {s['alone']['held_s']:.1f} | {s['shared']['busy_s']:.1f} | "
                     f"{s['alone']['busy_s']:.1f} | {_f(s['shared']['utilisation'], '{:.1%}')} | "
                     f"{_f(s['alone']['utilisation'], '{:.1%}')} | {_f(s['util_gain'])}x |")
    d = cmp["device_s"]
    lines += ["", f"device time: shared {d['shared']:.1f} s, alone (sum) {d['alone_sum']:.1f} s -> efficiency "
              f"{_f(d['efficiency'])}x (from ready: {_f(d['efficiency_ready'])}x); wall shared "
              f"{cmp['wall_s']['shared']:.1f} s, alone (sum) {cmp['wall_s']['alone_sum']:.1f} s",
              f"weight sync s (p50 / p95): shared {_f(cmp['weight_sync_s']['shared']['p50'])} / "
              f"{_f(cmp['weight_sync_s']['shared']['p95'])}, alone {_f(cmp['weight_sync_s']['alone']['p50'])} / "
              f"{_f(cmp['weight_sync_s']['alone']['p95'])}",
              "weight sync stages, shared (p50 / p95 s): " + (", ".join(
                  f"{k} {_f(v['p50'], '{:.3f}')} / {_f(v['p95'], '{:.3f}')}"
                  for k, v in cmp["weight_sync_s"].get("stages_shared", {}).items()) or "not reported"), "",
              "| tenant | kind | opt steps shared / alone | env steps shared / alone | success shared / alone | loss shared / alone | delta (points) |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for name, t in cmp["tenants"].items():
        a, b = t["shared"], t["alone"]
        lines.append(f"| {name} | {t['kind']} | {a['version']} / {b['version']} | {a['infer_rows']} / {b['infer_rows']} | "
                     f"{_f(a['success'], '{:.0%}')} / {_f(b['success'], '{:.0%}')} | {_f(a['loss'], '{:.3f}')} / "
                     f"{_f(b['loss'], '{:.3f}')} | {_f(t['delta_points'], '{:+.0f}')} |")
    lines += ["", "| target | value | needed | met |", "|---|---:|---:|---|"]
    for name, t in cmp["targets"].items():
        op = "<=" if name == "learning_points" else ">="
        lines.append(f"| {name} | {_f(t['value'])} | {op} {t['target']} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines)


def summary_table(summary: dict[str, Any] | None) -> str:
    """Per tenant: results shared / alone per seed, their means and the verdict; efficiency."""
    if not summary:
        return "no summary (no seed ran)"
    seeds = [str(s) for s in summary["compared_seeds"]]
    lines = [f"across seeds {', '.join(seeds) or '(none compared)'} (of {', '.join(map(str, summary['seeds']))}):",
             "| tenant | kind | " + " | ".join(f"seed {s} shared / alone" for s in seeds)
             + " | mean shared / alone | delta (points) | within 10 |",
             "|---|---|" + "---:|" * len(seeds) + "---:|---:|---|"]
    for name, t in summary["tenants"].items():
        per = [f"{_f(t['shared'].get(s), '{:.0f}')} / {_f(t['alone'].get(s), '{:.0f}')}" for s in seeds]
        verdict = "-" if t["within_target"] is None else ("yes" if t["within_target"] else "NO")
        lines.append(f"| {name} | {t['kind']} | " + " | ".join(per) + f" | {_f(t['shared_mean'], '{:.1f}')} / "
                     f"{_f(t['alone_mean'], '{:.1f}')} | {_f(t['delta_points'], '{:+.1f}')} | {verdict} |")
    eff = summary["efficiency"]
    lines += ["", "efficiency (total / from ready): " + ", ".join(
        f"seed {s} {_f(v['total'])}x / {_f(v['ready'])}x" for s, v in eff["per_seed"].items())
        + f"; mean {_f(eff['mean']['total'])}x / {_f(eff['mean']['ready'])}x"]
    for name, t in summary["targets"].items():
        op = "<=" if name == "learning_points" else ">="
        lines.append(f"target {name}: {_f(t['value'])} (needed {op} {t['target']}): {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def scaling_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| tenants | wall s | device s | opt steps | env steps | device s / opt step | device s / 1k env steps | trainer util | inferencer util |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tenants']}{'' if r['ok'] else ' (FAILED)'} | {r['wall_s']:.1f} | {r['device_s']:.1f} | "
                     f"{r['optimizer_steps']:.0f} | {r['infer_rows']:.0f} | {_f(r['device_s_per_opt_step'], '{:.3f}')} | "
                     f"{_f(r['device_s_per_1k_env_steps'], '{:.1f}')} | {_f(r['trainer_util'], '{:.1%}')} | "
                     f"{_f(r['inferencer_util'], '{:.1%}')} |")
    return "\n".join(lines)


# -- figures -----------------------------------------------------------------------------------
def utilisation_series(samples: list[list[float]], bin_s: float) -> tuple[list[float], list[float]]:
    """Cumulative (t, busy) samples -> busy fraction per ``bin_s`` bin (bin starts, fractions)."""
    if len(samples) < 2:
        return [], []
    end = samples[-1][0]
    n = max(1, int(math.ceil(end / bin_s)))
    busy = [0.0] * n
    for (t0, b0), (t1, b1) in zip(samples, samples[1:]):
        if t1 <= t0 or b1 < b0:
            continue
        # The busy seconds reported between two polls are spread evenly over that gap.
        rate = (b1 - b0) / (t1 - t0)
        t = t0
        while t < t1:
            i = min(n - 1, int(t // bin_s))
            edge = min(t1, (i + 1) * bin_s)
            busy[i] += rate * (edge - t)
            t = edge if edge > t else t1
    return [i * bin_s for i in range(n)], [min(1.0, b / bin_s) for b in busy]


def load_pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a bench machine
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)  # small: the docs keep these PNGs (< 300 KB)
    plt.close(fig)
    return path


def plot(report: dict[str, Any], path: Path, bin_s: float = 2.0) -> Path:
    plt = load_pyplot()
    shared = report["runs"]["shared"]
    alone = report["runs"]["alone"]
    tenants = list(shared["tenants"]) if shared else []
    fig = plt.figure(figsize=(10, 11))
    grid = fig.add_gridspec(3, 2, height_ratios=[1, 1, 2.0])
    axes = [fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, :])]
    for ax, svc in zip(axes, SERVICES):
        if shared:
            x, y = utilisation_series(shared["timeline"].get(svc, []), bin_s)
            ax.fill_between(x, y, step="post", alpha=0.5, label=f"shared ({len(tenants)} tenants)")
        offset = 0.0
        for i, r in enumerate(alone):
            x, y = utilisation_series(r["timeline"].get(svc, []), bin_s)
            ax.step([offset + v for v in x], y, where="post", color="C1", lw=0.9,
                    label="isolated, one after another" if i == 0 else None)
            ax.axvline(offset, color="grey", lw=0.4, ls=":")
            offset += float(r.get("wall_s", x[-1] if x else 0.0))
        first = seed_runs(report)[0][0] if len(seed_runs(report)) > 1 else None
        ax.set(ylim=(0, 1.05), ylabel="busy fraction", title=f"{svc}: metered busy time per {bin_s:g} s"
               + ("" if first is None else f" (seed {first})"))
        ax.legend(loc="upper right", fontsize=8)
    axes[1].set_xlabel("seconds since the run's `nexus up` (isolated runs back to back)")
    learning_curves(fig.add_subplot(grid[2, :]), report)
    return save_figure(plt, fig, path)


def curve_xy(t: dict[str, Any]) -> tuple[list[float], list[float], str]:
    """A tenant's curve as (fraction of its budget, value, x unit): RL episodes / SFT optimizer
    steps over the budget (tenants of different budgets on one axis). Older files' curves,
    [t, step, value], have no work column: x is then wall seconds."""
    curve = t.get("curve") or []
    if not curve:
        return [], [], ""
    rl = t.get("task") == "rl"
    if len(curve[0]) < 4:
        return [c[0] for c in curve], [c[-1] for c in curve], "s"
    budget = float(t.get("budget") or 0) or max(c[2] if rl else c[1] for c in curve) or 1.0
    return [(c[2] if rl else c[1]) / budget for c in curve], [c[-1] for c in curve], "budget"


def learning_curves(ax: Any, report: dict[str, Any]) -> None:
    """The reference paper's Fig. 12 view on one axis: every tenant's learning curve, shared
    (solid) and alone (dashed), one colour per tenant; RL: success rate of the last 50 training
    episodes (left axis), SFT: training loss (right axis, log). x: the tenant's budget done.
    Every seed is drawn (later seeds thinner)."""
    per_seed = seed_runs(report)
    shared0 = per_seed[0][1].get("shared") if per_seed else None
    tenants = list(shared0["tenants"]) if shared0 else []
    ax_loss = None
    units = set()
    for k, (seed, runs) in enumerate(per_seed):
        for i, name in enumerate(tenants):
            alone = next((r for r in runs.get("alone", []) if name in r.get("tenants", {})), None)
            for run, style in ((runs.get("shared"), "-"), (alone, "--")):
                if not run or name not in run.get("tenants", {}):
                    continue
                t = run["tenants"][name]
                x, y, unit = curve_xy(t)
                if not x:
                    continue
                units.add(unit)
                if t.get("task") == "rl":
                    target = ax
                else:
                    ax_loss = ax_loss or ax.twinx()
                    target = ax_loss
                side = "shared" if style == "-" else "alone"
                label = f"{name} ({side}{', ' + t['task'].upper() + ' loss' if t.get('task') == 'sft' else ''})" if k == 0 else None
                target.plot(x, y, style, color=f"C{i}", lw=1.6 if k == 0 else 0.8, alpha=1.0 if k == 0 else 0.6,
                            marker="." if len(x) <= 20 else None, label=label)  # a short curve: its points
    if units == {"budget"}:
        ax.set_xlim(0, 1.02)
    ax.set(ylim=(-0.02, 1.05), ylabel="RL: success rate, last 50 training episodes",
           xlabel="fraction of the tenant's budget (RL: episodes, SFT: optimizer steps)" if units == {"budget"}
           else "seconds since `nexus up`",
           title="per-tenant learning curves (paper's Fig. 12 view): solid shared, dashed alone"
                 + (f"; seeds {', '.join(str(s) for s, _ in per_seed)}" if len(per_seed) > 1 else ""))
    handles, labels = ax.get_legend_handles_labels()
    if ax_loss is not None:
        ax_loss.set_yscale("log")
        ax_loss.set_ylabel("SFT: training loss (log)")
        h2, l2 = ax_loss.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        # Below the axis: the curves cover the whole plot area.
        ax.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4)


def plot_scaling(rows: list[dict[str, Any]], runs: list[dict[str, Any]], path: Path, bin_s: float = 2.0) -> Path:
    plt = load_pyplot()
    ok = [r for r in rows if r["ok"]]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 8.5))
    n = [r["tenants"] for r in ok]
    ax1.plot(n, [r["device_s_per_opt_step"] for r in ok], "o-", label="device s per optimizer step")
    ax1b = ax1.twinx()
    ax1b.plot(n, [r["device_s_per_1k_env_steps"] for r in ok], "s--", color="C1", label="device s per 1k env steps")
    ax1.set(xscale="log", xlabel="tenants", ylabel="device s / opt step", title="device time per unit of tenant work")
    ax1b.set_ylabel("device s / 1k env steps")
    ax1.minorticks_off()
    ax1.set_xticks(n, [str(v) for v in n])
    ax1.legend(loc="lower left", fontsize=8)
    ax1b.legend(loc="upper right", fontsize=8)
    ax2.plot(n, [r["trainer_util"] for r in ok], "o-", label="trainer")
    ax2.plot(n, [r["inferencer_util"] for r in ok], "s-", label="inferencer")
    ax2.set(xscale="log", xlabel="tenants", ylabel="busy / held", ylim=(0, 1.05), title="utilisation vs tenants")
    ax2.minorticks_off()
    ax2.set_xticks(n, [str(v) for v in n])
    ax2.legend(fontsize=8)
    for i, r in enumerate(runs):
        x, y = utilisation_series(r["timeline"].get("trainer", []), bin_s)
        ax3.step(x, y, where="post", lw=0.9, color=f"C{i}",
                 label=f"{planned_tenants(r)} tenants" + (" (failed)" if failures([r]) else ""))
    ax3.set(ylim=(0, 1.05), xlabel="seconds since `nexus up`", ylabel="trainer busy fraction",
            title="trainer busy timelines")
    ax3.legend(fontsize=8)
    return save_figure(plt, fig, path)
