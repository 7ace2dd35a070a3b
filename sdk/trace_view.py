"""`nexus trace`: a latency breakdown of the local traces, and a Chrome / Perfetto timeline.

    spans = load_spans(Path(".nexus/traces"))
    picked = select(spans, workload="w-rl")            # or trace_id="4bf9...", or since / until
    rows = breakdown(picked)                           # per span name: count, p50/p90/p99, share
    write_chrome(picked, Path("timeline.json"))        # opens in ui.perfetto.dev / chrome://tracing

The roles write their spans to ``DATA_DIR/traces/<role>-<instance>.jsonl`` (`actors.tracing`,
rotated files included). A trace crosses processes (W3C context in the NATS headers), so its
spans come from several files and join here by trace id.

**Share of the critical path.** A trace's messaging hops are asynchronous: a trainer's job span
is the child of the master's publish span but starts after it ended, so a parent's interval
does not hold its children's. The share is therefore taken on each trace's timeline (its first
span's start to its last span's end): every instant goes to the deepest span running then (a
stage rather than the request that holds it; the latest started among equals), an instant when
none runs to ``(gap)``. A stage's share is its time so taken over the selected traces' total.
The shares add up to 100 %.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from protocol.errors import BACK_PRESSURE_CODES, InvalidField, NotFound

GAP = "(gap)"
NEAREST = 5  # matches listed for an unknown trace id or workload


@dataclass
class Span:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root (or a parent in no file read)
    start: float  # unix seconds
    end: float
    kind: str  # SERVER, CLIENT, PRODUCER, CONSUMER, INTERNAL
    service: str  # e.g. nexus-trainer
    instance: str
    attributes: dict[str, Any] = field(default_factory=dict)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    error: bool = False

    @property
    def back_pressure(self) -> bool:
        """A request answered busy / over quota / draining: the caller waits, nothing failed
        (older spans carry these with an ERROR status; they are counted here, not as errors)."""
        return str(self.attributes.get("nexus.error_code", "")) in BACK_PRESSURE_CODES

    @property
    def duration(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def process(self) -> str:
        return f"{self.service}/{self.instance}"


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _hex(value: str | None) -> str:
    return (value or "").removeprefix("0x")


def parse_span(line: str) -> Span:
    """One line of a span file (the OTLP-JSON shape of `ReadableSpan.to_json`)."""
    d = json.loads(line)
    res = (d.get("resource") or {}).get("attributes") or {}
    return Span(
        name=d["name"], trace_id=_hex(d["context"]["trace_id"]), span_id=_hex(d["context"]["span_id"]),
        parent_id=_hex(d.get("parent_id")), start=_ts(d["start_time"]), end=_ts(d["end_time"]),
        kind=str(d.get("kind", "")).removeprefix("SpanKind."), service=str(res.get("service.name", "?")),
        instance=str(res.get("service.instance.id", "?")), attributes=d.get("attributes") or {},
        links=[(_hex(lk["context"]["trace_id"]), _hex(lk["context"]["span_id"])) for lk in d.get("links") or []],
        error=(d.get("status") or {}).get("status_code") == "ERROR")


def load_spans(traces_dir: Path) -> list[Span]:
    """Every span in ``traces_dir/*.jsonl``; a line cut short by a writer mid-flush is skipped."""
    traces_dir = Path(traces_dir)
    if not traces_dir.is_dir():
        raise NotFound(f"no trace directory {traces_dir}: the roles write their spans there "
                       f"(or to OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set); pass --data-dir",
                       details={"path": str(traces_dir)})
    spans: list[Span] = []
    for path in sorted(traces_dir.glob("*.jsonl")):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    spans.append(parse_span(line))
                except (ValueError, KeyError, TypeError):
                    continue  # the last line of a file still being written
    return spans


def parse_when(text: str, now: float) -> float:
    """``10m`` / ``90s`` / ``2h`` ago, or an ISO time (UTC unless it names a zone)."""
    text = text.strip()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text and text[-1] in units:
        try:
            return now - float(text[:-1]) * units[text[-1]]
        except ValueError:
            pass
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidField("since/until", f"{text!r} is neither a duration ago (90s, 10m, 2h, 1d) nor an ISO "
                                          "time (2026-12-01T14:05:00)") from None
    if t.tzinfo is None:
        from datetime import timezone

        t = t.replace(tzinfo=timezone.utc)
    return t.timestamp()


def nearest(want: str, candidates: Iterable[str]) -> list[str]:
    """The ``NEAREST`` candidates closest to ``want``: the longest common prefix first (an id
    typed with a wrong digit), then the most similar."""
    def common(c: str) -> int:
        n = 0
        while n < min(len(c), len(want)) and c[n] == want[n]:
            n += 1
        return n

    return sorted(candidates, key=lambda c: (-common(c), -difflib.SequenceMatcher(None, want, c).ratio(), c))[:NEAREST]


def select(spans: list[Span], *, trace_id: str = "", workload: str = "", since: float | None = None,
           until: float | None = None) -> list[Span]:
    """The whole traces a trace id (or a unique prefix of one), a workload (traces holding a
    span with its ``nexus.workload``) or a time window (traces with a span in it) names."""
    by_trace: dict[str, list[Span]] = {}
    for s in spans:
        by_trace.setdefault(s.trace_id, []).append(s)
    ids = set(by_trace)
    if trace_id:
        want = trace_id.lower().removeprefix("0x")
        hits = {t for t in ids if t.startswith(want)}
        if not hits:
            near = nearest(want, ids)
            raise NotFound(f"no trace {trace_id!r} in the trace files ({len(ids)} traces); nearest: "
                           + (", ".join(near) if near else "none (no traces)"),
                           details={"trace": trace_id, "nearest": near})
        if len(hits) > 1:
            raise InvalidField("trace", f"{trace_id!r} is a prefix of {len(hits)} traces: "
                                        + ", ".join(sorted(hits)[:NEAREST]) + "; give more digits")
        ids = hits
    if workload:
        holding = {s.trace_id for s in spans if s.attributes.get("nexus.workload") == workload}
        if not holding:
            known = sorted({str(s.attributes["nexus.workload"]) for s in spans if s.attributes.get("nexus.workload")})
            near = nearest(workload, known)
            raise NotFound(f"no trace of workload {workload!r} in the trace files (traces are sampled: "
                           f"NEXUS_TRACE_SAMPLE_RATIO keeps that share of updates); nearest: "
                           + (", ".join(near) if near else "none (no workload spans)"),
                           details={"workload": workload, "nearest": near})
        ids &= holding
    if since is not None or until is not None:
        lo, hi = since if since is not None else float("-inf"), until if until is not None else float("inf")
        ids = {t for t in ids if any(s.end >= lo and s.start <= hi for s in by_trace[t])}
    return [s for t in sorted(ids) for s in by_trace[t]]


def _depths(spans: list[Span]) -> dict[str, int]:
    """Depth of each span under its trace's root(s), through the parents found."""
    by_id = {s.span_id: s for s in spans}
    depth: dict[str, int] = {}

    def of(s: Span) -> int:
        chain = []
        cur: Span | None = s
        while cur is not None and cur.span_id not in depth:
            chain.append(cur)
            nxt = by_id.get(cur.parent_id) if cur.parent_id else None
            cur = nxt if nxt is not None and nxt not in chain else None
        base = depth[cur.span_id] if cur is not None else -1
        for c in reversed(chain):
            base += 1
            depth[c.span_id] = base
        return depth[s.span_id]

    for s in spans:
        of(s)
    return depth


def critical_seconds(spans: list[Span]) -> dict[str, float]:
    """Seconds of one trace's timeline attributed to each span name (see the module doc)."""
    if not spans:
        return {}
    depth = _depths(spans)
    events = sorted({s.start for s in spans} | {s.end for s in spans})
    starts = sorted(spans, key=lambda s: s.start)
    out: dict[str, float] = {}
    active: list[Span] = []
    i = 0
    for a, b in zip(events, events[1:]):
        while i < len(starts) and starts[i].start <= a:
            active.append(starts[i])
            i += 1
        active = [s for s in active if s.end > a]
        if not active:
            out[GAP] = out.get(GAP, 0.0) + (b - a)
            continue
        top = max(active, key=lambda s: (depth[s.span_id], s.start))
        out[top.name] = out.get(top.name, 0.0) + (b - a)
    return out


@dataclass
class Row:
    name: str
    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    share: float  # of the selected traces' summed wall time


def breakdown(spans: list[Span]) -> list[Row]:
    """Per span name: count, duration percentiles, share of the critical path; by share."""
    by_trace: dict[str, list[Span]] = {}
    for s in spans:
        by_trace.setdefault(s.trace_id, []).append(s)
    crit: dict[str, float] = {}
    for group in by_trace.values():
        for name, secs in critical_seconds(group).items():
            crit[name] = crit.get(name, 0.0) + secs
    total = sum(crit.values()) or 1.0
    durations: dict[str, list[float]] = {}
    for s in spans:
        durations.setdefault(s.name, []).append(s.duration * 1000)
    rows = []
    for name, ds in durations.items():
        p50, p90, p99 = (float(v) for v in np.percentile(ds, [50, 90, 99]))
        rows.append(Row(name, len(ds), p50, p90, p99, crit.get(name, 0.0) / total))
    if crit.get(GAP):
        rows.append(Row(GAP, 0, 0.0, 0.0, 0.0, crit[GAP] / total))
    return sorted(rows, key=lambda r: (-r.share, r.name))


def summary(spans: list[Span]) -> dict[str, Any]:
    traces = {s.trace_id for s in spans}
    wall = 0.0
    for t in traces:
        group = [s for s in spans if s.trace_id == t]
        wall += max(s.end for s in group) - min(s.start for s in group)
    return {"traces": len(traces), "spans": len(spans), "processes": sorted({s.process for s in spans}),
            "wall_s": wall, "errors": sum(s.error and not s.back_pressure for s in spans),
            "back_pressure": sum(s.back_pressure for s in spans)}


def render(spans: list[Span], title: str) -> Any:
    """The breakdown as a rich renderable (a heading line and the table)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    info = summary(spans)
    head = Text(f"{title}: {info['traces']} trace(s), {info['spans']} spans, {len(info['processes'])} processes, "
                f"{info['wall_s']:.3f} s of trace time, {info['errors']} error span(s), {info['back_pressure']} back-pressure "
                f"(busy / quota / draining: waited out, not errors)", style="bold")
    table = Table(box=None, pad_edge=False)
    for col, justify in (("STAGE", "left"), ("COUNT", "right"), ("P50 MS", "right"), ("P90 MS", "right"),
                         ("P99 MS", "right"), ("CRITICAL PATH", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in breakdown(spans):
        table.add_row(r.name, str(r.count) if r.count else "-", f"{r.p50_ms:.2f}" if r.count else "-",
                      f"{r.p90_ms:.2f}" if r.count else "-", f"{r.p99_ms:.2f}" if r.count else "-",
                      f"{100 * r.share:.1f}%")
    return Group(head, table)


def as_json(spans: list[Span]) -> dict[str, Any]:
    return {**summary(spans), "stages": [r.__dict__ for r in breakdown(spans)]}


def _lanes(spans: list[Span]) -> dict[str, int]:
    """Thread lanes within one process so every lane's spans nest (Chrome's "X" events must)."""
    lanes: list[list[float]] = []  # per lane: a stack of end times
    out: dict[str, int] = {}
    for s in sorted(spans, key=lambda s: (s.start, -s.end)):
        for i, stack in enumerate(lanes):
            while stack and stack[-1] <= s.start:
                stack.pop()
            if not stack or stack[-1] >= s.end:
                stack.append(s.end)
                out[s.span_id] = i
                break
        else:
            lanes.append([s.end])
            out[s.span_id] = len(lanes) - 1
    return out


def chrome_events(spans: Iterable[Span]) -> dict[str, Any]:
    """Chrome trace-event JSON (``traceEvents``): one process per role instance, complete
    ("X") events in microseconds, flow arrows from each parent to its child in another process."""
    spans = list(spans)
    procs = sorted({s.process for s in spans})
    pid = {p: i + 1 for i, p in enumerate(procs)}
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid[p], "tid": 0, "args": {"name": p}} for p in procs]
    tid: dict[str, int] = {}
    for p in procs:
        tid.update(_lanes([s for s in spans if s.process == p]))
    by_id = {s.span_id: s for s in spans}
    for s in spans:
        events.append({"name": s.name, "cat": s.kind.lower() or "span", "ph": "X", "ts": s.start * 1e6,
                       "dur": s.duration * 1e6, "pid": pid[s.process], "tid": tid[s.span_id],
                       "args": {"trace_id": s.trace_id, "span_id": s.span_id, "parent_id": s.parent_id,
                                **{k: v for k, v in s.attributes.items()}}})
        parent = by_id.get(s.parent_id)
        if parent is not None and parent.process != s.process:  # a hop: draw it
            flow = int(s.span_id[:12], 16)
            events.append({"name": "hop", "cat": "hop", "ph": "s", "id": flow, "pid": pid[parent.process],
                           "tid": tid[parent.span_id], "ts": parent.start * 1e6})
            events.append({"name": "hop", "cat": "hop", "ph": "f", "bp": "e", "id": flow, "pid": pid[s.process],
                           "tid": tid[s.span_id], "ts": s.start * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome(spans: Iterable[Span], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_events(spans)))
    return path
