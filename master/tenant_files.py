"""What a deleted tenant left on the master's disk: reports, recorded datasets, TensorBoard runs.

`remove_tenant_files` is called by the master's ``tenant_delete`` after the records went
(the accounts and credentials are the CLI's: it holds ``<data>/auth``, docs/security.md).
Every path is derived from the checked tenant name and workload ids under the data dir; a
symlink is removed as a link, never followed out of it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from protocol.subjects import check_token


def _remove(path: Path) -> int:
    """Remove a file, a link or a directory tree; 1 if something was there."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
        return 1
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
        return 1
    return 0


def remove_tenant_files(data_dir: str | Path, tenant: str, reports: list[Path]) -> dict[str, int]:
    """Remove the tenant's reports (``reports``: each of its workloads' report file, and the
    ``<data>/reports/<tenant>`` dir), its recorded datasets (``<data>/datasets/tenants/<tenant>``,
    and ``<data>/datasets/<tenant>-<workload>`` as `workflows.sft` recorded demos before
    datasets were kept per tenant) and its TensorBoard run (``<data>/tensorboard/<tenant>``).
    Counts per kind (reports: files)."""
    check_token("tenant", tenant)
    root = Path(data_dir).resolve()
    inside = [p for p in reports if p.resolve().is_relative_to(root)]
    own_reports = root / "reports" / tenant
    inside = [p for p in inside if not p.resolve().is_relative_to(own_reports)]
    removed = {"reports": sum(_remove(p) for p in inside)}
    if own_reports.is_dir() and not own_reports.is_symlink():
        removed["reports"] += sum(1 for p in own_reports.rglob("*") if p.is_file() or p.is_symlink())
        _remove(own_reports)
    datasets = root / "datasets"
    # Exactly <tenant>-<workload id>: tenant "a" must not take tenant "a-b"'s "a-b-w..." dirs.
    own = re.compile(rf"^{re.escape(tenant)}-(w\d{{10}}[0-9a-f]{{6}}|i\d{{10}})$")
    n = 0
    if datasets.is_dir():
        n += sum(_remove(p) for p in datasets.iterdir() if own.match(p.name))
        # Never datasets/<tenant>: a tenant named "published" or "tenants" would take the
        # operator's published datasets or every tenant's (transport/datasets.py layout).
        n += _remove(datasets / "tenants" / tenant)
    removed["datasets"] = n
    removed["boards"] = _remove(root / "tensorboard" / tenant)
    _remove(root / "uploads" / tenant)  # starting weights staged and never finished (master/uploads.py)
    return removed
