"""Where a tenant may point the platform at files: its own datasets and the shared ones only.

A dataset root a tenant names (a workload spec's ``dataset.root``, an env ``sample``) is read
by a platform process with the platform's file access, so it must resolve (symlinks
followed) under one of the caller's data roots::

    roots = data_roots(Path(".nexus"), "alice")
    # <data>/datasets/tenants/alice, <data>/datasets/published, the shared fixtures, NEXUS_DATA_ROOTS
    confine("/etc/passwd", "dataset.root", roots)   # PermissionDenied naming the field and the roots

Under ``<data>/datasets/`` (the layout: transport/datasets.py): ``tenants/<tenant>/`` holds what the platform recorded for that
tenant (an SFT workload's env.demos), ``published/<name>/`` what the operator published for
every tenant (`nexus dataset publish`); a tenant reads only its own dir and the published one,
and nothing a tenant asks for writes to the published one. The platform's own callers (the
admin CLI, the roles) are not confined: they already hold every file the platform can read.
"""

from __future__ import annotations

import os
from pathlib import Path

from actors.identity import Caller, current_caller
from protocol.errors import PermissionDenied
from transport.datasets import ENV_DATA_ROOTS, data_roots


def caller_roots(data_dir: Path, caller: Caller | None = None) -> list[Path]:
    """`data_roots` of the caller (its own tenant's datasets, and the shared ones)."""
    caller = caller or current_caller()
    return data_roots(data_dir, caller.tenant)


def confine(path: str, field: str, roots: list[Path], caller: Caller | None = None) -> str:
    """``path`` unchanged if the caller is the platform or it resolves under a root; else
    `PermissionDenied` naming the field, the path and the roots (the caller's own: another
    tenant's dir is never named)."""
    caller = caller or current_caller()
    if caller.is_platform:
        return path
    if not os.path.isabs(os.path.expanduser(path)):
        # Relative to which process's working directory? Not the tenant's to decide.
        raise PermissionDenied(f"{field}: {path!r} is relative; name an absolute path under the data roots "
                               f"({', '.join(str(r) for r in roots)})",
                               details={"field": field, "path": path, "caller": caller.tenant or caller.account})
    real = Path(os.path.realpath(os.path.expanduser(path)))
    for root in roots:
        if real == root or root in real.parents:
            return path
    raise PermissionDenied(
        f"{field}: {path!r} is outside the data roots ({', '.join(str(r) for r in roots)}); "
        f"put the dataset under one of them (an operator publishes one with `nexus dataset publish` "
        f"or adds roots with {ENV_DATA_ROOTS})",
        details={"field": field, "path": path, "roots": [str(r) for r in roots], "caller": caller.tenant or caller.account},
    )
