"""The chaos suite's invariants, as pure functions over what the deployment reports at the end.

    from bench.chaos_audit import audit_jobs
    findings = audit_jobs(jobs, final_versions, checkpoints)   # jobs: list[JobRecord]
    findings.lost, findings.twice, findings.problems

Kept apart from the harness (bench/chaos.py) so the checks themselves are tested on made-up
records (tests/system/test_chaos.py): a checker that cannot fail proves nothing.

What is checked, per training tenant:
  * lost: every job ends ``cleared`` or ``dropped_stale``. A ``failed`` job is lost unless its
    reason matches ``allowed_failure`` (a genuine data error; the suite's own workloads put only
    valid data, so by default none is allowed); a job left ``reserved`` / ``filling`` /
    ``ready`` / ``leased`` / ``trained`` / ``exported`` / ``synced`` is stranded, also lost.
  * applied twice: one optimizer step per micro-batch, so the policy version after a job is the
    version before it plus the job's items. Taken over the cleared jobs in the order they
    were trained (their ``trained_version``): versions are distinct, each equals the previous
    plus its items, the first starts from 0, and the last equals the tenant's final version. A
    job trained twice shows as a version gap of 2 x items (or a repeated version); a step lost
    inside a trained job, as a short gap.
  * order: trained versions increase in job order (job ids are time-ordered), reported apart:
    out-of-order training is no double step, but a tenant's data is meant to train FIFO.
  * checkpoint: the ids in ``<tenant>/checkpoint``'s applied list are distinct, are exactly the
    cleared jobs (no cleared job missing, no job applied that is not cleared), and its
    version is the final version.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

STRANDED_STATES = ("reserved", "filling", "ready", "leased", "trained", "exported", "synced")
DONE_STATES = ("cleared", "dropped_stale")


@dataclass
class TenantAudit:
    tenant: str
    jobs: int = 0
    cleared: int = 0
    dropped_stale: int = 0
    items_trained: int = 0
    final_version: int | None = None
    checkpoint_version: int | None = None
    checkpoint_applied: int | None = None
    lost: list[dict[str, Any]] = field(default_factory=list)  # {job, state, reason}
    twice: list[str] = field(default_factory=list)  # one line per double-apply symptom
    order: list[str] = field(default_factory=list)
    checkpoint: list[str] = field(default_factory=list)


@dataclass
class Findings:
    tenants: dict[str, TenantAudit] = field(default_factory=dict)

    @property
    def lost(self) -> int:
        return sum(len(t.lost) for t in self.tenants.values())

    @property
    def twice(self) -> int:
        return sum(len(t.twice) for t in self.tenants.values())

    @property
    def out_of_order(self) -> int:
        return sum(len(t.order) for t in self.tenants.values())

    @property
    def checkpoint_mismatches(self) -> int:
        return sum(len(t.checkpoint) for t in self.tenants.values())


def audit_jobs(jobs: list[Any], final_versions: dict[str, int], checkpoints: dict[str, dict[str, Any]] | None = None,
               allowed_failure: str | None = None) -> Findings:
    """``jobs``: JobRecords (any objects with the JobRecord fields); ``final_versions``: tenant ->
    version in the versions KV; ``checkpoints``: tenant -> {"applied": [...], "version": int} (or {"error": why}); None: not read."""
    allowed = re.compile(allowed_failure) if allowed_failure else None
    out = Findings()
    by_tenant: dict[str, list[Any]] = {}
    for j in jobs:
        by_tenant.setdefault(j.tenant, []).append(j)
    for tenant in sorted(set(by_tenant) | set(final_versions)):
        tj = sorted(by_tenant.get(tenant, []), key=lambda j: j.job)
        a = TenantAudit(tenant=tenant, jobs=len(tj), final_version=final_versions.get(tenant))
        out.tenants[tenant] = a
        # 1. lost
        for j in tj:
            if j.state in DONE_STATES:
                continue
            if j.state == "failed" and allowed is not None and allowed.search(j.reason or ""):
                continue
            if j.state == "failed" and j.items == 0:
                continue  # reserved, never filled: no micro-batch was ever acknowledged into it
            what = "stranded" if j.state in STRANDED_STATES else "failed"
            a.lost.append({"job": j.job, "state": j.state, "kind": what, "reason": j.reason,
                           "attempts": j.attempts, "lease_owner": j.lease_owner})
        cleared = [j for j in tj if j.state == "cleared"]
        a.cleared = len(cleared)
        a.dropped_stale = sum(1 for j in tj if j.state == "dropped_stale")
        a.items_trained = sum(j.items for j in cleared)
        # 2. applied twice: walk the cleared jobs in training order
        seen: dict[int, str] = {}
        for j in cleared:
            if j.trained_version < 0:
                a.twice.append(f"job {j.job} is cleared without a trained_version")
            elif j.trained_version in seen:
                a.twice.append(f"jobs {seen[j.trained_version]} and {j.job} both trained to version {j.trained_version}")
            else:
                seen[j.trained_version] = j.job
        prev = 0
        for j in sorted((j for j in cleared if j.trained_version >= 0), key=lambda j: j.trained_version):
            want = prev + j.items
            if j.trained_version != want:
                kind = "steps applied twice?" if j.trained_version > want else "steps missing?"
                a.twice.append(f"job {j.job} ({j.items} items) trained to version {j.trained_version}, "
                               f"expected {want} after version {prev}: {kind}")
            prev = j.trained_version
        final = final_versions.get(tenant)
        if cleared and final is not None and final != a.items_trained:
            a.twice.append(f"final version {final} != {a.items_trained} micro-batches in cleared jobs")
        # 3. order
        trained = [j for j in cleared if j.trained_version >= 0]
        for earlier, later in zip(trained, trained[1:]):
            if later.trained_version <= earlier.trained_version:
                a.order.append(f"job {later.job} (v{later.trained_version}) trained before the older "
                               f"job {earlier.job} (v{earlier.trained_version})")
        # 4. checkpoint
        ck = (checkpoints or {}).get(tenant)
        if ck is not None and "error" in ck:
            a.checkpoint.append(f"checkpoint unreadable: {ck['error']}")
        elif ck is None and cleared and checkpoints is not None:
            a.checkpoint.append("no committed checkpoint, yet jobs are cleared")
        elif ck is not None:
            applied = list(ck.get("applied", []))
            a.checkpoint_applied = len(applied)
            a.checkpoint_version = ck.get("version")
            if len(set(applied)) != len(applied):
                dups = sorted({x for x in applied if applied.count(x) > 1})
                a.checkpoint.append(f"checkpoint lists jobs more than once: {dups[:5]}")
            cleared_ids = {j.job for j in cleared}
            known = {j.job for j in tj}
            missing = sorted(cleared_ids - set(applied))
            extra = sorted(set(applied) - cleared_ids)
            if missing:
                a.checkpoint.append(f"cleared jobs not in the checkpoint's applied ids: {missing[:5]}")
            if extra:
                states = {j.job: j.state for j in tj}
                a.checkpoint.append("checkpoint applied jobs that are not cleared: "
                                    + ", ".join(f"{x} ({states.get(x, 'no record') if x in known else 'no record'})"
                                                for x in extra[:5]))
            if final is not None and a.checkpoint_version is not None and a.checkpoint_version != final:
                a.checkpoint.append(f"checkpoint version {a.checkpoint_version} != final version {final}")
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = max(0, min(len(xs) - 1, int(-(-q * len(xs) // 100)) - 1))
    return xs[k]
