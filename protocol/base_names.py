"""The names a base goes by outside a path: the preset names and the ``registered:`` prefix of
an operator's registered base: the spec (master/spec.py) checks a tenant's base against them and
the supervisor names its inference pools with them, neither importing the other."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

# A base the operator registered (`nexus base add NAME PATH`) is named ``registered:NAME``.
REGISTERED_BASE_PREFIX = "registered:"

_PRESETS_SOURCE = Path(__file__).resolve().parents[1] / "models" / "presets.py"


@functools.cache
def known_presets() -> tuple[str, ...]:
    """Base preset names, read from models/presets.py's source: importing models pulls in
    torch, which the supervisor (and `nexus`) must not."""
    tree = ast.parse(_PRESETS_SOURCE.read_text())
    names = {node.args[0].value for node in ast.walk(tree)
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Preset"
             and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)}
    return tuple(sorted(names))
