"""Every request-reply op, declared once: role, name, request type, reply type, access rule.

A server registers its handler from the op (``@op(ops.MASTER_LEASE)`` in `actors.runtime`),
and a client calls through it (``await bus.call(ops.MASTER_LEASE, req)``), so an op's subject
is spelled nowhere else and "where does this message go" is one lookup here::

    ops.MASTER_LEASE.subject(names)                  # 'nexus.master.lease' (queue group)
    ops.ENV_STEP.instance_subject(names, "a1b2c3d4") # 'nexus.svc.env.a1b2c3d4.step'
    ops.INFO.of("trainer").subject(names)            # 'nexus.trainer.info'

Adding an op: one constant below (in its role's group) and one ``@op`` handler on that role.
A role whose handlers and this table disagree refuses to start (`actors.runtime.Role`).

Access (checked by the runtime before the handler runs, `actors.identity.authorize`):

- ``tenant``: the request's ``tenant`` field must be the caller's;
- ``checked``: the handler calls `require_tenant` itself once it knows the tenant;
- ``admin``: platform callers only;
- ``any``: every authenticated caller.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from protocol.messages import (
    BaseAddRequest,
    BasesReply,
    BasesRequest,
    CheckpointCommitRequest,
    CheckpointGetRequest,
    CheckpointRef,
    ClusterStatus,
    CreateTenantRequest,
    DatasetBatch,
    DrainRequest,
    EnvCloseRequest,
    EnvCreateRequest,
    EnvObs,
    EnvResetRequest,
    EnvSession,
    EnvStepRequest,
    ExportRequest,
    GetTenantRequest,
    HandbackRequest,
    HealthReport,
    HealthReportRequest,
    HostedClaimReply,
    HostedClaimRequest,
    HostedEventRequest,
    InfoRequest,
    InitWeightsRequest,
    JobRecord,
    JobRef,
    JobsReply,
    JobsRequest,
    JobUpdate,
    LeaseReleaseRequest,
    LeaseRenewReply,
    LeaseRenewRequest,
    LeaseReply,
    LeaseRequest,
    ListReply,
    ListRequest,
    LoadWeightsRequest,
    MonitorSnapshot,
    Ok,
    QueueGetReply,
    QueueGetRequest,
    QueuePutReply,
    QueuePutRequest,
    RegisteredBase,
    ReserveRequest,
    RoleInfo,
    SampleRequest,
    SnapshotRequest,
    StatusRequest,
    SubmitRequest,
    TenantConfig,
    TenantDeleted,
    TenantDeleteRequest,
    TenantQuotasRequest,
    TenantResetRequest,
    TenantShow,
    TenantsReply,
    TrainBatchReply,
    UsageReply,
    UsageReport,
    UsageRequest,
    WeightsChunk,
    WeightsReadRequest,
    WeightsRef,
    WeightsUploadRequest,
    WorkflowSpec,
    WorkloadRecord,
    WorkloadRef,
    WorkloadReport,
    WorkloadsReply,
    WorkloadsRequest,
)
from protocol.subjects import Names

# Who may call an op (see the module docstring); `actors.identity` enforces them.
ACCESS_LEVELS = ("tenant", "checked", "admin", "any")
# The role of an op every role serves (`INFO`, `DRAIN`); `Op.of(role)` names the role.
EVERY_ROLE = "*"


@dataclass(frozen=True)
class Op:
    role: str  # the role serving it, or EVERY_ROLE
    name: str  # the subject's last token
    request: type
    reply: type | tuple[type, ...]  # what a successful call returns (an `ErrorReply` besides)
    access: str = "tenant"

    def __post_init__(self) -> None:
        if self.access not in ACCESS_LEVELS:
            raise ValueError(f"op {self.role}.{self.name}: access {self.access!r} is not one of {ACCESS_LEVELS}")

    @property
    def replies(self) -> tuple[type, ...]:
        return self.reply if isinstance(self.reply, tuple) else (self.reply,)

    def of(self, role: str) -> Op:
        """This op of every role (`INFO`, `DRAIN`), served by ``role``."""
        if self.role != EVERY_ROLE:
            raise ValueError(f"op {self.role}.{self.name} belongs to {self.role!r} alone; of() is for ops of every role")
        return replace(self, role=role)

    def _served_by(self) -> str:
        if self.role == EVERY_ROLE:
            raise ValueError(f"op {self.name!r} is served by every role: name one, ops.{self.name.upper()}.of(role)")
        return self.role

    def subject(self, names: Names) -> str:
        """The role-wide subject (queue group: one instance answers)."""
        return names.role_op(self._served_by(), self.name)

    def instance_subject(self, names: Names, instance: str) -> str:
        """The subject of one instance of the role."""
        return names.instance_op(self._served_by(), instance, self.name)

    def instance_pattern(self, names: Names) -> str:
        """Every instance's subject of this op (``*`` for the instance; for an op of every
        role, for the role too): a permission's wildcard."""
        return f"{names.prefix}.svc.{self.role}.*.{self.name}"


# -- every role (actors.runtime.Role) -------------------------------------------------------
# info carries role internals (an inferencer's tenants and versions): platform only.
INFO = Op(EVERY_ROLE, "info", InfoRequest, RoleInfo, "admin")
DRAIN = Op(EVERY_ROLE, "drain", DrainRequest, Ok, "admin")

# -- master: tenants ---------------------------------------------------------------------
MASTER_TENANT_CREATE = Op("master", "tenant_create", CreateTenantRequest, TenantConfig, "checked")
MASTER_TENANT_DELETE = Op("master", "tenant_delete", TenantDeleteRequest, TenantDeleted, "admin")
MASTER_TENANT_RESET = Op("master", "tenant_reset", TenantResetRequest, TenantDeleted, "tenant")
MASTER_TENANT_SHOW = Op("master", "tenant_show", GetTenantRequest, TenantShow, "tenant")
MASTER_TENANT_GET = Op("master", "tenant_get", GetTenantRequest, TenantConfig, "tenant")
MASTER_TENANT_QUOTAS = Op("master", "tenant_quotas", TenantQuotasRequest, TenantConfig, "admin")
MASTER_TENANTS = Op("master", "tenants", WorkloadsRequest, TenantsReply, "admin")
MASTER_LIST = Op("master", "list", ListRequest, ListReply, "admin")

# -- master: jobs, the training queue, leases and checkpoints ----------------------------
MASTER_RESERVE = Op("master", "reserve", ReserveRequest, JobRecord, "tenant")
MASTER_QUEUE_PUT = Op("master", "queue_put", QueuePutRequest, QueuePutReply, "tenant")
MASTER_QUEUE_GET = Op("master", "queue_get", QueueGetRequest, QueueGetReply, "tenant")
MASTER_QUEUE_CLEAR = Op("master", "queue_clear", JobRef, JobRecord, "tenant")
MASTER_MARK_READY = Op("master", "mark_ready", JobRef, JobRecord, "tenant")
MASTER_JOB = Op("master", "job", JobRef, JobRecord, "tenant")
MASTER_JOBS = Op("master", "jobs", JobsRequest, JobsReply, "tenant")
MASTER_ROLLOUT_BEGIN = Op("master", "rollout_begin", JobRef, Ok, "tenant")
MASTER_ROLLOUT_END = Op("master", "rollout_end", JobRef, Ok, "tenant")
MASTER_LEASE = Op("master", "lease", LeaseRequest, LeaseReply, "admin")
MASTER_LEASE_RENEW = Op("master", "lease_renew", LeaseRenewRequest, LeaseRenewReply, "admin")
MASTER_LEASE_RELEASE = Op("master", "lease_release", LeaseReleaseRequest, Ok, "admin")
MASTER_JOB_UPDATE = Op("master", "job_update", JobUpdate, JobRecord, "admin")
MASTER_CHECKPOINT_GET = Op("master", "checkpoint_get", CheckpointGetRequest, CheckpointRef, "admin")
MASTER_CHECKPOINT_COMMIT = Op("master", "checkpoint_commit", CheckpointCommitRequest, CheckpointRef, "admin")

# -- master: weights and bases ------------------------------------------------------------
MASTER_WEIGHTS_READ = Op("master", "weights_read", WeightsReadRequest, WeightsChunk, "tenant")
MASTER_WEIGHTS_UPLOAD = Op("master", "weights_upload", WeightsUploadRequest, Ok, "tenant")
MASTER_BASE_ADD = Op("master", "base_add", BaseAddRequest, RegisteredBase, "admin")
MASTER_BASES = Op("master", "bases", BasesRequest, BasesReply, "any")

# -- master: workloads --------------------------------------------------------------------
MASTER_SUBMIT = Op("master", "submit", SubmitRequest, WorkloadRecord, "checked")
MASTER_WORKLOAD = Op("master", "workload", WorkloadRef, WorkloadRecord, "checked")
MASTER_WORKLOAD_REPORT = Op("master", "workload_report", WorkloadRef, WorkloadReport, "checked")
MASTER_WORKLOADS = Op("master", "workloads", WorkloadsRequest, WorkloadsReply, "tenant")
MASTER_CANCEL = Op("master", "cancel", WorkloadRef, WorkloadRecord, "checked")
MASTER_HANDBACK = Op("master", "handback", HandbackRequest, Ok, "admin")
# Hosted envs (`nexus env serve`): only the caller's own tenant's.
MASTER_HOSTED_CLAIM = Op("master", "hosted_claim", HostedClaimRequest, HostedClaimReply, "tenant")
MASTER_HOSTED_EVENT = Op("master", "hosted_event", HostedEventRequest, Ok, "tenant")

# -- master: usage ------------------------------------------------------------------------
MASTER_USAGE = Op("master", "usage", UsageRequest, UsageReply, "tenant")
MASTER_USAGE_REPORT = Op("master", "usage_report", UsageReport, Ok, "admin")

# -- trainer ------------------------------------------------------------------------------
TRAINER_TRAIN_BATCH = Op("trainer", "train_batch", JobRef, TrainBatchReply, "tenant")
TRAINER_EXPORT_PARAMS = Op("trainer", "export_params", ExportRequest, WeightsRef, "tenant")
TRAINER_INIT_WEIGHTS = Op("trainer", "init_weights", InitWeightsRequest, Ok, "admin")
TRAINER_LOAD_WEIGHTS = Op("trainer", "load_weights", LoadWeightsRequest, Ok, "tenant")

# -- env worker: sessions (create role-wide; reset, step, close on the session's instance) --
ENV_CREATE = Op("env", "create", EnvCreateRequest, EnvSession, "any")
ENV_RESET = Op("env", "reset", EnvResetRequest, EnvObs, "any")
ENV_STEP = Op("env", "step", EnvStepRequest, EnvObs, "any")
ENV_CLOSE = Op("env", "close", EnvCloseRequest, Ok, "any")
ENV_SAMPLE = Op("env", "sample", SampleRequest, DatasetBatch, "checked")
# -- env worker: a workload's workflow loop (the master starts it role-wide, stops it on its instance)
ENV_START_WORKFLOW = Op("env", "start_workflow", WorkflowSpec, Ok, "admin")
ENV_STOP_WORKFLOW = Op("env", "stop_workflow", WorkloadRef, Ok, "admin")

# -- health manager -----------------------------------------------------------------------
HEALTH_REPORT = Op("health", "report", HealthReportRequest, HealthReport, "admin")

# -- monitor ------------------------------------------------------------------------------
MONITOR_STATUS = Op("monitor", "status", StatusRequest, ClusterStatus, "admin")
MONITOR_SNAPSHOT = Op("monitor", "snapshot", SnapshotRequest, MonitorSnapshot, "admin")

# (The inferencer serves no op of its own: predictions go to `Names.infer(pool)`, read by
# its batching loop.)

ALL_OPS: tuple[Op, ...] = tuple(v for v in globals().values() if isinstance(v, Op))
EVERY_ROLE_OPS: tuple[Op, ...] = tuple(o for o in ALL_OPS if o.role == EVERY_ROLE)


def ops_of(role: str) -> tuple[Op, ...]:
    """The ops ``role`` serves: its own, then those of every role bound to it."""
    return (*(o for o in ALL_OPS if o.role == role), *(o.of(role) for o in EVERY_ROLE_OPS))


def _check_unique() -> None:
    seen: set[tuple[str, str]] = set()
    for o in ALL_OPS:
        if (o.role, o.name) in seen:
            raise ValueError(f"op {o.role}.{o.name} is declared twice in protocol/ops.py")
        seen.add((o.role, o.name))


_check_unique()
