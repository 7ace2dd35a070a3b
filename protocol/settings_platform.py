"""The settings groups of the platform as a whole (protocol/settings.py has the roles' own):
liveness, leases, retention, usage metering, quotas, telemetry, the monitor, auth, scaling and the
`nexus` command. Import them from protocol.settings, which lists every group in `GROUPS`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from protocol.errors import NexusError
from protocol.policy import LEASES, RETENTION, Leases, Retention, UsageFlush
from protocol.subjects import ROLES
from protocol.settings_base import EnvSettings, var


class HealthSettings(EnvSettings):
    roles = ("health", "monitor")
    readers = "health, monitor"

    health_timeout_s: float | None = Field(None, gt=0, **var(
        "NEXUS_HEALTH_TIMEOUT_S", "seconds without a heartbeat before a role is declared dead",
        default_text="3 x heartbeat interval"))

    def timeout_s(self, heartbeat_interval_s: float) -> float:
        return self.health_timeout_s if self.health_timeout_s is not None else 3 * heartbeat_interval_s


class LeaseSettings(EnvSettings):
    roles = ("master", "trainer")
    readers = "master, trainer"

    renew_every_s: float = Field(LEASES.renew_every_s, ge=0.01, **var(
        "NEXUS_LEASE_RENEW_EVERY_S", "a trainer renews its jobs' leases at most this often (s)"))
    drain_finish_s: float = Field(LEASES.drain_finish_s, ge=0, **var(
        "NEXUS_TRAINER_DRAIN_FINISH_S", "a draining trainer trains its running jobs this long, then releases them (s)"))
    orphan_ttl_s: float = Field(LEASES.orphan_ttl_s, ge=0.1, **var(
        "NEXUS_ORPHAN_TTL_S", "a job idle this long while reserved or filling is failed and purged (s)"))

    def leases(self) -> Leases:
        return Leases(renew_every_s=self.renew_every_s, drain_finish_s=self.drain_finish_s,
                      orphan_ttl_s=self.orphan_ttl_s)


class RetentionSettings(EnvSettings):
    roles = ("master",)
    readers = "master"

    every_s: float = Field(RETENTION.every_s, ge=0.1, **var(
        "NEXUS_COMPACT_EVERY_S", "seconds between the master's compactions"))
    job_records_s: float = Field(RETENTION.job_records_s, ge=0, **var(
        "NEXUS_JOB_RETENTION_S", "finished job records are deleted after this long (s)"))
    versions_kept: int = Field(RETENTION.versions_kept, ge=1, **var(
        "NEXUS_VERSIONS_KEPT", "policy versions kept per tenant besides the pinned ones"))
    records_s: float = Field(RETENTION.records_s, ge=0, **var(
        "NEXUS_RETENTION_S", "finished workload records and usage records idle this long are compacted "
        "(removed; their usage folded into the tenant's `_compacted` record) (s)", default_text="604800 (7 days)"))
    workload_records_max: int = Field(RETENTION.workload_records_max, ge=1, **var(
        "NEXUS_RETENTION_MAX_WORKLOADS", "finished workload records kept at most; past it the oldest are compacted"))
    usage_labels_max: int = Field(RETENTION.usage_labels_max, ge=1, le=100000, **var(
        "NEXUS_USAGE_LABELS_MAX", "distinct usage labels (a predict's workload that is none of the tenant's "
        "workloads) per tenant; the rest are charged to `other`"))

    def retention(self) -> Retention:
        return Retention(every_s=self.every_s, job_records_s=self.job_records_s, versions_kept=self.versions_kept,
                         records_s=self.records_s, workload_records_max=self.workload_records_max,
                         usage_labels_max=self.usage_labels_max)


class UsageSettings(EnvSettings):
    """Metering (`actors.metering`, `protocol.policy.UsageFlush`)."""

    roles = ("trainer", "inferencer")
    readers = "trainer, inferencer"

    every_s: float = Field(2.0, ge=0.01, le=3600, **var(
        "NEXUS_USAGE_FLUSH_EVERY_S", "seconds between a role's usage reports to the master"))
    train_overhead_rows: float = Field(0.0, ge=0, le=1024, **var(
        "NEXUS_METER_TRAIN_OVERHEAD_ROWS",
        "a tenant's fixed cost per grouped step, in rows, when splitting its busy time (docs/usage.md)"))
    infer_overhead_rows: float = Field(0.0, ge=0, le=1024, **var(
        "NEXUS_METER_INFER_OVERHEAD_ROWS",
        "a tenant's fixed cost per grouped forward, in rows, when splitting its busy time (docs/usage.md)"))

    def usage_flush(self) -> UsageFlush:
        return UsageFlush(every_s=self.every_s, train_overhead_rows=self.train_overhead_rows,
                          infer_overhead_rows=self.infer_overhead_rows)


class QuotaSettings(EnvSettings):
    """The quotas of a tenant the operator gave none (`protocol.messages.TenantQuotas`)."""

    roles = ("master", "inferencer")
    readers = "master, inferencer"

    max_inflight_jobs: int = Field(8, ge=1, le=100_000, **var(
        "NEXUS_QUOTA_MAX_INFLIGHT_JOBS", "default quota: a tenant's unfinished training jobs"))
    max_active_rollouts: int = Field(1, ge=1, le=100_000, **var(
        "NEXUS_QUOTA_MAX_ACTIVE_ROLLOUTS", "default quota: a tenant's rollouts collecting at once"))
    predict_rate_per_s: float = Field(1000.0, gt=0, **var(
        "NEXUS_QUOTA_PREDICT_RATE_PER_S", "default quota: predicts per second per tenant per inferencer"))
    predict_burst: int = Field(256, ge=1, **var(
        "NEXUS_QUOTA_PREDICT_BURST", "default quota: predicts above that rate in a burst"))
    max_priority: int = Field(10, ge=-10, le=10, **var(
        "NEXUS_QUOTA_MAX_PRIORITY", "default quota: the highest scheduling priority a tenant's jobs may ask"))

    def quotas(self) -> Any:
        from protocol.messages import TenantQuotas

        return TenantQuotas(**self.model_dump())


class TelemetrySettings(EnvSettings):
    """Span sampling and the span files' bound (actors/tracing.py)."""

    roles = ROLES
    readers = "every role (actors/tracing.py)"

    # The three-tenant demo wrote 75,000 client predict spans in ten minutes: keep a tenth of
    # the traces by default; errors and slow spans are kept whatever the ratio says.
    sample_ratio: float = Field(0.1, ge=0, le=1, **var(
        "NEXUS_TRACE_SAMPLE_RATIO", "share of traces kept (decided from the trace id, so every process agrees)"))
    slow_ms: float = Field(1000.0, ge=0, **var(
        "NEXUS_TRACE_SLOW_MS", "a span at least this long (ms) is kept even in an unsampled trace"))
    file_max_mb: float = Field(64.0, gt=0, **var(
        "NEXUS_TRACE_FILE_MAX_MB", "a span file is rotated (`x.1.jsonl`, `x.2.jsonl`, ...) past this size (MB)"))
    file_backups: int = Field(3, ge=0, le=100, **var(
        "NEXUS_TRACE_FILE_BACKUPS", "rotated span files kept per process (0: truncate instead)"))


class MonitorSettings(EnvSettings):
    """The monitor's retained series and its Prometheus endpoint (actors/monitor/monitor.py)."""

    roles = ("monitor",)
    readers = "monitor (`nexus up` prints where the endpoint is)"

    # 1 s beats: 600 points are ten minutes of each series.
    points: int = Field(600, ge=2, le=100_000, **var(
        "NEXUS_MONITOR_POINTS", "points kept per series (a ring: the oldest goes first)"))
    retain_s: float = Field(3600.0, gt=0, **var(
        "NEXUS_MONITOR_RETAIN_S", "points older than this (s) are dropped even if the ring has room"))
    series_max: int = Field(5000, ge=10, **var(
        "NEXUS_MONITOR_SERIES_MAX", "series kept in all; past it the least recently updated goes"))
    tenant_cap: int = Field(50, ge=1, **var(
        "NEXUS_MONITOR_TENANT_CAP", "tenants with their own label; later tenants share `tenant=\"other\"`"))
    metrics_port: int = Field(9464, ge=0, le=65535, **var(
        "NEXUS_METRICS_PORT", "the monitor's Prometheus endpoint port on NEXUS_METRICS_HOST (0: a free port, shown by "
        "`nexus up`)", allowed="a port, or 0 for a free one"))
    # Loopback by default: on a shared host nothing else should read the series. In a pod the
    # manifests set 0.0.0.0 (the pod's own network, a NetworkPolicy admits only Prometheus).
    metrics_host: str = Field("127.0.0.1", **var(
        "NEXUS_METRICS_HOST", "the address the monitor's Prometheus endpoint listens on",
        allowed="an IPv4 or IPv6 address literal"))

    @field_validator("metrics_host")
    @classmethod
    def _ip_literal(cls, v: str) -> str:
        import ipaddress

        try:
            return str(ipaddress.ip_address(v.strip()))
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address literal (e.g. 127.0.0.1, 0.0.0.0, ::1)") from None
    tensorboard: bool = Field(True, **var(
        "NEXUS_TENSORBOARD", "the monitor writes TensorBoard event files per tenant under `DATA_DIR/tensorboard/`"))


class AuthSettings(EnvSettings):
    """Who a process logs in as, and where tenants' datasets may lie (docs/security.md)."""

    roles = ROLES
    readers = "every role, `nexus`"

    creds: Path | None = Field(None, **var(
        "NEXUS_CREDS", "credentials file a client or role logs in with", flag="--creds (before the command)",
        default_text="the admin's (`cluster.json`'s URL); roles: their own, `DATA_DIR/role-creds/<role>.creds` (`nexus up` sets it)"))
    data_roots: str = Field("", **var(
        "NEXUS_DATA_ROOTS", "extra directories a tenant's dataset roots may lie under (os.pathsep-separated)",
        allowed="directories, os.pathsep-separated",
        default_text="the tenant's own `DATA_DIR/datasets/tenants/<tenant>`, `DATA_DIR/datasets/published` "
                     "and the test fixtures beside the checkout (not part of this repository) only"))
    role_user: str | None = Field(None, pattern=r"^(-|[A-Za-z0-9_.{}-]{1,64})$", **var(
        "NEXUS_ROLE_USER", "the user `nexus up` (run as root) starts role processes as, so they cannot read "
        "`DATA_DIR/auth` (the seeds); `{role}` in it is the role's name (a user per role); `-`: the supervisor's own",
        allowed="a user name (may contain `{role}`), or `-`",
        default_text="`nexus` when that user exists and `nexus up` runs as root, else the supervisor's own"))


class ScaleSettings(EnvSettings):
    """How far the workers' instance counts may go (docs/scaling.md)."""

    roles = ("health",)
    readers = "`nexus up` (the supervisor: `--roles`, `nexus scale`), health manager (its scaler)"

    scaler: bool = Field(False, **var(
        "NEXUS_SCALER", "the health manager scales env workers, inferencers and trainers within the bounds on the "
        "monitor's signals: ready backlog and busy fraction, rollouts waiting, step latency, queue wait and depth, "
        "weighed by tenant priority (docs/scaling.md; acts through `nexus up`'s supervisor)"))

    bounds: str = Field("", **var(
        "NEXUS_SCALE_BOUNDS", "per role, the fewest and most instances `nexus up --roles` and `nexus scale` may set "
        "(a role not named keeps its default)", allowed="comma-separated ROLE=MIN:MAX for env, inferencer, trainer; "
        "0 <= MIN <= MAX <= 32", default_text="env=1:16,inferencer=1:8,trainer=1:8"))

    @field_validator("bounds")
    @classmethod
    def _bounds(cls, value: str) -> str:
        from protocol.scaling import parse_bounds

        try:
            parse_bounds(value)
        except NexusError as exc:
            raise ValueError(exc.message.removeprefix("NEXUS_SCALE_BOUNDS: ")) from None
        return value

    def parsed(self):  # -> dict[str, protocol.scaling.Bounds]
        from protocol.scaling import parse_bounds

        return parse_bounds(self.bounds)


class CliSettings(EnvSettings):
    """Read by typer (``envvar=``) in the `nexus` command (sdk/cli*.py); a test checks the names agree."""

    readers = "`nexus` (`up`: the port; `tenant create`: the account's quota and limits)"

    nats_port: int = Field(4222, ge=1, le=65535, **var(
        "NEXUS_NATS_PORT", "port of the embedded nats-server", flag="--nats-port", cli=True))
    tenant_storage_mb: float = Field(64.0, gt=0, **var(
        "NEXUS_TENANT_STORAGE_MB", "JetStream storage quota (MiB) of a new tenant's own account "
        "(`nexus tenant create`; a tenant created again keeps its last one)", flag="--storage-mb", cli=True))
    # The tenant account's core NATS limits (its account JWT, enforced by nats-server): a few
    # SDK clients and CLI calls at once, each with a handful of subscriptions.
    tenant_max_conns: int = Field(16, ge=1, le=100_000, **var(
        "NEXUS_TENANT_MAX_CONNS", "connections a new tenant's account may hold at once, all servers together "
        "(`nexus tenant create`; created again: kept unless given)", flag="--max-conns", cli=True))
    tenant_max_subs: int = Field(256, ge=1, le=1_000_000, **var(
        "NEXUS_TENANT_MAX_SUBS", "subscriptions per connection of a new tenant's account "
        "(`nexus tenant create`; created again: kept unless given)", flag="--max-subs", cli=True))
    # 1 MiB: nats-server's own default max_payload (the lower of the two holds).
    tenant_max_payload_kb: int = Field(1024, ge=1, le=65536, **var(
        "NEXUS_TENANT_MAX_PAYLOAD_KB", "largest message (KiB) a new tenant's account may publish "
        "(`nexus tenant create`; created again: kept unless given)", flag="--max-payload-kb", cli=True))
