"""Messages of the role runtime, health, the monitor, the master's tenants and registered bases
(re-exported by `protocol.messages`, where callers import them)."""

from __future__ import annotations

from typing import Any, Literal

from msgspec import field

from protocol.errors import InvalidField, NexusError, error_from_code
from protocol.policy import PRIORITY_MAX, PRIORITY_MIN
from protocol.wire import Struct, message


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


