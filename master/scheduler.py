"""The training-queue scheduler: which ready job a trainer gets next. Pure logic, no I/O.

The master keeps every job record here (and in the jobs KV); `pick` decides, in order:

1. Leases past their deadline go back to ``ready`` (attempts + 1; ``failed`` after
   `MAX_ATTEMPTS`).
2. Jobs a trainer left half-finished (``trained`` / ``exported`` / ``synced`` with no owner)
   are handed out first: finishing them is cheap and frees their partitions.
3. Among tenants with a ``ready`` auto job and no job in flight on a trainer, the order is
   weighted fair share by priority (`master.fairshare`: the smallest *pass* first, a lease
   adds 1 / weight(priority), so a tenant at priority 10 is leased 4x as often as one at 0
   while both wait, and one at -10 still gets its floor share: slowed, never starved), then
   higher priority, then the tenant served longest ago (round-robin among equals: no tenant
   starves however many are ready), then the oldest ready time. Each tenant contributes at most
   one job per lease, its oldest (FIFO within a tenant), so its updates apply in order. The
   ready tenants are a heap in that order, recomputed per tenant when its records change
   (`touch`), so a decision does not scan or sort every ready tenant (docs/scale.md).
4. An RL job whose data came from a policy more than ``staleness_bound`` versions (optimizer
   steps = micro-batches) behind the tenant's current version is dropped, never trained.

Caps enforced at `check_reserve`: the tenant's quota ``max_inflight_jobs`` over all its tasks
(`protocol.messages.TenantQuotas`, default 8: `QuotaExceeded`), then at most
``max_inflight_jobs`` unfinished jobs per tenant-task (its spec's, default 2), and at most ``sft_prefetch_items`` SFT micro-batches per tenant in
ready or leased jobs (default 16) so offline data cannot crowd out online RL. A job still being
filled does not count: it waits for nobody, and a job larger than the cap is refused at submit
(`master.spec`), so a workflow's Busy put always clears once the trainer catches up.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from master.fairshare import FairShare, clamp_priority
from protocol.errors import Busy, QuotaExceeded
from protocol.messages import TERMINAL_JOB_STATES, JobRecord, TenantConfig, TenantQuotas

MAX_ATTEMPTS = 3
# Unfinished = counts against the in-flight cap.
UNFINISHED = ("reserved", "filling", "ready", "leased")
# Queued for or on a trainer: these count against the SFT prefetch cap.
PREFETCHED = ("ready", "leased")
# A trainer committed these but has not cleared them yet.
POST_COMMIT = ("trained", "exported", "synced")
# Finished: never changes again (protocol.messages.TERMINAL_JOB_STATES).
FINISHED = frozenset(TERMINAL_JOB_STATES)
# Every tenant's candidacy is recomputed at least this often, so a change to a record that
# reached the scheduler without `touch` is seen within it (the master touches on every save).
REBUILD_S = 1.0


@dataclass
class Scheduler:
    jobs: dict[tuple[str, str], JobRecord] = field(default_factory=dict)
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)  # tenant -> current policy version
    dropped_stale: dict[str, int] = field(default_factory=dict)  # tenant -> count
    _served: dict[str, int] = field(default_factory=dict)  # tenant -> tick of last lease
    _tick: itertools.count = field(default_factory=lambda: itertools.count(1))
    # Jobs not yet finished (all, and by tenant): what every decision scans, so its cost does
    # not grow with finished records (kept in `jobs` until compaction). A finished state never
    # turns back, so a finished job found here is dropped on the next scan (states change in
    # place, in the master).
    _live: dict[tuple[str, str], JobRecord] = field(default_factory=dict)
    _by_tenant: dict[str, dict[str, JobRecord]] = field(default_factory=dict)
    # The ready tenants as a heap (lazy deletion): one entry per tenant that has a ready auto
    # job and no job on a trainer, keyed by the lease order; an entry is valid while its stamp
    # is the tenant's latest. A decision refreshes only the tenants touched since the last one,
    # so its cost is O(touched + leased x log ready tenants), not a scan and sort of them all.
    _heap: list[tuple] = field(default_factory=list)
    _stamp: dict[str, int] = field(default_factory=dict)
    _stamps: itertools.count = field(default_factory=itertools.count)
    _dirty: set[str] = field(default_factory=set)
    _busy: set[str] = field(default_factory=set)  # tenants with a job held by a trainer
    _post: dict[str, list[JobRecord]] = field(default_factory=dict)  # unowned post-commit jobs
    _rebuilt_at: float = float("-inf")
    # Each tenant with unfinished jobs has a pass in the fair share (entered at its first job,
    # left when it has none): the first term of the lease order.
    fair: FairShare = field(default_factory=FairShare)
    refreshes: int = 0  # tenants recomputed (a test checks a decision does not touch them all)

    def __post_init__(self) -> None:
        for rec in self.jobs.values():
            self._index(rec)

    # -- bookkeeping ---------------------------------------------------------------------
    def put(self, rec: JobRecord) -> None:
        self.jobs[(rec.tenant, rec.job)] = rec
        self._index(rec)
        self._dirty.add(rec.tenant)

    def remove(self, tenant: str, job: str) -> None:
        self.jobs.pop((tenant, job), None)
        self._forget((tenant, job))
        self._dirty.add(tenant)

    def touch(self, rec: JobRecord) -> None:
        """``rec`` changed in place (the master calls this on every save): its tenant's place
        in the lease order is recomputed at the next decision."""
        self._dirty.add(rec.tenant)

    def _index(self, rec: JobRecord) -> None:
        if rec.state not in FINISHED:
            self.fair.enter(rec.tenant)
            self._live[(rec.tenant, rec.job)] = rec
            self._by_tenant.setdefault(rec.tenant, {})[rec.job] = rec

    def _forget(self, key: tuple[str, str]) -> None:
        self._live.pop(key, None)
        mine = self._by_tenant.get(key[0])
        if mine is not None:
            mine.pop(key[1], None)
            if not mine:
                del self._by_tenant[key[0]]

    def tenant_jobs(self, tenant: str) -> list[JobRecord]:
        """The tenant's unfinished jobs (finished ones are in `jobs`)."""
        mine = self._by_tenant.get(tenant)
        if not mine:
            return []
        for job in [k for k, j in mine.items() if j.state in FINISHED]:
            self._forget((tenant, job))
        return list(mine.values())

    def live_jobs(self) -> list[JobRecord]:
        """Every unfinished job: O(unfinished), whatever the history."""
        for key in [k for k, j in self._live.items() if j.state in FINISHED]:
            self._forget(key)
        return list(self._live.values())

    def observe_version(self, tenant: str, version: int) -> None:
        if version > self.versions.get(tenant, -1):
            self.versions[tenant] = version

    # -- reserve caps --------------------------------------------------------------------
    def check_reserve(self, tenant: TenantConfig, task: str, quotas: TenantQuotas | None = None) -> None:
        unfinished = [j for j in self.tenant_jobs(tenant.name) if j.state in UNFINISHED]
        if quotas is not None and len(unfinished) >= quotas.max_inflight_jobs:
            # The operator's ceiling over all the tenant's tasks (a kind of Busy: a workflow
            # waits until one of its jobs is trained).
            raise QuotaExceeded.of("max_inflight_jobs", quotas.max_inflight_jobs,
                                   f"tenant {tenant.name} has {len(unfinished)} jobs in flight; retry when one is "
                                   "trained", 0.5, tenant=tenant.name, inflight=len(unfinished))
        mine = [j for j in unfinished if j.task == task]
        if len(mine) >= tenant.max_inflight_jobs:
            raise Busy(
                f"tenant {tenant.name}: {len(mine)} {task} jobs in flight, the cap is {tenant.max_inflight_jobs}; "
                "retry when one is trained",
                details={"retry_after_s": 0.5, "inflight": len(mine)},
            )
        if task == "sft":
            self.check_sft_prefetch(tenant, adding=1)  # a new job brings at least one

    def check_sft_prefetch(self, tenant: TenantConfig, adding: int) -> None:
        queued = sum(j.items for j in self.tenant_jobs(tenant.name) if j.task == "sft" and j.state in PREFETCHED)
        if queued + adding > tenant.sft_prefetch_items:
            raise Busy(
                f"tenant {tenant.name}: {queued} SFT micro-batches queued, the prefetch cap is "
                f"{tenant.sft_prefetch_items}; retry when the trainer has caught up",
                details={"retry_after_s": 0.5, "queued": queued},
            )

    # -- leasing -------------------------------------------------------------------------
    def expire_leases(self, now: float) -> list[JobRecord]:
        """Leased jobs whose lease ran out: back to ready, or failed after MAX_ATTEMPTS."""
        changed = []
        for job in self.live_jobs():
            if (job.lease_owner and job.state in ("leased", *POST_COMMIT)
                    and job.lease_expires_at and job.lease_expires_at < now):
                changed.append(self.release(job, now, reason="lease expired"))
        return changed

    def release(self, job: JobRecord, now: float, reason: str, count_attempt: bool = True) -> JobRecord:
        """Take a job away from its trainer (lease expired, trainer died, trainer drained).

        A drained trainer hands its jobs back on purpose: that attempt does not count."""
        job.lease_owner, job.lease_expires_at, job.updated_at = "", 0.0, now
        self._dirty.add(job.tenant)
        if job.state == "leased":
            if not count_attempt:
                job.attempts = max(0, job.attempts - 1)
                job.state, job.reason = "ready", reason
            elif job.attempts >= MAX_ATTEMPTS:
                job.state, job.reason = "failed", f"{reason}; gave up after {job.attempts} attempts"
            else:
                job.state, job.reason = "ready", reason
        return job

    def pick(self, trainer: str, max_jobs: int, lease_s: float, now: float) -> tuple[list[JobRecord], list[JobRecord]]:
        """Lease up to ``max_jobs`` jobs to ``trainer``; return (leased, dropped_stale)."""
        leased: list[JobRecord] = []
        stale: list[JobRecord] = []
        self._refresh_touched()
        busy_now = set(self._busy)  # tenants given a job in this decision join it
        # 2. unfinished post-commit work first
        post = sorted((j for t, jobs in self._post.items() if t not in busy_now for j in jobs),
                      key=lambda j: j.updated_at)
        for job in post:
            if len(leased) >= max_jobs:
                break
            if job.state in POST_COMMIT and not job.lease_owner and job.tenant not in busy_now:
                self._lease(job, trainer, lease_s, now)
                busy_now.add(job.tenant)
                leased.append(job)
        # 3. one ready job per eligible tenant, in lease order (the heap)
        while self._heap and len(leased) < max_jobs:
            *key, stamp, tenant = heapq.heappop(self._heap)
            if self._stamp.get(tenant) != stamp or tenant in busy_now:
                continue  # superseded by a later entry, or the tenant has a job on a trainer
            del self._stamp[tenant]
            job = self._next_ready(tenant)
            if job is None or any(j.lease_owner for j in self.tenant_jobs(tenant)) or self._key(job) != tuple(key):
                # Changed without a touch: its true place is recomputed (pushed again if ready).
                self._refresh(tenant)
                continue
            # 4. staleness, checked down the tenant's FIFO until a fresh job is found
            while job is not None and self.is_stale(job):
                self._drop_stale(job, now)
                stale.append(job)
                job = self._next_ready(tenant)
            if job is None:
                continue
            self._lease(job, trainer, lease_s, now)
            busy_now.add(tenant)
            leased.append(job)
        return leased, stale

    # -- the lease order -----------------------------------------------------------------
    def priority(self, job: JobRecord) -> int:
        """The job's priority within its tenant's current ``max_priority`` quota (the operator's
        ceiling: lowering it also lowers jobs queued before)."""
        cfg = self.tenants.get(job.tenant)
        return clamp_priority(job.priority, cfg.quotas.max_priority if cfg is not None and cfg.quotas else None)

    def _key(self, job: JobRecord) -> tuple:
        """The tenant's fair-share pass and priority (`master.fairshare`), then the tenant
        served longest ago (round-robin), then the oldest ready time; the job id breaks what is
        left of a tie. Stable until the tenant is leased or touched (the heap relies on it)."""
        return (*self.fair.key(job.tenant, self.priority(job)), self._served.get(job.tenant, 0), job.ready_at, job.job)

    def _refresh_touched(self) -> None:
        mono = time.monotonic()
        if mono - self._rebuilt_at > REBUILD_S:
            # Everything from the records (bounded staleness for a change without a touch;
            # it also drops the heap's superseded entries).
            self._rebuilt_at = mono
            self._heap, self._stamp, self._busy, self._post = [], {}, set(), {}
            self._dirty = set(self._by_tenant) | self._dirty
        # The busy tenants too, touched or not: a job leaving its trainer frees its tenant, and
        # their number is bounded by the work on trainers, not by the tenants.
        for tenant in self._dirty | self._busy:
            self._refresh(tenant)
        self._dirty = set()

    def _refresh(self, tenant: str) -> None:
        """The tenant's busy flag, unowned post-commit jobs and heap entry, from its records."""
        self.refreshes += 1
        jobs = self.tenant_jobs(tenant)
        self._stamp.pop(tenant, None)  # any older entry is superseded
        if not jobs:
            self.fair.leave(tenant)  # nothing unfinished: out of line (back in at the clock)
        if any(j.lease_owner for j in jobs):
            self._busy.add(tenant)
        else:
            self._busy.discard(tenant)
        post = [j for j in jobs if j.state in POST_COMMIT and not j.lease_owner]
        if post:
            self._post[tenant] = post
        else:
            self._post.pop(tenant, None)
        if tenant in self._busy:
            return
        head = self._next_ready(tenant)
        if head is not None:
            stamp = next(self._stamps)
            self._stamp[tenant] = stamp
            heapq.heappush(self._heap, (*self._key(head), stamp, tenant))

    def lease_one(self, job: JobRecord, trainer: str, lease_s: float, now: float) -> None:
        self._lease(job, trainer, lease_s, now)

    def holds(self, job: JobRecord, trainer: str, epoch: int) -> bool:
        """Is ``job`` still leased to ``trainer`` under lease ``epoch``? (the commit fence)"""
        return (job.lease_owner == trainer and job.lease_epoch == epoch
                and job.state in ("leased", *POST_COMMIT))

    def renew(self, job: JobRecord, trainer: str, epoch: int, lease_s: float, now: float) -> bool:
        if not self.holds(job, trainer, epoch):
            return False
        job.lease_expires_at = now + lease_s
        return True

    def orphans(self, now: float, ttl_s: float) -> list[JobRecord]:
        """Jobs idle past ``ttl_s`` while reserved or filling: their workflow is gone."""
        return [j for j in self.live_jobs() if j.state in ("reserved", "filling") and now - j.updated_at > ttl_s]

    def compactable(self, now: float, keep_s: float) -> list[JobRecord]:
        """Finished records older than ``keep_s``: nothing reads them any more."""
        return [j for j in self.jobs.values() if j.state in ("cleared", "dropped_stale", "failed")
                and now - j.updated_at > keep_s]

    def is_stale(self, job: JobRecord) -> bool:
        if job.task != "rl" or job.behaviour_version < 0:
            return False
        bound = self.tenants[job.tenant].staleness_bound if job.tenant in self.tenants else 128
        return self.versions.get(job.tenant, 0) - job.behaviour_version > bound

    def _next_ready(self, tenant: str) -> JobRecord | None:
        ready = [j for j in self.tenant_jobs(tenant) if j.state == "ready" and j.auto]
        return min(ready, key=lambda j: (j.ready_at, j.job)) if ready else None

    def _drop_stale(self, job: JobRecord, now: float) -> None:
        self._dirty.add(job.tenant)
        version = self.versions.get(job.tenant, 0)
        job.state = "dropped_stale"
        job.reason = (f"behaviour version {job.behaviour_version} is {version - job.behaviour_version} "
                      f"versions behind {version} (bound {self.tenants[job.tenant].staleness_bound if job.tenant in self.tenants else 128})")
        job.updated_at = now
        self.dropped_stale[job.tenant] = self.dropped_stale.get(job.tenant, 0) + 1

    def _lease(self, job: JobRecord, trainer: str, lease_s: float, now: float) -> None:
        self._dirty.add(job.tenant)
        if job.state == "ready":
            job.state = "leased"
            job.attempts += 1
            self.fair.charge(job.tenant, self.priority(job))
        job.lease_epoch += 1  # whoever held it before can no longer commit or report
        job.lease_owner, job.lease_expires_at, job.updated_at = trainer, now + lease_s, now
        self._served[job.tenant] = next(self._tick)
