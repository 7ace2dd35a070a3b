"""A Chrome / Perfetto trace-event JSON drawn as a timeline PNG (`nexus trace --png FILE`).

    write_png(chrome_events(spans), Path("timeline.png"))

The picture is the one Perfetto shows when the JSON is opened there: one band per process
(role instance), its thread lanes inside it (`sdk.trace_view._lanes` nests each lane's spans),
each lane's nested spans one row deeper per level, every complete ("X") event a bar from its start, coloured by span name, the longest
names labelled in a legend. It is for documents and reports where a browser is not at hand;
Perfetto (https://ui.perfetto.dev, "Open trace file") stays the interactive view.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

LEGEND_MAX = 14  # span names in the legend (by total time); the rest share a grey
WIDTH_IN, DPI = 11.0, 100


def _depths(bars: list[dict[str, Any]]) -> dict[int, int]:
    """Nesting depth of each event in its thread lane (Perfetto stacks a lane's slices so)."""
    out: dict[int, int] = {}
    stacks: dict[tuple[Any, Any], list[float]] = {}
    for e in sorted(bars, key=lambda e: (e["ts"], -e["dur"])):
        stack = stacks.setdefault((e["pid"], e["tid"]), [])
        while stack and stack[-1] <= e["ts"]:
            stack.pop()
        out[id(e)] = len(stack)
        stack.append(e["ts"] + e["dur"])
    return out


def write_png(chrome: dict[str, Any], path: Path, title: str = "") -> Path:
    """Draw ``chrome`` (``{"traceEvents": [...]}``) to ``path``; return it.

    Raises ValueError when it holds no complete event to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = chrome.get("traceEvents", [])
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    bars = [e for e in events if e.get("ph") == "X"]
    if not bars:
        raise ValueError("no complete (\"X\") events to draw: the selection holds no spans")
    t0 = min(e["ts"] for e in bars)
    level = _depths(bars)
    rows = sorted({(e["pid"], e["tid"], level[id(e)]) for e in bars})
    row_of = {r: i for i, r in enumerate(rows)}
    total: dict[str, float] = {}
    for e in bars:
        total[e["name"]] = total.get(e["name"], 0.0) + e["dur"]
    top = sorted(total, key=lambda n: -total[n])[:LEGEND_MAX]
    cmap = plt.get_cmap("tab20")
    colour = {n: cmap(i % 20) for i, n in enumerate(top)}

    height = min(9.0, 1.2 + 0.22 * len(rows))
    fig, ax = plt.subplots(figsize=(WIDTH_IN, height), dpi=DPI)
    groups: dict[tuple[int, str], list[tuple[float, float]]] = {}  # one draw call per row and colour
    for e in bars:
        key = (row_of[(e["pid"], e["tid"], level[id(e)])], e["name"] if e["name"] in colour else "")
        groups.setdefault(key, []).append(((e["ts"] - t0) / 1e6, max(e["dur"], 1.0) / 1e6))
    for (y, name), ranges in groups.items():
        ax.broken_barh(ranges, (y - 0.4, 0.8), facecolors=colour.get(name, (0.75, 0.75, 0.75)), linewidth=0)
    labels, first = [], {}
    for (pid, tid, depth), i in row_of.items():
        first.setdefault(pid, i)
        labels.append(names.get(pid, str(pid)) if first[pid] == i else f"lane {tid}" if depth == 0 else "")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    for pid, i in first.items():  # a rule between processes
        if i:
            ax.axhline(i - 0.5, color="black", linewidth=0.5)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("seconds from the first span")
    ax.grid(axis="x", linewidth=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[n]) for n in top]
    ax.legend(handles, top, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
