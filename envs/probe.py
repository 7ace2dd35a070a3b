"""Try a snippet of Python in a child process: "can this machine do X?" without risking this one.

Simulator back ends (Vulkan, EGL) can crash or hang the process that loads a broken driver;
asking in a child keeps the caller (a test session, an env worker) alive and gives a reason.

    problem = probe_in_child("import mujoco", "MuJoCo import", timeout_s=30)
    if problem: print(problem)   # e.g. "MuJoCo import failed: ModuleNotFoundError: ..."
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def probe_in_child(code: str, label: str, *, timeout_s: float, env: dict[str, str] | None = None,
                   cwd: str | Path | None = None, tail_lines: int = 1) -> str | None:
    """None if ``code`` runs to exit status 0 in a fresh interpreter within ``timeout_s``;
    otherwise "<label> failed: <last lines of its output>" (or "... timed out ...")."""
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env if env is not None else dict(os.environ),
                              cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"{label} timed out after {timeout_s:.0f} s"
    if proc.returncode == 0:
        return None
    lines = (proc.stderr or proc.stdout).strip().splitlines() or [f"exit status {proc.returncode}"]
    return f"{label} failed: {' | '.join(lines[-tail_lines:])}"
