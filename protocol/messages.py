"""Every message type on the bus. Each has a kind and a schema version (see `protocol.wire`).

Replies are either the op's result message or an `ErrorReply`; `ok_or_raise` turns the
latter into the matching `NexusError` on the client side.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, field

from protocol.errors import InvalidField, NexusError, error_from_code
from protocol.policy import PRIORITY_MAX, PRIORITY_MIN, SAMPLE_MAX_FRAMES
from protocol.wire import Array, Struct, message

# Seeds feed numpy's SeedSequence (non-negative, any size); indices become int64.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

RoleState = Literal["starting", "ready", "draining", "stopped"]


# -- generic -------------------------------------------------------------------------
@message("error", 1)
class ErrorReply(Struct):
    """The error envelope every role replies with when a request fails."""

    code: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_exception(cls, exc: NexusError) -> ErrorReply:
        return cls(code=exc.code.value, message=exc.message, details=_plain(exc.details))

    def to_exception(self) -> NexusError:
        return error_from_code(self.code, self.message, self.details)


def _plain(details: dict[str, Any]) -> dict[str, Any]:
    # Details must survive msgpack: keep scalars and lists / maps of them (a spec's field
    # errors travel as a list of {field, message}); stringify anything else.
    def conv(v: Any) -> Any:
        if isinstance(v, str | int | float | bool | type(None)):
            return v
        if isinstance(v, list | tuple):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {str(k): conv(x) for k, x in v.items()}
        return str(v)

    return {str(k): conv(v) for k, v in details.items()}


def ok_or_raise(reply: Any) -> Any:
    if isinstance(reply, ErrorReply):
        raise reply.to_exception()
    return reply


@message("ok", 1)
class Ok(Struct):
    """Reply to a request that has no result beyond success."""

    detail: str = ""


# -- role runtime --------------------------------------------------------------------
@message("info.request", 1)
class InfoRequest(Struct):
    pass


@message("role.info", 1)
class RoleInfo(Struct):
    role: str
    instance: str
    pid: int
    host: str
    started_at: float  # unix seconds
    state: RoleState
    version: str
    ops: list[str]
    in_flight: int
    extra: dict[str, Any] = field(default_factory=dict)


@message("drain.request", 1)
class DrainRequest(Struct):
    """Ask one instance to drain: finish in-flight work, deregister, exit."""

    reason: str = ""


@message("heartbeat", 1)
class Heartbeat(Struct):
    role: str
    instance: str
    pid: int
    host: str
    started_at: float
    sent_at: float
    seq: int
    state: RoleState
    in_flight: int
    interval_s: float
    # Loop liveness (defaults, so beats from older senders still decode): seconds since each
    # watched critical loop last ticked, each one's quiet limit, and those quiet past it.
    loops: dict[str, float] = field(default_factory=dict)
    loop_limits_s: dict[str, float] = field(default_factory=dict)
    stalled: list[str] = field(default_factory=list)
    # What the monitor keeps over time (docs/observability.md; defaults, so older beats
    # decode): role-level levels and running totals (``busy_s``, ``memory_bytes``, ...), and
    # per-tenant ones as signal -> tenant -> value (the master's queue depths, ...).
    gauges: dict[str, float] = field(default_factory=dict)
    tenant_gauges: dict[str, dict[str, float]] = field(default_factory=dict)
    # The inference pool an inferencer serves (`protocol.subjects.pool_name` of its base), so the
    # scaler weighs each pool's pressure apart; empty for the other roles (and older beats).
    pool: str = ""


@message("service.record", 1)
class ServiceRecord(Struct):
    """What a role writes under ``<role>.<instance>`` in the services KV bucket."""

    role: str
    instance: str
    pid: int
    host: str
    started_at: float
    state: RoleState
    version: str
    updated_at: float


# Default byte limit of one tenant's training-queue stream. JetStream reserves every
# stream's limit on the node's store (75% of the free disk unless configured), so the limit
# times the number of tenants must fit there: 256 MiB is ~256 full micro-batches, over ten
# times what the reference defaults keep queued (2 in-flight jobs x 16 micro-batches <= 1 MB).
DEFAULT_TQ_MAX_BYTES = 256 * 1024 * 1024


@message("deployment.settings", 1)
class DeploymentSettings(Struct):
    """What `ensure_layout` records under `Names.deployment_settings_key` in the services
    bucket, so roles that create streams later (the master, per tenant) match the layout."""

    replicas: int = 1  # stream / bucket replicas: 3 on a 3-node NATS cluster
    tq_max_bytes: int = DEFAULT_TQ_MAX_BYTES  # per tenant's training-queue stream

    def __post_init__(self) -> None:
        if self.replicas not in (1, 3, 5):
            raise InvalidField("replicas", f"{self.replicas}: use 1, or 3 / 5 on a NATS cluster of that many nodes")
        if self.tq_max_bytes < 1024 * 1024:
            raise InvalidField("tq_max_bytes", f"{self.tq_max_bytes}: use at least 1 MiB (one max-size micro-batch)")


# -- health --------------------------------------------------------------------------
@message("health.event", 1)
class HealthEvent(Struct):
    """Published by the health manager on ``<prefix>.health.events.<role>.<instance>``."""

    event: Literal["role_down", "role_recovered", "role_stopped"]
    role: str
    instance: str
    pid: int
    host: str
    last_heartbeat_at: float
    detected_at: float
    reason: str


@message("supervisor.restart", 1)
class RestartRequest(Struct):
    """Ask the supervisor to restart one role instance in place (health manager, operator).

    ``mode``: ``kill`` (SIGKILL, then start a new instance: a dead or hung role) or ``drain``
    (SIGTERM, wait for the drain, then start a new instance); ``global`` restarts every role.
    """

    role: str
    instance: str = ""
    mode: Literal["kill", "drain", "global"] = "kill"
    reason: str = ""


@message("supervisor.scale", 1)
class ScaleRequest(Struct):
    """Ask the supervisor to run ``count`` instances of ``role`` (`nexus scale`, a scaler).

    New instances are answered for once they registered ready (an inferencer after its weight
    sync); surplus ones drain (the instances in ``drain`` first, then the highest slots) before
    the reply. Refused past the role's bounds (``NEXUS_SCALE_BOUNDS``), and for zero trainers
    while jobs wait.

    ``pool`` (inferencers only: each serves one base) is the pool the started instances serve,
    or the surplus is drained from: a registered base (``NAME`` or ``registered:NAME``), a
    preset, or a pool name as heartbeats carry it. Empty: new ones serve the deployment's
    default base (NEXUS_INFER_BASE) and the surplus drains whatever its pool. ``count`` is the
    role's total either way: the bounds hold for the total.
    """

    role: str
    count: int
    reason: str = ""
    drain: list[str] = field(default_factory=list)  # instances to drain first (at most the surplus)
    pool: str = ""  # inferencers: which pool gains or loses the instances (see above)


@message("scale.decision", 1)
class ScaleDecision(Struct):
    """One decision of the scaler (`actors/health/scaler.py`): a role's count from -> to, why, and the
    signals behind it; published on ``<prefix>.scale.decisions.<role>`` before it is applied and
    again with its ``outcome`` (``applied``, ``refused: ...``, ``no supervisor``). The counts are
    the role's totals; for an inferencer ``pool`` names the pool whose pressure drove it, which
    gains (loses) the instance."""

    role: str
    from_count: int
    to_count: int
    reason: str
    signals: dict[str, float] = field(default_factory=dict)
    at: float = 0.0
    outcome: str = ""
    pool: str = ""


@message("health.report.request", 1)
class HealthReportRequest(Struct):
    pass


@message("health.report", 1)
class HealthReport(Struct):
    alive: list[str]  # "<role>.<instance>"
    dead: list[str]
    timeout_s: float


# -- monitor -------------------------------------------------------------------------
@message("metric", 1)
class Metric(Struct):
    """One sample on ``<prefix>.metrics.<signal>.<scope>``."""

    signal: str
    scope: str
    value: float
    at: float
    labels: dict[str, str] = field(default_factory=dict)


@message("status.request", 1)
class StatusRequest(Struct):
    include_dead: bool = True


class RoleStatus(Struct):
    role: str
    instance: str
    pid: int
    host: str
    state: Literal["alive", "dead", "stopped"]
    role_state: RoleState
    started_at: float
    uptime_s: float
    last_heartbeat_at: float
    last_heartbeat_age_s: float


@message("cluster.status", 1)
class ClusterStatus(Struct):
    roles: list[RoleStatus]
    metrics: dict[str, float]
    generated_at: float


@message("monitor.snapshot_request", 1)
class SnapshotRequest(Struct):
    """The monitor's ``snapshot`` op: its retained series (`nexus top`, scripts)."""

    history: int = 0  # points per series besides the latest (0: the latest only)
    family: str = ""  # control, learning or system; empty: all


class SeriesSnapshot(Struct):
    """One retained series: its signal, labels and points, oldest first."""

    signal: str
    family: str
    labels: dict[str, str]
    at: list[float]
    values: list[float]
    versions: list[int] = field(default_factory=list)  # the policy version of each point (-1: none)


@message("monitor.snapshot", 1)
class MonitorSnapshot(Struct):
    roles: list[RoleStatus]
    series: list[SeriesSnapshot]
    generated_at: float
    metrics_url: str = ""  # the Prometheus endpoint ("" when it is off)
    decisions: list[ScaleDecision] = field(default_factory=list)  # the scaler's newest, oldest first


# -- master --------------------------------------------------------------------------
@message("list.request", 1)
class ListRequest(Struct):
    # Paging over workload ids (`protocol.policy.LIST_PAGE_DEFAULT`; 0 = the default page).
    limit: int = 0
    cursor: str = ""  # a reply's next_cursor: the page after it


@message("list.reply", 1)
class ListReply(Struct):
    tenants: list[str]
    workloads: list[str]
    next_cursor: str = ""  # "" = this was the last page


# -- tenants -------------------------------------------------------------------------
TaskKind = Literal["sft", "rl"]


class TenantQuotas(Struct):
    """What one tenant may hold at once, set by the operator (never by the tenant's spec).

    Enforced where the thing lives: jobs and rollouts by the master, the predict rate by each
    inferencer (a token bucket per tenant, so N inferencers admit up to N x the rate). Past
    one, the caller gets `protocol.errors.QuotaExceeded` naming the quota and its value.
    Defaults: `protocol.policy.DEFAULT_QUOTAS`. A tier (auth) is one of these per tenant."""

    # Unfinished training jobs of the tenant, all tasks together (the spec's own
    # schedule.max_inflight_jobs, per task, is the tenant's choice below this ceiling).
    max_inflight_jobs: int = 8
    # Rollouts collecting at once (the master's rollout gate), besides the deployment's cap.
    max_active_rollouts: int = 1
    # Predict requests admitted per second per inferencer, and the burst above that rate.
    predict_rate_per_s: float = 1000.0
    predict_burst: int = 256
    # The highest scheduling priority its jobs may ask for (spec.schedule.priority, reserve).
    max_priority: int = 10

    def __post_init__(self) -> None:
        for name in ("max_inflight_jobs", "max_active_rollouts", "predict_burst"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidField(f"quotas.{name}", f"must be an integer >= 1, got {getattr(self, name)!r}")
        if not (isinstance(self.predict_rate_per_s, (int, float)) and self.predict_rate_per_s > 0):
            raise InvalidField("quotas.predict_rate_per_s", f"must be > 0, got {self.predict_rate_per_s!r}")
        if not (isinstance(self.max_priority, int) and PRIORITY_MIN <= self.max_priority <= PRIORITY_MAX):
            raise InvalidField("quotas.max_priority", f"must be an integer in {PRIORITY_MIN}..{PRIORITY_MAX}, "
                                                      f"got {self.max_priority!r}")


@message("tenant.config", 1)
class TenantConfig(Struct):
    """A tenant's compiled backend config: stored in the tenants KV under its name.

    ``schema`` is `models.schema.TenantSchema.to_dict()`; ``signature`` is derived by the
    master from it (never trusted from the client).
    """

    name: str
    base: str  # preset name (tiny-qwen3-vl, qwen3-vl-4b, ...) or a local save_pretrained dir
    schema: dict[str, Any]
    head: str = "mlp"
    head_params: dict[str, Any] = field(default_factory=dict)
    optim: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    # Scheduling (defaults from the reference system; see docs/architecture.md).
    max_inflight_jobs: int = 2
    sft_prefetch_items: int = 16
    staleness_bound: int = 128
    priority: int = 0
    # Export (and announce) a new version only once this many optimizer steps passed since the
    # tenant's last export; 0: after every job. The workload's last job always exports.
    export_every_steps: int = 0
    signature: str = ""
    created_at: float = 0.0
    # LoRA adapters on the base (`models.lora.AdapterConfig` fields); {}: the base stays frozen.
    base_adapter: dict[str, Any] = field(default_factory=dict)
    # The operator's limits for this tenant; None: the deployment's defaults
    # (`protocol.policy.DEFAULT_QUOTAS`). Set with the master's ``tenant_quotas`` op.
    quotas: TenantQuotas | None = None


@message("tenant.create", 1)
class CreateTenantRequest(Struct):
    config: TenantConfig
    exist_ok: bool = False  # same config again is fine; a different one is a conflict


@message("tenant.get", 1)
class GetTenantRequest(Struct):
    tenant: str


@message("tenant.quotas", 1)
class TenantQuotasRequest(Struct):
    """Set a tenant's quotas (an operator op); ``quotas`` None: back to the defaults.
    ``changes`` (TenantQuotas field -> value), when given: those fields changed on top of the
    tenant's current quotas (else the deployment's defaults), ``quotas`` then unused."""

    tenant: str
    quotas: TenantQuotas | None = None
    changes: dict[str, Any] = field(default_factory=dict)


# -- bases the operator registered --------------------------------------------------
@message("base.add", 1)
class BaseAddRequest(Struct):
    """Register ``name`` for the base directory ``path`` on the master's host (an operator op):
    tenants then name it ``registered:<name>`` and never a host path."""

    name: str
    path: str


@message("base.record", 1)
class RegisteredBase(Struct):
    """A registered base (the value under its name in the bases KV bucket)."""

    name: str
    path: str  # resolved absolute directory on the master's host
    added_at: float = 0.0


@message("bases.request", 1)
class BasesRequest(Struct):
    pass


@message("bases.reply", 1)
class BasesReply(Struct):
    """What a spec's ``base`` may name: presets, and ``registered:<name>`` for each registered
    base. ``bases`` has the host paths for the platform only; a tenant gets the names."""

    presets: list[str]
    names: list[str]
    bases: list[RegisteredBase] = field(default_factory=list)


# -- training queue ------------------------------------------------------------------
JobState = Literal[
    "reserved", "filling", "ready", "leased", "trained", "exported", "synced", "cleared",
    "dropped_stale", "failed",
]
TERMINAL_JOB_STATES = ("cleared", "dropped_stale", "failed")


@message("job.record", 1)
class JobRecord(Struct):
    """One training job: stored in the jobs KV under ``<tenant>.<job>``."""

    tenant: str
    job: str
    task: TaskKind
    state: JobState
    created_at: float
    updated_at: float
    auto: bool = True  # leased by the scheduler; False: trained only by an explicit train_batch
    priority: int = 0
    items: int = 0  # messages in the partition (each part of a split micro-batch is one)
    # Optimizer steps those items make: a split micro-batch's parts are one step (the trainer
    # joins them, `actors.tq_read.join_parts`). 0 on a record from before this field: use items.
    steps: int = 0
    samples: int = 0
    behaviour_version: int = -1  # RL: policy version that produced the data (-1: SFT)
    ready_at: float = 0.0
    lease_owner: str = ""
    lease_expires_at: float = 0.0
    attempts: int = 0
    trained_version: int = -1
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    # Incremented at every lease: a trainer's commit must name the epoch it was leased, so a
    # trainer whose lease ran out (and was handed to another) can no longer commit.
    lease_epoch: int = 0
    key: str = ""  # the workflow's idempotency key (a retried reserve returns this job)
    workload: str = ""  # the workload whose workflow made it ("" for a custom loop)
    # W3C trace context (traceparent / tracestate) stored with the job's first micro-batch in
    # the stream: the trainer's `trainer.job` span is its child (docs/observability.md).
    trace: dict[str, str] = field(default_factory=dict)


@message("tq.reserve", 1)
class ReserveRequest(Struct):
    tenant: str
    task: TaskKind
    auto: bool = True
    priority: int | None = None  # None: the tenant's default
    # Idempotency key: a reserve retried after a lost reply (same tenant and key) returns the
    # job the first call made instead of an orphan that counts against the in-flight cap.
    key: str = ""
    workload: str = ""


# A job's micro-batch sequence numbers. Workflows number their items 0..MAX_ITEM_SEQ; an item
# the SDK splits to fit the max payload becomes parts numbered by `chunk_seq`, which sets bit 62
# and packs (seq, log2 of the part count, part index) into disjoint bit fields below it:
#   bits 0-15 index (< 2**16), bits 16-20 log2 parts (<= 16), bits 21-51 seq (< 2**31).
# So a part's seq is > MAX_ITEM_SEQ (never an ordinary seq), and two parts share a seq only if
# they are the same part of the same split of the same item (the map is injective). The
# master's dedup id is "<job>:<seq>", so neither a retry nor a later item can collide.
MAX_ITEM_SEQ = 2**31 - 1
CHUNK_SEQ_FLAG = 1 << 62
MAX_CHUNK_PARTS_LOG2 = 16
# Rows of one optimizer step: the spec's largest micro-batch (`batch_size`, `micro_batch`). The
# trainer joins a split item's parts into one step (`actors.tq_read.join_parts`); a tenant that
# puts parts adding up to more (its own queue_put, not the SDK's split) fails its job instead of
# making every tenant's grouped step that large.
MAX_STEP_ROWS = 1024


def chunk_seq(seq: int, parts_log2: int, index: int) -> int:
    """The seq of part ``index`` of item ``seq`` split into ``2**parts_log2`` parts."""
    if not 0 <= seq <= MAX_ITEM_SEQ:
        raise ValueError(f"seq={seq}: an item's seq must be in 0..{MAX_ITEM_SEQ}")
    if not 0 <= parts_log2 <= MAX_CHUNK_PARTS_LOG2:
        raise ValueError(f"parts_log2={parts_log2}: must be in 0..{MAX_CHUNK_PARTS_LOG2}")
    if not 0 <= index < 1 << parts_log2:
        raise ValueError(f"index={index}: must be in 0..{(1 << parts_log2) - 1}")
    return CHUNK_SEQ_FLAG | seq << 21 | parts_log2 << 16 | index


def is_chunk_seq(seq: int) -> bool:
    return bool(seq & CHUNK_SEQ_FLAG)


def chunk_parts(seq: int) -> tuple[int, int, int] | None:
    """(item seq, log2 of the part count, part index) of a part's seq; None for an ordinary seq.

    The inverse of `chunk_seq`: the trainer joins the parts of one split item back into the
    one micro-batch (one optimizer step) the workflow put (`actors.tq_read.join_parts`)."""
    if not is_chunk_seq(seq):
        return None
    return (seq >> 21) & MAX_ITEM_SEQ, (seq >> 16) & 0x1F, seq & 0xFFFF


def starts_step(seq: int) -> bool:
    """Does the item with this seq start an optimizer step: an ordinary item, or part 0 of a
    split one (its other parts train in the same step)?"""
    parts = chunk_parts(seq)
    return parts is None or parts[2] == 0


@message("tq.put", 1)
class QueuePutRequest(Struct):
    """One micro-batch of a job, in the tenant's own schema. ``seq`` makes retries idempotent."""

    tenant: str
    job: str
    seq: int
    images: dict[str, Array]  # camera -> uint8 [B, H, W, 3]
    state: Array  # float32 [B, state_dim]
    instructions: list[str]  # B
    actions: Array  # float32 [B, horizon, action_dim]
    # RL only: behaviour policy's log-prob, GAE advantages and returns, all float32 [B].
    old_log_prob: Array | None = None
    advantages: Array | None = None
    returns: Array | None = None
    behaviour_version: int = -1


@message("tq.put.reply", 1)
class QueuePutReply(Struct):
    tenant: str
    job: str
    items: int
    duplicate: bool


@message("tq.job", 1)
class JobRef(Struct):
    """Names one job: mark_ready, job status, queue_clear, train_batch."""

    tenant: str
    job: str


@message("tq.get", 1)
class QueueGetRequest(Struct):
    tenant: str
    job: str
    start: int = 0  # first item index
    max_items: int = 1


@message("tq.get.reply", 1)
class QueueGetReply(Struct):
    tenant: str
    job: str
    items: list[QueuePutRequest]
    total: int


# A lease is renewed while its work runs, so it never needs to be long: an hour bounds how long
# a trainer that stopped renewing can hold a job.
MAX_LEASE_S = 3600.0


@message("tq.lease", 1)
class LeaseRequest(Struct):
    """A trainer asks the scheduler for work."""

    trainer: str  # instance id
    max_jobs: int = 4
    # nan or inf would never expire: the job would stay leased by this trainer forever (the
    # bounds refuse both: nan compares false, inf is past the upper one).
    lease_s: Annotated[float, Meta(gt=0, le=MAX_LEASE_S)] = 300.0
    job: str = ""  # lease exactly this job (train_batch of a manual job), with tenant
    tenant: str = ""


@message("tq.lease.reply", 1)
class LeaseReply(Struct):
    jobs: list[JobRecord]
    dropped_stale: list[JobRecord]


@message("tq.update", 1)
class JobUpdate(Struct):
    """A trainer reports a lifecycle step of a job it holds."""

    tenant: str
    job: str
    state: JobState
    trainer: str
    trained_version: int = -1
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    lease_epoch: int = 0  # the epoch the trainer was leased the job under (the fence)
    # On ``trained``: the checkpoint object holding the state after this job ("" when the
    # job was already applied before a crash), and the one that state was built on. The
    # master moves the tenant's checkpoint pointer only if it still names ``base_checkpoint``.
    checkpoint: str = ""
    base_checkpoint: str = ""


@message("tq.lease.renew", 1)
class LeaseRenewRequest(Struct):
    """A trainer extends the leases of the jobs it is training (once per step, bounded)."""

    trainer: str
    jobs: list[JobRef]
    epochs: list[int]  # lease epoch of each job, in the same order
    lease_s: float = 300.0


@message("tq.lease.renew.reply", 1)
class LeaseRenewReply(Struct):
    held: list[str]  # job ids still leased to the trainer (extended)
    lost: list[str]  # job ids it no longer holds: stop training them, never commit them


@message("tq.lease.release", 1)
class LeaseReleaseRequest(Struct):
    """A draining trainer hands back jobs it will not finish: leased ones go back to ready
    (the attempt is not counted), post-commit ones wait for the next trainer to finish."""

    trainer: str
    jobs: list[JobRef]
    epochs: list[int]
    reason: str = "trainer draining"


@message("ckpt.ref", 1)
class CheckpointRef(Struct):
    """The tenant's checkpoint pointer, kept by the master in the checkpoint-refs KV.

    The checkpoint object itself is immutable and uniquely named; moving this pointer is the
    commit point of a training job (or of ``load_weights``)."""

    tenant: str
    object_name: str  # in the checkpoints object bucket; "" = no checkpoint yet
    job: str = ""
    step: int = 0
    version: int = 0
    updated_at: float = 0.0


@message("ckpt.get", 1)
class CheckpointGetRequest(Struct):
    tenant: str


@message("ckpt.commit", 1)
class CheckpointCommitRequest(Struct):
    """Move a tenant's checkpoint pointer outside a job (``load_weights``): compare-and-set on
    the object the caller's state was built on."""

    tenant: str
    object_name: str
    base_checkpoint: str
    trainer: str
    step: int = 0
    version: int = 0


@message("workload.handback", 1)
class HandbackRequest(Struct):
    """A draining env worker hands its running workloads back: the master re-pends them so
    another worker resumes them (workflows resume from the tenant's state)."""

    worker: str
    workloads: list[str]
    reason: str = "env worker draining"


@message("tq.jobs", 1)
class JobsRequest(Struct):
    tenant: str = ""  # all tenants when empty
    states: list[str] = field(default_factory=list)
    limit: int = 0  # records per page (0 = `protocol.policy.LIST_PAGE_DEFAULT`)
    cursor: str = ""  # a reply's next_cursor: the page after it


@message("tq.jobs.reply", 1)
class JobsReply(Struct):
    jobs: list[JobRecord]
    next_cursor: str = ""  # "" = this was the last page


# -- trainer -------------------------------------------------------------------------
@message("train.batch.reply", 1)
class TrainBatchReply(Struct):
    tenant: str
    job: str
    version: int
    step: int
    metrics: dict[str, float]


@message("weights.export", 1)
class ExportRequest(Struct):
    tenant: str


@message("weights.ref", 1)
class WeightsRef(Struct):
    """Where a tenant's exported payload lives, and its manifest (announced on
    ``<prefix>.weights.<tenant>``)."""

    tenant: str
    version: int
    object_name: str  # in the weights object bucket
    size: int
    manifest: dict[str, Any]


@message("weights.read", 1)
class WeightsReadRequest(Struct):
    """A slice of one of a tenant's exported objects, for clients without JetStream (a
    tenant's account has none): the payload, or its manifest. ``version`` -1: the latest."""

    tenant: str
    version: int = -1
    manifest: bool = False
    offset: Annotated[int, Meta(ge=0)] = 0
    max_bytes: Annotated[int, Meta(ge=1, le=4 * 1024 * 1024)] = 512 * 1024


@message("weights.chunk", 1)
class WeightsChunk(Struct):
    tenant: str
    version: int
    object_name: str
    offset: int
    total: int  # bytes in the whole object
    data: bytes


@message("weights.load", 1)
class LoadWeightsRequest(Struct):
    """Replace a tenant slot's module params with an exported payload (object name)."""

    tenant: str
    object_name: str


@message("weights.upload", 1)
class WeightsUploadRequest(Struct):
    """One slice of a file a tenant uploads as starting weights (`nexus weights upload`):
    slices in order from offset 0 (offset 0 starts the file again); ``final`` on the last,
    whose reply says the file was checked and stored as ``name`` in the tenant's own area."""

    tenant: str
    name: str
    offset: Annotated[int, Meta(ge=0)]
    data: bytes
    final: bool = False


@message("weights.init", 1)
class InitWeightsRequest(Struct):
    """Master -> a trainer at submit: build ``config``'s slot, load the uploaded objects into
    it (shapes checked against the slot, every mismatch named) and export it as version 0."""

    config: TenantConfig
    weights: str  # object name in the weights bucket (the tenant's own upload)
    adapter: str = ""  # a peft adapter_model.safetensors upload ("": none, or inside weights)


# -- inference -----------------------------------------------------------------------
@message("infer.predict", 1)
class PredictRequest(Struct):
    """One observation of a tenant, in its own schema, for ``<prefix>.infer.<pool>``."""

    tenant: str
    images: dict[str, Array]  # camera -> uint8 [H, W, 3]
    state: Array  # float32 [state_dim]
    instruction: str
    version: int = -1  # pin a policy version (evaluation); -1: the tenant's current one
    sample: bool = True  # RL heads: sample an action (rollouts) or take the mean
    # The caller's own timeout: past it, the request is dropped unworked. <= 0 or nan: dropped
    # unworked without a reply; the caller would wait for nothing.
    timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    # The caller's id for this logical call; a retry (on any instance) carries the same one, so
    # an instance that answered it replays that reply and one still working on it answers
    # both. Empty: no dedup (every request is worked).
    request_id: str = ""
    # The workload the call serves, for metering (`usage`); empty: the tenant's active one.
    workload: str = ""


@message("infer.predict.reply", 1)
class PredictReply(Struct):
    tenant: str
    version: int
    actions: Array  # float32 [horizon, action_dim]
    log_prob: float | None = None  # RL heads only
    value: float | None = None
    queue_wait_s: float = 0.0  # server side: arrival -> forward start
    forward_s: float = 0.0  # the group's base forward + heads
    batch_size: int = 1  # requests that shared the base forward
    request_id: str = ""  # the request's id, echoed


# -- environment service ---------------------------------------------------------------
@message("env.create", 1)
class EnvCreateRequest(Struct):
    """Open a simulator session on some env worker (queue group)."""

    env_id: str
    options: dict[str, Any] = field(default_factory=dict)
    lease_s: float = 30.0  # the session closes if no call renews it within this


@message("env.session", 1)
class EnvSession(Struct):
    """Where a session lives: later calls go to ``<prefix>.svc.env.<worker>.<op>``."""

    session: str
    worker: str
    env_id: str
    spec: dict[str, Any]  # cameras, state_dim, action_dim, action bounds, tasks, max_episode_steps


@message("env.reset", 1)
class EnvResetRequest(Struct):
    session: str
    # A negative seed made the simulator raise, which closed the session as "crashed".
    seed: Annotated[int, Meta(ge=0)] | None = None
    task: str | None = None


@message("env.step", 1)
class EnvStepRequest(Struct):
    session: str
    action: Array  # float32 [action_dim]


@message("env.close", 1)
class EnvCloseRequest(Struct):
    session: str


@message("env.obs", 1)
class EnvObs(Struct):
    session: str
    images: dict[str, Array]
    state: Array
    instruction: str
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


# -- workflows and workloads -----------------------------------------------------------
@message("workflow.spec", 1)
class WorkflowSpec(Struct):
    """What an env worker runs for one workload (compiled by the master from its spec)."""

    workload: str
    tenant: str
    kind: Literal["rl", "sft", "eval"]
    env_id: str = ""
    env_options: dict[str, Any] = field(default_factory=dict)
    # env.hosted ("tenant": the tenant's `nexus env serve` processes run it, never an env worker).
    hosted: str = ""
    dataset_root: str = ""  # SFT: a LeRobot v3.0 root ("" with demo_episodes > 0: record first)
    # SFT recording: where the demos go, relative to the env worker's data dir (the master
    # names it: the tenant's own datasets dir, transport/datasets.py).
    record_path: str = ""
    camera_map: dict[str, str] = field(default_factory=dict)  # dataset camera key -> schema camera
    demo_episodes: int = 0
    demo_noise: float = 0.0  # DART noise on executed expert actions while recording
    # The recipe's config (the spec's algorithm section, whole: protocol/recipe_configs.py), as
    # plain data; the workflow validates it once into that model ({}: a kind that takes none).
    algo: dict[str, Any] = field(default_factory=dict)
    # This workload's budget, not the tenant's: optimizer steps it trains (0: no step limit),
    # of which ``steps_done`` were trained or queued (in jobs that will train) before this start
    # of its workflow (a resumed one trains only the rest); episodes likewise.
    max_steps: int = 0
    steps_done: int = 0
    max_episodes: int = 0
    episodes_done: int = 0
    start_version: int = -1  # the tenant's version when the workload was accepted (-1: unknown)
    jobs: list[str] = field(default_factory=list)  # its unfinished jobs a resumed workflow waits for
    max_wall_s: float = 0.0
    eval_version: int = -1
    eval_episodes: int = 0
    eval_seed: int = 0
    eval_sample: bool = False  # sample actions in evaluation instead of taking the mean
    # eval.tasks: episode i runs task eval_tasks[i % len] (indices or names of the env's tasks);
    # eval_all_tasks: round-robin over every task of the env; neither: the env's seeded draw.
    eval_tasks: list[int | str] = field(default_factory=list)
    eval_all_tasks: bool = False
    policy_tenant: str = ""  # whose policy acts ("" = tenant); an eval may score another tenant's export
    seed: int = 0
    demo_seed: int = 0  # first reset seed of the expert recording (episode i: demo_seed + i)
    state_key: str = "observation.state"  # LeRobot feature keys the SFT reader takes
    action_key: str = "action"
    # A quality target ends the workload early: metric ("" = none), one bound, rolling window.
    target_metric: str = ""
    target_at_least: float | None = None
    target_at_most: float | None = None
    target_window: int = 20


# An evaluation's per-task table has a row per task its episodes ran: a LIBERO suite has at
# most 90 tasks (libero_90), so 90 rows bound it (more are cut, the rest counted in the totals).
MAX_TASK_ROWS = 90
MAX_TASK_TEXT = 200  # characters of a row's task name or instruction kept


class TaskResult(Struct):
    """One row of an evaluation's per-task table (the env's ``info["task_index"]``)."""

    task_index: int
    task: str = ""  # the env's task name
    instruction: str = ""  # its language instruction
    episodes: int = 0
    successes: int = 0
    success_rate: float = 0.0


@message("workload.ref", 1)
class WorkloadRef(Struct):
    workload: str


@message("workload.event", 1)
class WorkloadEvent(Struct):
    """On ``<prefix>.workloads.events.<workload>``: lifecycle changes and progress."""

    workload: str
    tenant: str
    kind: Literal["accepted", "rejected", "state", "progress", "done"]
    state: str = ""
    step: int = 0  # policy version reached
    episodes: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    message: str = ""
    errors: list[dict[str, str]] = field(default_factory=list)
    at: float = 0.0
    # An evaluation's per-task table (eval, or sft / rl's closing evaluation), sorted by task
    # index; empty when the env reports no task index. At most MAX_TASK_ROWS rows.
    per_task: list[TaskResult] = field(default_factory=list)


# -- hosted envs (docs/hosted_envs.md) -------------------------------------------------
# Workloads one hosted env process runs at once, and the ids a claim may name as running.
MAX_HOSTED_RUNNING = 8


@message("hosted.claim", 1)
class HostedClaimRequest(Struct):
    """`nexus env serve`'s heartbeat and claim (master op ``hosted_claim``): the process
    ``process`` of ``tenant`` (the caller's own: the broker-asserted identity is checked) runs
    ``running`` and has room for ``capacity`` workloads. The master renews its lease, names
    what it must stop, and hands it at most one pending hosted workload of its tenant;
    ``leaving``: the process stops, and hands back what it ran."""

    tenant: str
    process: str
    running: Annotated[list[str], Meta(max_length=MAX_HOSTED_RUNNING)] = field(default_factory=list)
    capacity: Annotated[int, Meta(ge=1, le=MAX_HOSTED_RUNNING)] = 1
    # The process stops (SIGTERM / Ctrl-C): its lease ends now and what it ran goes back to
    # pending at once, instead of after the lease.
    leaving: bool = False


@message("hosted.claim.reply", 1)
class HostedClaimReply(Struct):
    lease_s: float  # the process's lease: claim again well within it, or its workloads go back
    start: list[WorkflowSpec] = field(default_factory=list)  # run these now (at most one a claim)
    stop: list[str] = field(default_factory=list)  # workloads it named that are no longer its own
    processes: int = 1  # hosted processes of this tenant connected now (this one included)


@message("hosted.event", 1)
class HostedEventRequest(Struct):
    """A hosted process's workflow event (progress, done), through the master: a tenant
    account may not publish on the platform's events subjects. Accepted only from the
    process the workload runs on, for the caller's own tenant."""

    tenant: str
    process: str
    event: WorkloadEvent


WorkloadState = Literal["pending", "running", "completed", "failed", "cancelled"]
TERMINAL_WORKLOAD_STATES = ("completed", "failed", "cancelled")


@message("workload.record", 1)
class WorkloadRecord(Struct):
    """A workload in the workloads KV (key: its id)."""

    workload: str
    tenant: str
    task: str
    state: WorkloadState
    spec: dict[str, Any]
    created_at: float
    updated_at: float
    worker: str = ""  # env worker running its workflow
    step: int = 0  # policy version reached
    episodes: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    message: str = ""
    eval_version: int = -1
    # sft / rl: the tenant's version when the workload was accepted, never changed after (a
    # workflow resumed on another env worker counts from it); -1: an eval, or an older record.
    start_version: int = -1
    # Optimizer steps this workload trains (0: no step budget); its steps so far are
    # ``step - start_version`` (`workload_steps`).
    budget_steps: int = 0
    # Its evaluation's per-task table (the last event's; WorkloadEvent.per_task), in its report.
    per_task: list[TaskResult] = field(default_factory=list)


def workload_steps(rec: WorkloadRecord) -> int:
    """The optimizer steps ``rec``'s workload trained so far: the tenant's versions since it
    was accepted (a record from before ``start_version``: its version)."""
    return max(0, rec.step - rec.start_version) if rec.start_version >= 0 else rec.step


@message("workload.report", 1)
class WorkloadReport(Struct):
    """A finished workload's report (what the master wrote to its outputs.report_path)."""

    workload: str
    path: str = ""  # relative to the master's data dir: reports/<tenant>/<report_path> (no host path)
    report: dict[str, Any] = field(default_factory=dict)


@message("workload.submit", 1)
class SubmitRequest(Struct):
    """A spec as YAML or JSON text (what a file holds), or already parsed."""

    spec_text: str = ""
    spec: dict[str, Any] = field(default_factory=dict)


@message("workloads.list", 1)
class WorkloadsRequest(Struct):
    tenant: str = ""
    limit: int = 0  # records per page (0 = `protocol.policy.LIST_PAGE_DEFAULT`)
    cursor: str = ""  # a reply's next_cursor: the page after it


@message("workloads.reply", 1)
class WorkloadsReply(Struct):
    workloads: list[WorkloadRecord]
    next_cursor: str = ""  # "" = this was the last page


@message("tenants.reply", 1)
class TenantsReply(Struct):
    tenants: list[TenantConfig]
    versions: dict[str, int]
    # tenant -> its workload ids, oldest first (a tenant runs workloads one after another)
    history: dict[str, list[str]] = field(default_factory=dict)
    next_cursor: str = ""  # "" = this was the last page (paged by tenant name)


@message("tenant.delete", 1)
class TenantDeleteRequest(Struct):
    """Remove a tenant: slot, queue stream, policy versions, checkpoints, job and workload
    records. Refused while one of its workloads is pending or running (cancel it first)."""

    tenant: str


@message("tenant.deleted", 1)
class TenantDeleted(Struct):
    """Announced on ``<prefix>.tenants.deleted.<tenant>``: trainers and inferencers drop the
    tenant's slot and heads."""

    tenant: str
    at: float
    # What went, counted per kind: objects, jobs, workloads, usage, reports, datasets, boards.
    removed: dict[str, int] = field(default_factory=dict)
    # A `tenant_reset`: only the slot went (config, versions, checkpoints, jobs, queue); the
    # tenant's account, workload records and usage stay, so roles keep its unsent usage.
    reset: bool = False


def is_slot_reset(data: bytes) -> bool:
    """Is this ``tenants.deleted`` announcement a reset (only the slot went)? A role then drops
    the tenant's slot and heads but keeps its unsent usage (the tenant's records stay)."""
    from protocol.errors import NexusError
    from protocol.wire import decode

    try:
        return bool(decode(data, TenantDeleted).reset)
    except (NexusError, ValueError, TypeError):  # unreadable: the delete it was announced as
        return False


@message("tenant.show", 1)
class TenantShow(Struct):
    """`tenant_show`'s reply: what a tenant (or the operator) sees of one tenant. ``config``
    None: the tenant has no slot now (reset, or nothing trained yet); its next sft / rl
    submit registers one."""

    tenant: str
    config: TenantConfig | None
    version: int  # its newest policy version (0: none exported)
    quotas: TenantQuotas  # in force: the operator's, else the deployment's defaults
    quotas_default: bool  # True: the operator set none (NEXUS_QUOTA_*)
    workloads: list[str] = field(default_factory=list)  # its workload ids, oldest first


@message("tenant.reset", 1)
class TenantResetRequest(Struct):
    """Drop a tenant's slot (config, policy versions, checkpoints, job records, queue) so its
    next submit registers a new schema; its account, workload records and usage stay.
    Refused while one of its workloads is pending or running. A tenant resets only itself
    (an empty ``tenant``: the caller's own)."""

    tenant: str = ""


@message("dataset.sample", 1)
class SampleRequest(Struct):
    """Sample frames of a LeRobot v3.0 dataset readable by the env worker (a path on its host)."""

    root: str
    n: int
    seed: Annotated[int, Meta(ge=0)] | None = None
    # Exact frames instead of a random sample; int64 on the worker.
    indices: list[Annotated[int, Meta(ge=_INT64_MIN, le=_INT64_MAX)]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Cross-field (n counts only without indices), and checked when built too: a client
        # learns before sending. Checked at decode: a worker never reads more frames than one reply can carry.
        if self.indices:
            if len(self.indices) > SAMPLE_MAX_FRAMES:
                raise InvalidField("indices", f"{len(self.indices)} frames asked; at most {SAMPLE_MAX_FRAMES} "
                                              "per request (SAMPLE_MAX_FRAMES): ask in several requests")
        elif not (isinstance(self.n, int) and 1 <= self.n <= SAMPLE_MAX_FRAMES):
            raise InvalidField("n", f"must be an integer in 1..{SAMPLE_MAX_FRAMES} (SAMPLE_MAX_FRAMES), "
                                    f"got {self.n!r}")


@message("dataset.batch", 1)
class DatasetBatch(Struct):
    root: str
    index: Array  # int64 [B]
    episode_index: Array
    frame_index: Array
    timestamp: Array
    tasks: list[str]
    images: dict[str, Array]  # camera key -> uint8 [B, H, W, 3]
    state: Array | None = None
    action: Array | None = None


# -- metering ------------------------------------------------------------------------
class UsageCounters(Struct):
    """Metered use of one (tenant, workload). Device-seconds are the role's measured busy time
    of each grouped forward / step, split over the tenants in it by rows (docs/usage.md)."""

    train_device_s: float = 0.0
    infer_device_s: float = 0.0
    train_rows: int = 0  # samples trained (rows of micro-batches, summed over steps)
    infer_rows: int = 0  # rows forwarded (one per predict request)
    train_steps: int = 0  # grouped steps the tenant took part in
    requests: int = 0  # predict requests answered
    stored_bytes: int = 0  # bytes of policy exports written for it

    def add(self, other: UsageCounters) -> None:
        for f in ("train_device_s", "infer_device_s", "train_rows", "infer_rows", "train_steps", "requests",
                  "stored_bytes"):
            setattr(self, f, getattr(self, f) + getattr(other, f))


class UsageEntry(Struct):
    tenant: str
    workload: str  # "" = not known to the role (the master charges the tenant's active workload)
    usage: UsageCounters


@message("usage.report", 1)
class UsageReport(Struct):
    """A batch of usage deltas from one role instance to the master (``usage_report``).

    ``seq`` numbers the instance's reports from 1; a report is re-sent unchanged until the
    master acknowledges it, and the master applies each (instance, boot, seq) once."""

    role: str
    instance: str
    seq: int
    entries: list[UsageEntry]
    busy_s: float = 0.0  # the instance's measured busy time so far (all of it, informational)
    # Random per process start: a process restarted under the same instance id (a container's
    # restart policy) numbers its reports from 1 again without meeting its old seqs.
    boot: str = ""


@message("usage.record", 1)
class UsageRecord(Struct):
    """Cumulative usage of one (tenant, workload) in the usage KV (key ``<tenant>.<workload>``,
    workload ``_`` for use outside any workload)."""

    tenant: str
    workload: str
    usage: UsageCounters
    updated_at: float = 0.0
    # "<instance>.<boot>" -> the last report seq applied here: a retried report is not counted twice.
    applied: dict[str, int] = field(default_factory=dict)


@message("usage.request", 1)
class UsageRequest(Struct):
    tenant: str = ""  # "" = every tenant
    workload: str = ""  # "" = every workload
    limit: int = 0  # records per page (0 = `protocol.policy.LIST_PAGE_DEFAULT`)
    cursor: str = ""  # a reply's next_cursor: the page after it


@message("usage.reply", 1)
class UsageReply(Struct):
    records: list[UsageRecord]
    # tenant -> bytes its checkpoints and exported versions hold in the object store now.
    stored_now: dict[str, int] = field(default_factory=dict)
    next_cursor: str = ""  # "" = this was the last page
