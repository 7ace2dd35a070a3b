"""Where a tenant may point the platform at files: the configured data roots only.

A dataset root a tenant names (a workload spec's ``dataset.root``, an env ``sample``) is read
by a platform process with the platform's file access, so it must resolve (symlinks
followed) under one of the data roots::

    roots = data_roots(Path(".nexus"))      # <data>/datasets, the shared fixtures, NEXUS_DATA_ROOTS
    confine("/etc/passwd", "dataset.root", roots)   # PermissionDenied naming the field and the roots

The platform's own callers (the admin CLI, the roles) are not confined: they already hold
every file the platform can read.
"""

from __future__ import annotations

import os
from pathlib import Path

from actors.identity import Caller, current_caller
from protocol.errors import PermissionDenied

ENV_DATA_ROOTS = "NEXUS_DATA_ROOTS"
# The fixtures the tests and examples read (../shared/fixtures beside the checkout); absent
# on a deployment, where it confines nothing.
SHARED_FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"


def data_roots(data_dir: Path) -> list[Path]:
    """``<data_dir>/datasets``, the shared fixtures, and every directory in
    ``NEXUS_DATA_ROOTS`` (os.pathsep-separated; the one place that variable is read)."""
    roots = [Path(data_dir) / "datasets", SHARED_FIXTURES]
    from protocol.settings import AuthSettings

    extra = AuthSettings.from_env().data_roots
    roots += [Path(p) for p in extra.split(os.pathsep) if p.strip()]
    return [Path(os.path.realpath(os.path.expanduser(r))) for r in roots]


def confine(path: str, field: str, roots: list[Path], caller: Caller | None = None) -> str:
    """``path`` unchanged if the caller is the platform or it resolves under a root; else
    `PermissionDenied` naming the field, the path and the roots."""
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
        f"put the dataset under one of them (an operator adds roots with {ENV_DATA_ROOTS})",
        details={"field": field, "path": path, "roots": [str(r) for r in roots], "caller": caller.tenant or caller.account},
    )
