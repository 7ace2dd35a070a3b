"""The master's read-only workload part: ``workload``, ``workload_report``, ``workloads`` and
``tenants`` (records and reports as their owners see them; `master.workloads` changes them)."""

from __future__ import annotations

import asyncio

from actors.identity import current_caller, deny
from actors.runtime import op
from master.paging import page, time_key
from master.reports import read_report, report_parts
from master.state import MasterState
from protocol import ops
from protocol.errors import NotFound
from protocol.messages import (
    TERMINAL_WORKLOAD_STATES,
    TenantsReply,
    WorkloadRecord,
    WorkloadRef,
    WorkloadReport,
    WorkloadsReply,
    WorkloadsRequest,
)
from protocol.wire import encode


def require_own(rec: WorkloadRecord, op_name: str) -> None:
    """`require_tenant` for an op that names a workload id: a tenant asking about another
    tenant's workload is denied without being told whose it is."""
    caller = current_caller()
    if caller.is_platform or (caller.tenant is not None and caller.tenant == rec.tenant):
        return
    raise deny(caller, f"{op_name} {rec.workload}", None, "it is not one of the caller's workloads")


class WorkloadViews:
    """Workload records, reports and the tenants' table, read from `MasterState`."""

    def __init__(self, st: MasterState) -> None:
        self.st = st

    @op(ops.MASTER_WORKLOAD)
    async def workload(self, req: WorkloadRef) -> WorkloadRecord:
        rec = self.st.workload(req.workload)
        require_own(rec, "workload")
        return rec

    @op(ops.MASTER_WORKLOAD_REPORT)
    async def workload_report(self, req: WorkloadRef) -> WorkloadReport:
        """A finished workload's report, read back from where the master wrote it."""
        from protocol.errors import FailedPrecondition

        rec = self.st.workload(req.workload)
        require_own(rec, "workload_report")
        if rec.state not in TERMINAL_WORKLOAD_STATES:
            raise FailedPrecondition(f"workload {rec.workload} is {rec.state}; its report is written when it ends")
        rel = str((rec.spec.get("outputs") or {}).get("report_path") or f"{rec.workload}.json")
        try:
            rel = "/".join(report_parts(rec))  # relative to the data dir: no host path to a tenant
            report = await asyncio.to_thread(read_report, self.st.cfg.data_dir, rec)
        except (FileNotFoundError, ValueError):
            raise NotFound(f"no report of {rec.workload} at {rel} (it was not written: see the master's log)",
                           details={"path": rel}) from None
        return WorkloadReport(workload=rec.workload, path=rel, report=report)

    @op(ops.MASTER_WORKLOADS)
    async def list_workloads(self, req: WorkloadsRequest) -> WorkloadsReply:
        # One page (master/paging.py), oldest first: the whole history passed the max payload.
        recs = [(time_key(w.created_at, w.workload), w) for w in self.st.workloads.values()
                if not req.tenant or w.tenant == req.tenant]
        out, cursor = page(recs, req.limit, req.cursor, self.st.bus.max_payload, lambda w: len(encode(w)))
        return WorkloadsReply(workloads=out, next_cursor=cursor)

    @op(ops.MASTER_TENANTS)
    async def list_tenants(self, req: WorkloadsRequest) -> TenantsReply:
        """One page of tenants by name, with their versions and workload history (ids)."""
        history: dict[str, list[str]] = {}
        for rec in sorted(self.st.workloads.values(), key=lambda w: w.created_at):
            history.setdefault(rec.tenant, []).append(rec.workload)
        cfgs = [(t, cfg) for t, cfg in self.st.sched.tenants.items() if not req.tenant or t == req.tenant]
        out, cursor = page(cfgs, req.limit, req.cursor, self.st.bus.max_payload,
                           lambda c: len(encode(c)) + 16 * len(history.get(c.name, ())) + 32)
        names = {c.name for c in out}
        return TenantsReply(tenants=out, versions={t: v for t, v in self.st.sched.versions.items() if t in names},
                            history={t: h for t, h in history.items() if t in names}, next_cursor=cursor)
