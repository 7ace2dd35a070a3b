"""Messages of inference, the environment service, workflows and workloads, hosted envs and
metering (re-exported by `protocol.messages`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, field

from protocol.errors import InvalidField, NexusError
from protocol.policy import RECIPE_KIND_MAX, RECIPE_KIND_PATTERN, SAMPLE_MAX_FRAMES
from protocol.msg_roles import TenantConfig, TenantQuotas
from protocol.wire import Array, Struct, message

# Seeds feed numpy's SeedSequence (non-negative, any size); indices become int64.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1



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
    # sft, rl, eval or a registered recipe's kind (`protocol.recipes`): the host runs the factory
    # registered under it, and refuses a kind it has not loaded (InvalidField on kind).
    kind: Annotated[str, Meta(pattern=f"^{RECIPE_KIND_PATTERN}$", max_length=RECIPE_KIND_MAX)]
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
    task: str  # the spec's task: sft, rl, eval or a registered recipe's kind
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
    # The built-in task whose rules the kind follows (`protocol.recipes.FAMILIES`): kept here so
    # a master restarted without the recipe's module still treats the workload right. "": the
    # task's own (a built-in's, and every record from before families).
    family: str = ""

    def __post_init__(self) -> None:
        self.family = self.family or self.task


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
