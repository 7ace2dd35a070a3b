"""Messages of the training queue and the trainer (re-exported by `protocol.messages`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, field

from protocol.msg_roles import TaskKind, TenantConfig
from protocol.wire import Array, Struct, message




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


# A KL weight past this drowns PPO's own objective (its terms are O(1)): a bound, not a tuning hint.
MAX_KL_COEF = 100.0


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
    # RL with a KL term (protocol.recipe_configs.RLConfig.kl_coef): its weight, and the policy
    # version it anchors to (the trainer copies the policy when the slot is at that version and
    # keeps the copy while items name it). 0.0 and -1: no KL term (SFT, plain PPO).
    kl_coef: Annotated[float, Meta(ge=0, le=MAX_KL_COEF)] = 0.0
    anchor_version: Annotated[int, Meta(ge=-1)] = -1


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


