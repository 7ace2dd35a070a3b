"""Progress of running workloads, for `nexus submit --wait`.

On a terminal each workload gets a live rich bar (steps / budget, episodes, loss or success
rate, rate and ETA); otherwise (a pipe, a log file, a test) one plain line is printed per change,
so logs stay readable. Only what a `WorkloadRecord` carries is used: this module imports no
torch and nothing of the roles.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from protocol.messages import WorkloadRecord, workload_steps

# How often `watch` asks the master for each workload's record.
POLL_S = 1.0
BAR_WIDTH = 20


@dataclass(frozen=True)
class Budget:
    """Where a workload stands against its budget: ``done`` of ``total`` ``unit``."""

    done: float
    total: float | None  # None: no finite budget known (a bar without an end)
    unit: str  # "steps", "episodes" or "s" (a wall-clock budget only)


def _family(rec: Any) -> str:
    """The built-in task whose progress a workload's kind shows (sft, rl, eval): a recipe of
    the eval family counts episodes, as an eval does."""
    return getattr(rec, "family", "") or rec.task


def budget_of(rec: Any, now: float | None = None) -> Budget:
    """The budget a workload's progress is measured against, read from its spec."""
    spec = rec.spec or {}
    budget = (spec.get("schedule") or {}).get("budget") or {}
    algo = spec.get("algorithm") or {}
    if _family(rec) == "eval":
        return Budget(rec.episodes, (spec.get("eval") or {}).get("episodes") or None, "episodes")
    # This workload's steps against its own budget (fixed at accept), never the tenant's
    # version against it: a tenant at version 384 given 128 more steps shows 0/128 at the start.
    done = workload_steps(rec)
    if getattr(rec, "start_version", -1) >= 0:
        steps = rec.budget_steps
    else:  # a record from before start_version: the spec's numbers were versions to reach
        steps = budget.get("max_steps") or (algo.get("steps") if _family(rec) == "sft" else None)
    if steps:
        return Budget(done, float(steps), "steps")
    wall = budget.get("max_wall_s")
    if wall:
        elapsed = max(0.0, (now if now is not None else time.time()) - rec.created_at)
        return Budget(min(elapsed, float(wall)), float(wall), "s")
    return Budget(done, None, "steps")


def budget_text(rec: Any) -> str:
    """What a training workload will train, as `nexus submit` says it: "from version 384, 128
    more steps (to version 512)"; "" for an eval or a record from before start_version."""
    start = getattr(rec, "start_version", -1)
    if _family(rec) == "eval" or start < 0:
        return ""
    if rec.budget_steps:
        return f"from version {start}, {rec.budget_steps} more steps (to version {start + rec.budget_steps})"
    return f"from version {start}"


def steps_text(rec: Any) -> str:
    """This workload's steps against its budget ("3/3"; "3" without a step budget; "-" for an eval)."""
    if _family(rec) == "eval":
        return "-"
    done = workload_steps(rec)
    return f"{done}/{rec.budget_steps}" if getattr(rec, "budget_steps", 0) else str(done)


@dataclass
class Rate:
    """Steps (eval: episodes) per second since the first record seen running, and the ETA."""

    t0: float | None = None
    d0: float = 0.0
    per_s: float | None = None
    eta_s: float | None = None
    _last: tuple = field(default=(), repr=False)

    def update(self, rec: Any, now: float) -> Rate:
        budget = budget_of(rec, now)
        count = rec.episodes if _family(rec) == "eval" else workload_steps(rec)
        if rec.state != "running":
            if rec.state != "pending":
                self.eta_s = 0.0
            return self
        if self.t0 is None:
            self.t0, self.d0 = now, count
            return self
        dt = now - self.t0
        if dt > 0 and count > self.d0:
            self.per_s = (count - self.d0) / dt
        if budget.total is None:
            self.eta_s = None
        elif budget.unit == "s":
            self.eta_s = max(0.0, budget.total - budget.done)
        elif self.per_s:
            self.eta_s = max(0.0, (budget.total - budget.done) / self.per_s)
        return self


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _metrics_text(rec: Any) -> str:
    m = rec.metrics or {}
    parts = []
    if "loss" in m:
        parts.append(f"loss={m['loss']:.4f}")
    success = m.get("success_rate", m.get("eval_success_rate"))
    if success is not None:
        parts.append(f"success={success:.0%}")
    if "mean_return" in m:
        parts.append(f"return={m['mean_return']:.3f}")
    return " ".join(parts)


def _count_text(rec: Any, budget: Budget) -> str:
    if budget.unit == "episodes":
        return f"{rec.episodes}/{int(budget.total)} episodes" if budget.total else f"{rec.episodes} episodes"
    if budget.unit == "s":
        return (f"step {workload_steps(rec)}  ep {rec.episodes}  "
                f"{fmt_duration(budget.done)}/{fmt_duration(budget.total)}")
    done = int(budget.done)
    steps = f"{done}/{int(budget.total)} steps" if budget.total else f"{done} steps"
    # The tenant's version, which the steps are not (before the first progress event: the start).
    steps += f" (v{max(rec.step, getattr(rec, 'start_version', -1))})"
    return f"{steps}  ep {rec.episodes}" if _family(rec) == "rl" else steps


def _rate_text(rec: Any, rate: Rate) -> str:
    if rate.per_s is None:
        return ""
    unit = "ep/s" if _family(rec) == "eval" else "steps/s"
    return f"{rate.per_s:.2f} {unit}"


def progress_line(rec: Any, rate: Rate | None = None, now: float | None = None) -> str:
    """One plain line: id, tenant, task, state, bar, count / budget, rate, ETA, metrics."""
    budget = budget_of(rec, now)
    bar = ""
    if budget.total:
        filled = int(min(1.0, budget.done / budget.total) * BAR_WIDTH)
        bar = "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"
    cells = [f"{rec.workload} {rec.tenant:<14} {rec.task:<4} {rec.state:<9}", bar, _count_text(rec, budget)]
    if rate is not None and rec.state == "running":
        cells += [_rate_text(rec, rate), f"eta {fmt_duration(rate.eta_s)}" if rate.eta_s is not None else ""]
    cells.append(_metrics_text(rec))
    if rec.state in ("failed", "cancelled") and rec.message:
        cells.append(f"({rec.message})")
    return "  ".join(c for c in cells if c)


def _change_key(rec: Any) -> tuple:
    """What makes a new plain line worth printing (rate and ETA alone do not)."""
    return (rec.state, rec.step, rec.episodes, _metrics_text(rec),
            rec.message if rec.state in ("failed", "cancelled") else "")


class PlainProgress:
    """One line per workload per change: for pipes, logs and tests."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._seen: dict[str, tuple] = {}

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def show(self, rec: Any, rate: Rate, now: float) -> None:
        key = _change_key(rec)
        if self._seen.get(rec.workload) == key:
            return
        self._seen[rec.workload] = key
        print(progress_line(rec, rate, now), file=self.out, flush=True)


class LiveProgress:
    """A rich progress bar per workload, redrawn in place on a terminal."""

    def __init__(self, out: TextIO) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn

        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(bar_width=30), TextColumn("{task.fields[count]}"),
            TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[eta]}"),
            TextColumn("{task.fields[metrics]}"),
            console=Console(file=out), auto_refresh=False, transient=False,
        )
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> LiveProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.refresh()
        self._progress.stop()

    def show(self, rec: Any, rate: Rate, now: float) -> None:
        budget = budget_of(rec, now)
        style = {"completed": "green", "failed": "red", "cancelled": "yellow"}.get(rec.state, "cyan")
        fields = {
            "description": f"[bold]{rec.workload}[/] {rec.tenant} {rec.task} [{style}]{rec.state}[/]",
            "count": _count_text(rec, budget),
            "rate": _rate_text(rec, rate) if rec.state == "running" else "",
            "eta": f"eta {fmt_duration(rate.eta_s)}" if rec.state == "running" and rate.eta_s is not None else "",
            "metrics": _metrics_text(rec) + (f" ({rec.message})" if rec.state in ("failed", "cancelled") else ""),
        }
        total = budget.total
        done = budget.done if rec.state != "completed" or total is None else total
        if rec.workload not in self._tasks:
            self._tasks[rec.workload] = self._progress.add_task(total=total, completed=done, **fields)
        else:
            self._progress.update(self._tasks[rec.workload], total=total, completed=done, **fields)
        self._progress.refresh()


async def watch(client: Any, workload_ids: Sequence[str], *, out: TextIO, live: bool,
                timeout_s: float, poll_s: float = POLL_S) -> list[Any]:
    """Poll every workload until each ends; show its progress; return the final records."""
    from protocol.errors import RequestTimeout
    from protocol.messages import TERMINAL_WORKLOAD_STATES

    view = LiveProgress(out) if live else PlainProgress(out)
    rates = {w: Rate() for w in workload_ids}
    final: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    with view:
        while True:
            pending = [w for w in workload_ids if w not in final]
            recs = await asyncio.gather(*(client.workload(w) for w in pending))
            now = time.time()
            for rec in recs:
                view.show(rec, rates[rec.workload].update(rec, now), now)
                if rec.state in TERMINAL_WORKLOAD_STATES:
                    final[rec.workload] = rec
            if len(final) == len(workload_ids):
                return [final[w] for w in workload_ids]
            if time.monotonic() > deadline:
                still = ", ".join(f"{r.workload} ({r.state})" for r in recs if r.workload not in final)
                raise RequestTimeout(f"workloads still running after {timeout_s:g} s: {still}")
            await asyncio.sleep(poll_s)


def format_progress(rec: WorkloadRecord) -> str:
    """One line: id, tenant, task, state, version / budget, episodes, key metrics."""
    budget = budget_of(rec)  # this workload's steps against its own budget, not the tenant's version
    target, steps = int(budget.total or 0), int(budget.done)
    bar = ""
    if target and _family(rec) != "eval" and budget.unit == "steps":
        done = min(1.0, steps / target)
        bar = "[" + "#" * int(done * 20) + "." * (20 - int(done * 20)) + f"] {steps}/{target}"
    elif _family(rec) == "eval":
        total = (rec.spec.get("eval") or {}).get("episodes", 0)
        bar = f"episodes {rec.episodes}/{total}"
    shown = {k: v for k, v in rec.metrics.items() if k in ("loss", "success_rate", "mean_return", "eval_success_rate")}
    metrics = " ".join(f"{k}={v:.3f}" for k, v in sorted(shown.items()))
    tail = f" ({rec.message})" if rec.state in ("failed", "cancelled") and rec.message else ""
    return f"{rec.workload} {rec.tenant:<14} {rec.task:<4} {rec.state:<9} {bar} {metrics}{tail}".rstrip()
