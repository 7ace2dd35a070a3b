"""Where a deployment keeps datasets: each tenant's own, and the ones published for everyone.

    tenant_datasets(Path(".nexus"), "alice")   # <data>/datasets/tenants/alice
    data_roots(Path(".nexus"), "alice")        # + <data>/datasets/published, the shared fixtures, NEXUS_DATA_ROOTS
    publish_dataset("/data/pick", "pick", Path(".nexus"))   # the operator's `nexus dataset publish`

Under ``<data>/datasets/``: ``tenants/<tenant>/`` holds what the platform recorded for that
tenant (an SFT workload's env.demos), ``published/<name>/`` what the operator published for
every tenant. Here, on the transport floor, because the roles (which confine a tenant's paths
to these roots: actors/paths.py) and the SDK (which publishes) both need the layout.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_DATA_ROOTS = "NEXUS_DATA_ROOTS"
# The fixtures the tests and examples read (../shared/fixtures beside the checkout); absent
# on a deployment, where it confines nothing.
SHARED_FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
DATASETS_DIR = "datasets"
# Both below <data>/datasets and not tenant names themselves: a tenant's dir is one level down.
TENANT_DATASETS = "tenants"
PUBLISHED_DATASETS = "published"


def tenant_datasets(data_dir: Path, tenant: str) -> Path:
    """``<data_dir>/datasets/tenants/<tenant>``: what the platform records for ``tenant``."""
    from protocol.subjects import check_token

    return Path(data_dir) / DATASETS_DIR / TENANT_DATASETS / check_token("tenant", tenant)


def published_datasets(data_dir: Path) -> Path:
    """``<data_dir>/datasets/published``: the operator's datasets every tenant may read."""
    return Path(data_dir) / DATASETS_DIR / PUBLISHED_DATASETS


def data_roots(data_dir: Path, tenant: str | None = None) -> list[Path]:
    """The roots ``tenant`` may read: its own ``<data_dir>/datasets/tenants/<tenant>`` (none
    for a caller that is no tenant), ``<data_dir>/datasets/published``, the shared fixtures,
    and every directory in ``NEXUS_DATA_ROOTS`` (os.pathsep-separated; the one place that
    variable is read)."""
    roots = [tenant_datasets(data_dir, tenant)] if tenant else []
    roots += [published_datasets(data_dir), SHARED_FIXTURES]
    from protocol.settings import AuthSettings

    extra = AuthSettings.from_env().data_roots
    roots += [Path(p) for p in extra.split(os.pathsep) if p.strip()]
    return [Path(os.path.realpath(os.path.expanduser(r))) for r in roots]


def publish_dataset(src: str | Path, name: str, data_dir: Path, overwrite: bool = False) -> Path:
    """Copy the dataset directory ``src`` to ``<data_dir>/datasets/published/<name>`` (the
    operator's act: it writes the data dir), files read-only; return the new root.

    Refused (ValueError naming what is allowed): a name that is no token, a source without
    meta/info.json, a symlink inside ``src`` that leads out of it (it would publish whatever
    it points at), anything that is no file, directory or link. Links inside are copied as
    the files they name. Copied to a temp dir beside the target and renamed: readers never see
    half a dataset."""
    import shutil
    import stat
    import uuid

    from protocol.subjects import check_token

    check_token("name", name)
    root = Path(os.path.realpath(src))
    if not (root / "meta" / "info.json").is_file():
        raise ValueError(f"SRC: {str(src)!r} is no LeRobot dataset root (it has no meta/info.json)")
    for dirpath, dirnames, filenames in os.walk(root):
        for entry in dirnames + filenames:
            path = Path(dirpath) / entry
            real = Path(os.path.realpath(path))
            if path.is_symlink() and not (real == root or root in real.parents):
                raise ValueError(f"SRC: {str(path)!r} is a link out of the dataset (to {str(real)!r}); "
                                 "allowed: files and directories inside SRC (copy the target in instead)")
            if path.is_symlink() and real.is_dir() and (real == Path(dirpath) or real in Path(dirpath).parents):
                raise ValueError(f"SRC: {str(path)!r} links to a directory that holds it (a loop)")
            mode = os.stat(path).st_mode if real.exists() else 0
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ValueError(f"SRC: {str(path)!r} is neither a file nor a directory")
    area = published_datasets(data_dir)
    area.mkdir(parents=True, exist_ok=True)
    target = area / name
    if (target.exists() or target.is_symlink()) and not overwrite:
        raise ValueError(f"NAME: dataset {name!r} is already published at {target}; pass --overwrite to replace it")
    tmp = area / f".{name}.{uuid.uuid4().hex}.tmp"
    shutil.copytree(root, tmp, symlinks=False)
    for dirpath, _, filenames in os.walk(tmp):
        for entry in filenames:
            os.chmod(Path(dirpath) / entry, 0o444)  # nothing rewrites a published file in place
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target
