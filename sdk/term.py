"""Terminal output of the `nexus` command: red error lines, rich tables, JSON for scripts.

rich is imported on first use (not at `import sdk.cli`), and nothing wraps: off a terminal the
console is as wide as the longest line, so piped tables and errors keep one row per line.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

# Off a terminal rich would wrap at 80 columns; tables and errors must stay one line per row.
PIPE_WIDTH = 10_000


def _console(file: TextIO) -> Any:
    from rich.console import Console

    tty = file.isatty() if hasattr(file, "isatty") else False
    return Console(file=file, width=None if tty else PIPE_WIDTH, highlight=False, soft_wrap=not tty)


def console(file: TextIO | None = None) -> Any:
    """A rich console on ``file`` (stdout) that wraps only on a terminal (`nexus top --once`)."""
    return _console(file or sys.stdout)


def err(text: str, *, prefix: str = "error: ") -> None:
    """One red line on stderr (plain text when stderr is not a terminal)."""
    from rich.text import Text

    _console(sys.stderr).print(Text(prefix + text, style="bold red"), soft_wrap=True)


def err_detail(text: str) -> None:
    """An indented line under an error (e.g. one field error of a spec)."""
    from rich.text import Text

    _console(sys.stderr).print(Text(text, style="red"), soft_wrap=True)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, file: TextIO | None = None) -> None:
    """A borderless table: bold header, one line per row."""
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for name in header:
        t.add_column(name, no_wrap=True)
    for row in rows:
        t.add_row(*("" if c is None else str(c) for c in row))
    _console(file or sys.stdout).print(t)


TASK_TABLE_HEADER = ("task", "name", "instruction", "episodes", "successes", "success rate")


def task_rows(per_task: Sequence[Any]) -> list[list[Any]]:
    """An evaluation's per-task table (a report's ``per_task``: dicts or TaskResult rows) as
    table rows under TASK_TABLE_HEADER."""
    out = []
    for r in per_task:
        d = r if isinstance(r, dict) else {name: getattr(r, name) for name in r.__struct_fields__}
        out.append([d.get("task_index"), d.get("task", ""), d.get("instruction", ""), d.get("episodes", 0),
                    d.get("successes", 0), f"{100 * float(d.get('success_rate', 0.0)):.0f} %"])
    return out


def _struct_fields(obj: Any) -> dict[str, Any]:
    fields = getattr(type(obj), "__struct_fields__", None)
    if fields is None:
        raise TypeError(f"{type(obj).__name__} is not JSON serializable")
    return {name: getattr(obj, name) for name in fields}


def print_json(obj: Any) -> None:
    """Indented JSON on stdout (orjson: numpy scalars and dataclasses need no converter; wire
    messages, msgspec Structs, go as their fields)."""
    import orjson

    sys.stdout.write(orjson.dumps(obj, default=_struct_fields,
                                  option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")
    sys.stdout.flush()
