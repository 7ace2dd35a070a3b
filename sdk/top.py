"""`nexus top`: a live terminal view of the deployment, from the monitor's retained series.

Each second it asks the monitor's ``snapshot`` op (`MonitorSnapshot`) and draws two tables:
roles (state, uptime, device busy fraction, memory) and tenants (queue depth, jobs in flight,
policy version, latest loss / success rate / return, staleness). ``q`` quits; ``--once``
prints one frame, ``--json`` the same view as JSON (both for scripts and tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Any

from protocol import ops
from protocol.messages import MonitorSnapshot, SnapshotRequest

REFRESH_S = 1.0
SCALER_ROWS = 5  # the scaler's newest decisions shown
_TENANT_COLS = ("queue_depth", "jobs_in_flight", "policy_version", "loss", "success_rate", "mean_return",
                "staleness_versions")


async def fetch(client: Any) -> MonitorSnapshot:
    return await client.bus.call(ops.MONITOR_SNAPSHOT, SnapshotRequest(), timeout_s=client.timeout_s)


def build_view(snap: MonitorSnapshot) -> dict[str, Any]:
    """Roles and tenants rows from a snapshot (the JSON ``--json`` prints)."""
    per_instance: dict[tuple[str, str], dict[str, float]] = {}
    per_tenant: dict[str, dict[str, float]] = {}
    for s in snap.series:
        if not s.values:
            continue
        if "instance" in s.labels:
            per_instance.setdefault((s.labels["role"], s.labels["instance"]), {})[s.signal] = s.values[-1]
        elif "tenant" in s.labels:
            per_tenant.setdefault(s.labels["tenant"], {})[s.signal] = s.values[-1]
    roles = []
    for r in snap.roles:
        g = per_instance.get((r.role, r.instance), {})
        roles.append({"role": r.role, "instance": r.instance, "state": r.state, "uptime_s": r.uptime_s,
                      "busy_fraction": g.get("busy_fraction"), "memory_bytes": g.get("memory_bytes"),
                      "device_memory_bytes": g.get("device_memory_bytes"), "group_size": g.get("group_size")})
    tenants = [{"tenant": t, **{c: v.get(c) for c in _TENANT_COLS}} for t, v in sorted(per_tenant.items())]
    decisions = [{"role": d.role, "pool": d.pool, "from": d.from_count, "to": d.to_count, "reason": d.reason,
                  "outcome": d.outcome, "at": d.at} for d in snap.decisions]
    return {"roles": roles, "tenants": tenants, "decisions": decisions, "metrics_url": snap.metrics_url,
            "generated_at": snap.generated_at}


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _mb(v: Any) -> str:
    return "-" if v is None else f"{v / 2**20:.0f}M"


def render(view: dict[str, Any]) -> Any:
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    roles = Table(box=box.SIMPLE_HEAD, title="roles", title_justify="left", header_style="bold")
    for col in ("ROLE", "INSTANCE", "STATE", "UPTIME", "BUSY", "MEM", "DEVICE MEM", "GROUP"):
        roles.add_column(col, no_wrap=True)
    for r in view["roles"]:
        style = "" if r["state"] == "alive" else "red"
        roles.add_row(r["role"], r["instance"], r["state"], f"{r['uptime_s']:.0f}s",
                      _num(r["busy_fraction"], ".0%"), _mb(r["memory_bytes"]), _mb(r["device_memory_bytes"]),
                      _num(r["group_size"], ".1f"), style=style)
    tenants = Table(box=box.SIMPLE_HEAD, title="tenants", title_justify="left", header_style="bold")
    for col in ("TENANT", "QUEUE", "IN FLIGHT", "VERSION", "LOSS", "SUCCESS", "RETURN", "STALE"):
        tenants.add_column(col, no_wrap=True)
    for t in view["tenants"]:
        tenants.add_row(t["tenant"], _num(t["queue_depth"], ".0f"), _num(t["jobs_in_flight"], ".0f"),
                        _num(t["policy_version"], ".0f"), _num(t["loss"], ".4f"), _num(t["success_rate"], ".0%"),
                        _num(t["mean_return"], ".2f"), _num(t["staleness_versions"], ".0f"))
    stamp = time.strftime("%H:%M:%S", time.localtime(view["generated_at"]))
    where = f"  metrics {view['metrics_url']}" if view["metrics_url"] else ""
    parts = [Text(f"vla-nexus top  {stamp}{where}  (q quits)", style="bold"), roles, tenants]
    if view.get("decisions"):  # the scaler's (NEXUS_SCALER), newest last
        scaler = Table(box=box.SIMPLE_HEAD, title="scaler", title_justify="left", header_style="bold")
        for col in ("AT", "ROLE", "COUNT", "REASON", "OUTCOME"):
            scaler.add_column(col, no_wrap=col not in ("REASON", "OUTCOME"))
        for d in view["decisions"][-SCALER_ROWS:]:
            role = f"{d['role']} {d['pool']}" if d.get("pool") else d["role"]  # an inferencer pool's
            scaler.add_row(time.strftime("%H:%M:%S", time.localtime(d["at"])), role, f"{d['from']} -> {d['to']}",
                           d["reason"], d["outcome"] or "pending")
        parts.append(scaler)
    return Group(*parts)


@contextlib.contextmanager
def _keys(on_key: Any):
    """Single keypresses from a terminal stdin (cbreak mode, restored after); else nothing."""
    if not sys.stdin.isatty():
        yield
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    loop = asyncio.get_running_loop()
    tty.setcbreak(fd)
    loop.add_reader(fd, lambda: on_key(sys.stdin.read(1)))
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def live(client: Any, refresh_s: float = REFRESH_S) -> None:
    """Redraw every ``refresh_s`` until ``q`` (or Ctrl-C)."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    quit_ = asyncio.Event()
    with _keys(lambda ch: quit_.set() if ch in ("q", "Q") else None):
        with Live(Text("waiting for the monitor..."), console=Console(), auto_refresh=False, screen=False) as view:
            while not quit_.is_set():
                try:
                    view.update(render(build_view(await fetch(client))), refresh=True)
                except Exception as exc:  # monitor restarting: say so, keep trying
                    view.update(Text(f"monitor: {type(exc).__name__}: {exc}", style="red"), refresh=True)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(quit_.wait(), timeout=refresh_s)
