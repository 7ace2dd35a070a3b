"""The chaos run's table on stdout, from its JSON report (bench/chaos.py writes both)."""

from __future__ import annotations

import sys
from typing import Any


# -- output -----------------------------------------------------------------------------------
def fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:.1f}{unit}" if isinstance(x, float) else f"{x}{unit}"


def print_report(rep: dict[str, Any], out=sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    cfg = rep["config"]
    p(f"\nchaos suite: mode={cfg['mode']} budget={cfg['budget']} interval={cfg['interval_s']} "
      f"nats_cluster={cfg['nats_cluster']}")
    p(f"\n{'workload':<22} {'tenant':<22} {'task':<5} {'state':<10} {'version':>7} {'episodes':>8}")
    for wid, w in rep["workloads"].items():
        p(f"{wid:<22} {w['tenant']:<22} {w['task']:<5} {w['state']:<10} {w['version']:>7} {w['episodes']:>8}"
          + (f"  ({w['message'][:60]})" if w["state"] != "completed" and w["message"] else ""))
    p(f"\n{'tenant':<22} {'jobs':>5} {'cleared':>7} {'stale':>5} {'lost':>4} {'twice':>5} {'items':>6} "
      f"{'final v':>7} {'ckpt v':>6} {'ckpt ids':>8}")
    for t, a in rep["tenants"].items():
        p(f"{t:<22} {a['jobs']:>5} {a['cleared']:>7} {a['dropped_stale']:>5} {len(a['lost']):>4} "
          f"{len(a['twice']):>5} {a['items_trained']:>6} {fmt(a['final_version']):>7} "
          f"{fmt(a['checkpoint_version']):>6} {fmt(a['checkpoint_applied']):>8}")
        for what in ("lost", "twice", "order", "checkpoint"):
            for line in a[what][:5]:
                p(f"    {what}: {line}")
    r = rep["recovery"]
    p(f"\nrecovery (kill -> replacement registered ready): {r['kills']} kills, "
      f"p50 {fmt(r['registered_p50_s'], ' s')}, p99 {fmt(r['registered_p99_s'], ' s')}; "
      f"monitor sees it alive: p50 {fmt(r['monitor_alive_p50_s'], ' s')}, p99 {fmt(r['monitor_alive_p99_s'], ' s')}")
    p(f"{'role':<11} {'kills':>5} {'replaced':>8} {'p50':>7} {'max':>7}   progress while it was down (tenant: +versions/+episodes)")
    for role, b in r["by_role"].items():
        prog = rep["progress_while_down"].get(role, {})
        text = ", ".join(f"{t.split('-')[1]}: +{d['version']}/+{d['episodes']}" for t, d in sorted(prog.items()))
        p(f"{role:<11} {b['kills']:>5} {b['replaced']:>8} {fmt(b['recovery_p50_s'], 's'):>7} "
          f"{fmt(b['recovery_max_s'], 's'):>7}   {text}")
    n = rep["nats_node"]
    p(f"\nnats node: {n['skipped'] or ('killed pid %s, back after %s s %s' % (n['pid'], fmt(n['back_s']), n['note']))}")
    for k in rep["kill_log"]:
        if k["note"] or not k["replaced"]:
            p(f"  kill #{k['n']} {k['mode']} {k['role']}: replaced={k['replaced']} {k['note']}")
    for s in rep["observations"]:
        p(f"  observation: {s}")
    for s in rep["notes"]:
        p(f"  note: {s}")
    p("\ninvariants:")
    for name, v in rep["invariants"].items():
        p(f"  {'ok  ' if v['ok'] else 'FAIL'} {name:<28} {v['detail']}")
    p(f"\nresult: {'PASS' if not rep['failed'] else 'FAIL: ' + ', '.join(rep['failed'])}")
