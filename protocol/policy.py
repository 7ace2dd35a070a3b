"""Every timeout, retry and back-off of the system, as data in one place.

A caller that retries names one of these policies instead of spelling its own sleeps, so the
retry horizon of the whole system can be read (and tested) here::

    from protocol.policy import MASTER_OUTAGE
    await retry(fn, policy=MASTER_OUTAGE)

The numbers are defaults with a reason each; the dedup window of the training-queue streams
is derived from the longest horizon below, so a retried put is always recognised.

Nothing of protocol is imported here: `protocol.messages` and `protocol.settings` build on it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """Retry a call that failed with a retryable error (no responder, timeout, busy, draining).

    ``deadline_s`` bounds the whole effort (0 = attempts only); ``attempts`` bounds the tries
    (0 = until the deadline). The wait grows from ``backoff_s`` by ``multiplier`` up to
    ``max_backoff_s``; a server's own retry hint (``retry_after_s``) wins when larger.
    """

    name: str
    deadline_s: float = 0.0
    attempts: int = 0
    backoff_s: float = 0.5
    multiplier: float = 2.0
    max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        if self.deadline_s < 0 or self.attempts < 0:
            raise ValueError(f"{self.name}: deadline_s and attempts must be >= 0")
        if self.deadline_s == 0 and self.attempts == 0:
            raise ValueError(f"{self.name}: a retry needs a deadline_s or a number of attempts")
        if self.backoff_s <= 0 or self.multiplier < 1 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"{self.name}: need backoff_s > 0, multiplier >= 1, max_backoff_s >= backoff_s")

    def delay(self, attempt: int, hint_s: float = 0.0) -> float:
        """Wait before retry number ``attempt`` (1-based)."""
        return max(hint_s, min(self.max_backoff_s, self.backoff_s * self.multiplier ** (attempt - 1)))


# A restarting master or inferencer takes seconds (a global restart, tens of seconds): calls
# that are safe to repeat ride it out for this long before the caller gives up.
MASTER_OUTAGE = RetryPolicy("master_outage", deadline_s=120.0, backoff_s=0.5, max_backoff_s=2.0)
INFERENCE_OUTAGE = RetryPolicy("inference_outage", deadline_s=120.0, backoff_s=0.2, max_backoff_s=2.0)

# The longest horizon over which any client repeats one queue_put (or intake publish): the
# JetStream duplicate window must cover it, or a late retry is stored twice.
LONGEST_RETRY_HORIZON_S = max(MASTER_OUTAGE.deadline_s, INFERENCE_OUTAGE.deadline_s)
DEDUP_WINDOW_S = LONGEST_RETRY_HORIZON_S + 60.0


@dataclass(frozen=True)
class Leases:
    """Training-job leases and what counts as abandoned work."""

    # A trainer renews the leases of the jobs it holds this often, from lease to clear (at most
    # a quarter of the lease): a job longer than its lease is never re-leased under it.
    renew_every_s: float = 2.0
    # A draining trainer keeps training its running jobs this long, then releases what is left.
    drain_finish_s: float = 30.0
    # A job idle this long while reserved or filling has lost its workflow: failed, purged,
    # and off the tenant's in-flight cap.
    orphan_ttl_s: float = 300.0


@dataclass(frozen=True)
class Retention:
    """What the master compacts, and when."""

    every_s: float = 60.0
    # Finished job records (cleared / dropped_stale / failed) are deleted after this long.
    job_records_s: float = 3600.0
    # Policy versions kept per tenant besides the pinned ones (a running eval's version).
    versions_kept: int = 8
    # Finished workload records (each holds its whole spec) and usage records not written to
    # for this long are compacted: removed from KV and memory, their usage folded into the
    # tenant's `COMPACTED_LABEL` record so `nexus usage` totals stay whole. 7 days.
    records_s: float = 7 * 86400.0
    # ... and past this many finished workload records, the oldest go first whatever their age.
    workload_records_max: int = 10000
    # Distinct usage labels (a predict's `workload` that is no workload of the tenant) a tenant
    # may have; the rest are charged to `OTHER_LABEL` (docs/usage.md).
    usage_labels_max: int = 64


# Usage-record labels the master writes itself (master/usage.py).
COMPACTED_LABEL = "_compacted"  # a tenant's usage of compacted workloads and labels
OTHER_LABEL = "other"  # predict labels past the tenant's usage_labels_max

# List ops (`workloads`, `jobs`, `list`, `tenants`, `usage`) answer one page: at most this many
# records (a caller's `limit` is capped to LIST_PAGE_MAX) and at most LIST_PAGE_BYTES_FRACTION of
# the server's max payload; `next_cursor` names where the next page starts.
LIST_PAGE_DEFAULT = 200
LIST_PAGE_MAX = 1000
LIST_PAGE_BYTES_FRACTION = 0.8

# queue_put splits an item until each part's encoding is this far under the max payload: the
# request's trace headers and the master's own publish headers must fit beside it. So one row
# (one sample) must fit the max payload less this: the submit checks refuse a spec whose rows
# cannot (master/submit_checks.py).
CHUNK_HEADROOM_BYTES = 8192

# A lifecycle change the master could not write to KV (a long leader election, a full disk) is
# written again after these delays, for as long as it takes: the change is applied in memory
# only once KV has it, so memory and KV never disagree about a workload's state.
LIFECYCLE_SAVE = RetryPolicy("lifecycle_save", attempts=1, backoff_s=1.0, max_backoff_s=30.0)


# The defaults; the roles take them with their NEXUS_* variables (protocol.settings:
# leases_from_env, retention_from_env; default_quotas and usage_flush_from_env likewise for
# a tenant's quotas and USAGE_FLUSH).
LEASES = Leases()
RETENTION = Retention()


# A draining trainer hands its jobs back; if the master is gone too (`nexus down` stops
# everything), the next master releases them at its start, so this stays short.
DRAIN_RELEASE = RetryPolicy("drain_release", deadline_s=10.0, backoff_s=0.5, max_backoff_s=2.0)


# -- background loops and role restarts ------------------------------------------------------
# A workflow's simulator that hung or crashed (envs.simproc) fails its episode and is replaced
# by a new child process; this many failures in a row (no episode completed between them) is a
# broken simulator, not bad luck: the workload fails with the last error.
SIM_REPLACE = RetryPolicy("sim_replace", attempts=3, backoff_s=0.5, max_backoff_s=4.0)

# A critical background loop (lease expiry, intake, train loop, health check) that raises is
# started again after policy.delay(n); past ``attempts`` failures in a row its process exits
# non-zero so that its supervisor (or the container's restart policy) starts a clean one.
LOOP_RESTART = RetryPolicy("loop_restart", attempts=5, backoff_s=0.5, max_backoff_s=8.0)
# A loop that ran this long before failing starts a fresh budget: one failure a day is a
# restart each time, not a countdown to an exit.
LOOP_HEALTHY_S = 60.0

# The trainer's first step of a group waits this long at most for the other jobs of the same
# lease still being prepared (slot load, partition read): jobs leased together start together
# and share every step, instead of the first one ready taking its steps alone.
COHORT_JOIN_WAIT_S = 10.0


@dataclass(frozen=True)
class RestartBudget:
    """At most ``max_restarts`` restarts of one thing within ``window_s``, ``backoff_s`` apart."""

    name: str
    max_restarts: int
    window_s: float
    backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_s < 0:
            raise ValueError(f"{self.name}: need max_restarts >= 0, window_s > 0, backoff_s >= 0")

    def spend(self, history: deque, now: float) -> bool:
        """Forget restarts older than the window; record one at ``now`` if the budget allows."""
        while history and now - history[0] > self.window_s:
            history.popleft()
        if len(history) >= self.max_restarts:
            return False
        history.append(now)
        return True


# The supervisor restarts a crashed or killed role process at most 5 times a minute.
ROLE_RESTART = RestartBudget("role_restart", max_restarts=5, window_s=60.0, backoff_s=1.0)
# The health manager asks for the in-place restart of one role at most 3 times a minute; past
# that a role that keeps dying is left to the supervisor's own budget (and to an operator).
HEALTH_RESTART = RestartBudget("health_restart", max_restarts=3, window_s=60.0, backoff_s=0.0)
# When the master cannot come back within ROLE_RESTART, every role is restarted once (tenants
# resume from their checkpoints); a second global restart within 10 minutes is not tried.
GLOBAL_RESTART = RestartBudget("global_restart", max_restarts=1, window_s=600.0, backoff_s=2.0)
# A role whose beats stopped is asked for ``info`` once before it is killed: one that answers
# within this was only slow to beat (a loaded host), not hung.
HUNG_PROBE_TIMEOUT_S = 2.0
# A restart request waits this long for a drained role to exit before it is killed anyway.
RESTART_REQUEST_TIMEOUT_S = 10.0

# A KV write of the master's (job and workload records, checkpoint pointers) retried through
# a NATS leader election: a stream's new leader takes 5-7 s after its node is lost (R3).
STORE_WRITE = RetryPolicy("store_write", deadline_s=20.0, backoff_s=0.25, max_backoff_s=2.0)
# A request whose handler still hit a leaderless stream after STORE_WRITE is answered
# `unavailable` with this hint: the caller's own outage retry tries it again.
BROKER_RETRY_AFTER_S = 1.0
# How often the master checks that the trainers holding leases and the env workers running
# workloads still answer (a role that died unseen: the health manager restarted meanwhile).
OWNER_CHECK_EVERY_S = 10.0

# A restarting master reads each KV bucket whole through one watcher (not a get per key);
# the server sends entries back to back, so a gap this long means it stopped answering.
KV_LOAD_ENTRY_TIMEOUT_S = 30.0
# ... and checks it got the whole bucket (the watch reached the stream's last sequence as read
# before it began); a short read (seen once, a master loading 0 of 59 job records just after a
# NATS node came back) is read again, then the load fails (the master restarts) rather than
# start on a partial state and hand out work twice.
KV_LOAD = RetryPolicy("kv_load", attempts=5, backoff_s=0.5, max_backoff_s=4.0)


# -- quotas and metering ---------------------------------------------------------------------
# Scheduling priority: a small documented range, so one tenant cannot claim "infinity"
# (`master.spec` bounds spec.schedule.priority by it; a tenant's quota max_priority may lower
# the top, never raise it past PRIORITY_MAX).
PRIORITY_MIN, PRIORITY_MAX = -10, 10
# A tenant's own scheduling caps (spec.schedule, or its tenant_create config), each bounded
# so a tenant cannot claim more than the operator gives: max_inflight_jobs per task at most
# this and its quota max_inflight_jobs; SFT micro-batches held in ready or leased jobs (each
# one lives in the platform's training-queue stream); RL data kept this many versions back.
MAX_INFLIGHT_JOBS_PER_TASK = 64
SFT_PREFETCH_ITEMS_MAX = 4096
STALENESS_BOUND_MAX = 100_000
# Frames in one dataset `sample` reply (``n`` or ``len(indices)``): the reply must fit the
# 1 MB max payload (2 cameras of 64x64 are ~25 KB a frame), so a larger request is refused
# at decode naming the field and this bound, never a failed reply.
SAMPLE_MAX_FRAMES = 32

# A workload kind (a spec's ``task``, `WorkflowSpec.kind`, a `protocol.recipes` registration):
# tenants send it, it appears in events, logs and span names, so it is a short lowercase name.
RECIPE_KIND_MAX = 32
RECIPE_KIND_PATTERN = rf"[a-z][a-z0-9-]{{0,{RECIPE_KIND_MAX - 1}}}"

# A tenant's reports on the master's disk (<data>/reports/<tenant>/): past this many files the
# oldest go as a new one is written (its workload records may have been compacted long ago).
MAX_REPORTS_PER_TENANT = 1000
# Bases the operator registers (`nexus base add`): each one may be loaded by every trainer
# and inferencer that serves it, so the list stays short.
MAX_REGISTERED_BASES = 64

# Starting weights a tenant uploads (`nexus weights upload`, master/uploads.py): the largest file
# (a head and a LoRA adapter are MBs; a whole base is never uploaded), how many named files one
# tenant keeps (a new name past it is refused; uploading a kept name again replaces it), and the
# slice size of one upload request (under the broker's 1 MiB max payload with headroom).
MAX_UPLOAD_BYTES = 256 * 2**20
MAX_UPLOADS_PER_TENANT = 16
UPLOAD_SLICE_BYTES = 512 * 1024
# How long the master waits for a trainer to check and write a tenant's starting weights at
# submit: a trainer that has not loaded the tenant's base yet loads it first (seconds).
INIT_WEIGHTS_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class UsageFlush:
    """How the trainer and inferencer send metered usage to the master.

    Usage is summed in memory and sent as one `UsageReport` per ``every_s`` (not one write per
    forward: an inferencer does hundreds a second); a report the master did not acknowledge is
    sent again, unchanged, next time (the master applies each (instance, boot, seq) once)."""

    every_s: float = 2.0
    # One report's request: short, the next period retries it anyway.
    timeout_s: float = 5.0
    # A draining role's last report waits at most this long for the master.
    final_timeout_s: float = 10.0
    # One report is at most this fraction of the server's max payload: more deltas than fit
    # are split over several reports (each acknowledged on its own), never one that NATS
    # refuses and that would be resent forever.
    max_payload_fraction: float = 0.5
    # The attribution rule's fixed cost of each tenant in a step / forward, in row-equivalents
    # (`actors.metering.split_by_rows`). 0: plain rows, a bill a tenant can predict from its
    # data. Measured on an H200 (qwen3-vl-4b, docs/usage.md): ~0.5 for mlp / gaussian heads,
    # ~2 for flow; set it to charge the heads' launch cost to each tenant instead of by rows.
    train_overhead_rows: float = 0.0
    infer_overhead_rows: float = 0.0


USAGE_FLUSH = UsageFlush()


@dataclass(frozen=True)
class ScalerPolicy:
    """When the health manager's scaler (`actors/health/scaler.py`, NEXUS_SCALER) changes a role's count.

    Each role's regime (up, down, hold) comes from several signals read off the heartbeats
    (docs/scaling.md, "The scaler"); every threshold is here. A regime must hold for
    ``window_s`` before one instance is added (removed): hysteresis in value (the band between
    an up and a down threshold holds) and in time (a spike does not move it). After any decision
    a role waits ``cooldown_s``, so it does not flap.

    Backlogs are weighed by priority: a waiting rollout or a ready job of a tenant counts
    ``max(1, FAIR_SHARE weight of its priority)`` (1 at priority 0 or below, 2 at 5, 4 at 10),
    so ``env_waiting_up`` = 2 is two default-priority rollouts waiting or one at priority 5."""

    every_s: float = 5.0
    window_s: float = 30.0
    cooldown_s: float = 60.0
    # Rates (trainer busy fraction, env step latency, inference queue wait) are taken over about
    # this long (between the newest beat and one at least this old): a job change or one slow
    # step does not drop a busy role out of its regime and restart its window.
    rate_s: float = 15.0
    # env: rollouts holding the master's gate per worker. At or above the up line the workers are
    # loaded, and one more helps when rollouts also wait for a turn (priority-weighted, at or above
    # env_waiting_up) or a simulator step is slow (mean seconds across workers, at or above
    # env_step_s_up; a heavy simulator needs a higher one). At or below the down line, with
    # nothing waiting, one fewer.
    env_holders_up: float = 2.0
    env_holders_down: float = 0.5
    env_waiting_up: float = 2.0
    env_step_s_up: float = 0.25
    # trainer: ready jobs (priority-weighted) per trainer at or above trainer_ready_up while the
    # trainers are busy (fraction of wall time in train steps, at or above trainer_busy_up): one
    # more. A backlog on an idle trainer is not a capacity problem. Busy at or below
    # trainer_busy_down with no job queued (reserved, filling or ready): one fewer.
    trainer_ready_up: float = 4.0
    trainer_busy_up: float = 0.6
    trainer_busy_down: float = 0.2
    # inferencer: the worst inferencer's mean queue wait (arrival to its group's forward) at or
    # above infer_wait_s_up, or predicts queued per inferencer at or above infer_queued_up: one
    # more; both at or below their down thresholds: one fewer.
    infer_wait_s_up: float = 0.25
    infer_wait_s_down: float = 0.05
    infer_queued_up: float = 8.0
    infer_queued_down: float = 1.0
    # A scale request to the supervisor: a scale-in waits for the drain (up to 60 s).
    request_timeout_s: float = 150.0

    def __post_init__(self) -> None:
        for down, up in (("env_holders_down", "env_holders_up"), ("trainer_busy_down", "trainer_busy_up"),
                         ("infer_wait_s_down", "infer_wait_s_up"), ("infer_queued_down", "infer_queued_up")):
            if not 0 <= getattr(self, down) < getattr(self, up):
                raise ValueError(f"ScalerPolicy: {down}={getattr(self, down)} must be >= 0 and below "
                                 f"{up}={getattr(self, up)} (the band between them is the hysteresis)")


SCALER = ScalerPolicy()


@dataclass(frozen=True)
class FairSharePolicy:
    """How priority routes a scarce resource (trainer slots, env-session turns at the master's
    rollout gate): weighted fair share (stride scheduling, `master/fairshare.py`).

    A tenant's weight is ``base ** (priority / step)``: 2 ** (p / 5), so 0.25 at priority -10,
    1 at 0 and 4 at 10. While backlogged, a tenant receives at least its weight over the sum
    of the backlogged tenants' weights of the grants (within one grant): the floor share. The
    smallest weight, ``base ** (PRIORITY_MIN / step)``, is what keeps a low-priority tenant
    moving (slowed, never starved): 1 grant in 17 against one tenant at priority 10."""

    base: float = 2.0
    step: float = 5.0
    # The rollout gate: a refused requester waits its turn this long after its last retry
    # (workflows retry on the gate's Busy hint, 0.2 s), and at most this many waiters are remembered
    # (past that, a newcomer is refused without a place in line: fairness degrades, bounds hold).
    gate_waiter_ttl_s: float = 2.0
    gate_max_waiters: int = 4096


FAIR_SHARE = FairSharePolicy()
