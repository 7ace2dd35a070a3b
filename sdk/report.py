"""A run report: per-tenant curves and the trainer / inferencer busy timeline, as JSON + PNG.

    from sdk.report import write_report
    json_path, png_path = await write_report(client, workload_ids, traces_dir, out_dir)

Curves come from the workloads' own events (kept in the events stream); the timeline from the
``trainer.round`` and ``inferencer.forward`` spans in the JSONL traces of the data dir.
Busy fraction = union of a role's span intervals / wall time of the run. Each tenant's entry
also holds the usage metered to its workload (device-seconds, rows, requests: docs/usage.md).
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from nats.js.errors import NotFoundError

from protocol.messages import WorkloadEvent
from protocol.wire import decode

TIMELINE_SPANS = {"trainer.round": "trainer", "inferencer.forward": "inferencer"}


async def workload_events(client: Any, workload: str) -> list[WorkloadEvent]:
    names, js = client.names, client.bus.js
    out, seq = [], 1
    while True:
        try:
            raw = await js.get_msg(names.stream_events, seq=seq, subject=names.workload_events(workload), next=True)
        except NotFoundError:
            return out
        out.append(decode(raw.data, WorkloadEvent))
        seq = raw.seq + 1


async def workload_usage(client: Any, workload: str) -> dict[str, Any]:
    """Metered usage charged to one workload (`nexus usage --workload W`), summed."""
    import msgspec

    from protocol.messages import UsageCounters

    total = UsageCounters()
    for r in (await client.usage(workload=workload)).records:
        total.add(r.usage)
    return msgspec.structs.asdict(total)


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def busy_intervals(traces_dir: Path, since: float) -> dict[str, list[tuple[float, float]]]:
    spans: dict[str, list[tuple[float, float]]] = {role: [] for role in TIMELINE_SPANS.values()}
    for path in Path(traces_dir).glob("*.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                span = json.loads(line)
            except ValueError:
                continue  # a line cut by a process killed mid-write
            role = TIMELINE_SPANS.get(span.get("name"))
            if role:
                start, end = _ts(span["start_time"]), _ts(span["end_time"])
                if end >= since:
                    spans[role].append((start, end))
    return {role: sorted(v) for role, v in spans.items()}


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


async def write_report(client: Any, workloads: list[str], traces_dir: Path, out_dir: Path,
                       started_at: float) -> tuple[Path, Path | None]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ended_at = time.time()
    tenants: dict[str, Any] = {}
    for wid in workloads:
        rec = await client.workload(wid)
        events = await workload_events(client, wid)
        curve = [{"t": e.at - started_at, "step": e.step, "episodes": e.episodes, **e.metrics}
                 for e in events if e.kind in ("progress", "done")]
        # A tenant runs workloads one after another (SFT, then an eval of it): one entry each.
        key = rec.tenant if rec.tenant not in tenants else f"{rec.tenant} ({rec.task})"
        tenants[key] = {"workload": wid, "task": rec.task, "state": rec.state, "version": rec.step,
                        "episodes": rec.episodes, "metrics": rec.metrics, "curve": curve,
                        "usage": await workload_usage(client, wid)}
    busy = busy_intervals(traces_dir, started_at)
    wall = max(1e-9, ended_at - started_at)
    report = {"started_at": started_at, "wall_s": wall, "tenants": tenants,
              "busy_fraction": {role: union_seconds(v) / wall for role, v in busy.items()},
              "busy_intervals": {role: [(s - started_at, e - started_at) for s, e in v] for role, v in busy.items()}}
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(report, indent=2))
    try:
        png = _plot(report, out_dir / "report.png")
    except ImportError:
        png = None  # matplotlib missing: the JSON has everything
    return json_path, png


def _plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_succ, ax_busy) = plt.subplots(3, 1, figsize=(9, 10))
    for tenant, t in report["tenants"].items():
        pts = [p for p in t["curve"] if "loss" in p]
        if pts:
            ax_loss.plot([p["step"] for p in pts], [p["loss"] for p in pts], marker=".", label=tenant)
        key = "success_rate"
        pts = [p for p in t["curve"] if key in p or "eval_success_rate" in p]
        if pts:
            ax_succ.plot([p["t"] for p in pts], [p.get(key, p.get("eval_success_rate")) for p in pts],
                         marker="o", label=f"{tenant} ({t['task']})")
    ax_loss.set(title="training loss per tenant", xlabel="policy version (optimizer steps)", ylabel="loss")
    ax_succ.set(title="success rate per tenant", xlabel="seconds since start", ylabel="success rate", ylim=(-0.05, 1.05))
    for ax in (ax_loss, ax_succ):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    for row, (role, intervals) in enumerate(report["busy_intervals"].items()):
        ax_busy.broken_barh([(s, e - s) for s, e in intervals], (row - 0.4, 0.8))
    roles = list(report["busy_intervals"])
    ax_busy.set_yticks(range(len(roles)), [f"{r} ({report['busy_fraction'][r]:.0%} busy)" for r in roles])
    ax_busy.set(title="busy timeline (trainer rounds, inferencer forwards)", xlabel="seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
