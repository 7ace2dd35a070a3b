"""Workload reports on the master's disk: ``<data>/reports/<tenant>/<report_path>``, written
when a workload ends, read back by ``workload_report``, pruned per tenant (`master.workloads`).
Every path part is checked again and opened without following links."""

from __future__ import annotations

import json
import os
import re
import stat
import uuid
from pathlib import Path
from typing import Any

from protocol.messages import MAX_TASK_ROWS, MAX_TASK_TEXT, TaskResult, WorkloadRecord
from protocol.policy import MAX_REPORTS_PER_TENANT
from protocol.wire import to_body


def bounded_task_rows(rows: list[TaskResult]) -> list[TaskResult]:
    """An event's per-task table as the record keeps it: MAX_TASK_ROWS rows by task index,
    texts cut to MAX_TASK_TEXT, counts made consistent (an event is a workflow's word, and a
    record must stay small enough for KV and the report's reader)."""
    out = []
    for r in sorted(rows, key=lambda r: r.task_index)[:MAX_TASK_ROWS]:
        episodes = max(0, r.episodes)
        successes = min(max(0, r.successes), episodes)
        out.append(TaskResult(task_index=r.task_index, task=r.task[:MAX_TASK_TEXT],
                              instruction=r.instruction[:MAX_TASK_TEXT], episodes=episodes, successes=successes,
                              success_rate=successes / episodes if episodes else 0.0))
    return out

REPORTS_DIR = "reports"

# A report read back is the master's own JSON: anything larger is not one.
MAX_REPORT_BYTES = 16 * 1024 * 1024

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)

def report_parts(rec: WorkloadRecord) -> list[str]:
    """The report's place under the data dir, as path parts: ``reports/<tenant>/`` and then
    outputs.report_path (default ``<workload>.json``), each part checked again (a record
    stored before the rule, or written by hand, is no exception)."""
    from master.spec import TENANT_PATTERN, report_path_problem

    if not isinstance(rec.tenant, str) or not re.fullmatch(TENANT_PATTERN, rec.tenant):
        raise ValueError(f"tenant {rec.tenant!r} is no tenant name")  # never a path part
    rel = (rec.spec.get("outputs") or {}).get("report_path") or f"{rec.workload}.json"
    problem = report_path_problem(rel) if isinstance(rel, str) else "not a string"
    if problem:
        raise ValueError(f"outputs.report_path {rel!r} is not allowed ({problem})")
    return [REPORTS_DIR, rec.tenant, *rel.split("/")]

def report_file(data_dir: str | Path, rec: WorkloadRecord) -> Path:
    """Where a workload's report goes: ``<data dir>/reports/<tenant>/<outputs.report_path>``
    (default ``<workload>.json``). A name only: `write_report` and `read_report` walk to it
    one directory at a time without following a link, so nothing outside the tenant's
    reports dir (auth/, cluster.json, another tenant's reports) is ever written or read."""
    return Path(data_dir).resolve().joinpath(*report_parts(rec))

def _open_dirs(data_dir: str | Path, parts: list[str], create: bool) -> int:
    """An fd of ``data_dir/parts...``, each part opened with O_NOFOLLOW relative to the one
    before (a symlink or a file in the way is an OSError, never followed); made if missing
    when ``create``. The caller closes it."""
    fd = os.open(Path(data_dir).resolve(), _DIR_FLAGS)
    try:
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o750, dir_fd=fd)
                except FileExistsError:
                    pass
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd

def write_report(data_dir: str | Path, rec: WorkloadRecord, usage: dict[str, Any] | None = None) -> Path:
    """The report: the workload record, and the usage charged to it by the time it ended
    (`master.usage`; the last seconds of device time may still be on their way: `nexus usage`
    has the final figure). Written to a new temp file (O_EXCL, a unique name) in the report's
    directory and renamed over the name: never a half-written report, never through a link."""
    parts = report_parts(rec)
    report = {"format": "vla-nexus/workload-report/1", **to_body(rec), "usage": usage or {}}
    data = json.dumps(report, indent=2, sort_keys=True, default=str).encode()
    dfd = _open_dirs(data_dir, parts[:-1], create=True)
    try:
        tmp = f".{parts[-1]}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o640, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            # rename never follows a link at the target name: it replaces the name itself.
            os.replace(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    finally:
        os.close(dfd)
    _prune_reports(Path(data_dir) / REPORTS_DIR / rec.tenant, keep=MAX_REPORTS_PER_TENANT)
    return report_file(data_dir, rec)

def _prune_reports(tenant_dir: Path, keep: int) -> int:
    """Remove the oldest of a tenant's report files past ``keep`` (a tenant can end workloads
    without bound; its reports may not grow with them). Links are never followed: os.walk
    does not enter a linked dir, and unlink removes a link, not its target."""
    if tenant_dir.is_symlink() or not tenant_dir.is_dir():
        return 0
    files = []
    for top, _, names in os.walk(tenant_dir, followlinks=False):
        for name in names:
            path = os.path.join(top, name)
            try:
                files.append((os.lstat(path).st_mtime, path))
            except FileNotFoundError:
                continue  # removed meanwhile
    files.sort()
    for _, path in files[:max(0, len(files) - keep)]:
        os.unlink(path)
    return max(0, len(files) - keep)

def read_report(data_dir: str | Path, rec: WorkloadRecord) -> dict[str, Any]:
    """The report `write_report` wrote for ``rec``, read the same confined way (O_NOFOLLOW at
    every step, a regular file, bounded). FileNotFoundError when there is none for this
    workload (never a report of another workload at the same path)."""
    parts = report_parts(rec)
    try:
        dfd = _open_dirs(data_dir, parts[:-1], create=False)
    except OSError as exc:
        raise FileNotFoundError(str(exc)) from None
    try:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=dfd)
        except OSError as exc:
            raise FileNotFoundError(str(exc)) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_REPORT_BYTES:
            os.close(fd)
            raise FileNotFoundError("not a report file")
        with os.fdopen(fd, "rb") as f:
            report = json.loads(f.read(MAX_REPORT_BYTES + 1))
    finally:
        os.close(dfd)
    if not isinstance(report, dict) or report.get("workload") != rec.workload:
        raise FileNotFoundError("the file there is no report of this workload")
    return report
