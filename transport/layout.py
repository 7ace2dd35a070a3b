"""Create the deployment's streams, KV buckets and object buckets, idempotently.

Called by `nexus up` (and by tests) before any role starts; running it twice changes
nothing, and running it with another replica count moves what exists to that count.
Per-tenant training-queue streams are created when a tenant is created, not here, but from
the settings recorded here (`DeploymentSettings` in the services bucket)::

    await ensure_layout(js, names, replicas=3)             # on a 3-node cluster
    settings = await read_deployment_settings(js, names)   # the master, at start
    await ensure_tq_stream(js, names, "acme", settings)    # per tenant
    await publish_tq(js, names, "acme", subject, data, headers, settings)  # Busy when full
"""

from __future__ import annotations

import asyncio
import time

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.client import KV_STREAM_TEMPLATE
from nats.js.errors import APIError, BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.object_store import OBJ_STREAM_TEMPLATE

from transport.bus import js_retry
from protocol.errors import Busy, FailedPrecondition, Unavailable
from protocol.messages import DeploymentSettings
from protocol.policy import DEDUP_WINDOW_S
from protocol.subjects import Names
from protocol.wire import decode, encode

WEEK_S = 7 * 24 * 3600
# JetStream's error codes (server/errors.json) that a training-queue put or create can meet.
JS_ERR_MAX_BYTES = 10077  # "maximum bytes exceeded": the stream is at max_bytes, discard=new
JS_ERR_INSUFFICIENT_RESOURCES = 10023  # no node can reserve the stream's max_bytes
JS_ERR_STORAGE_RESOURCES = 10047  # "insufficient storage resources available" (one server)
JS_ERR_NO_PEERS = 10005  # "no suitable peers for placement, <why>" (a cluster)
# After a replica change (R1 -> R3), how long the layout waits for the new peers, and how
# often it asks (a move took ~1.3 s on an idle machine).
REPLICA_CHANGE_TIMEOUT_S = 30.0
REPLICA_CHANGE_POLL_S = 0.2
# A full queue frees space when a trainer clears a job: seconds to minutes. The client's
# retry loop waits at least this long before trying again.
TQ_FULL_RETRY_AFTER_S = 5.0


def stream_configs(names: Names, replicas: int = 1) -> list[StreamConfig]:
    return [
        # Durable intake: a spec published by any plain NATS client waits here until the
        # master takes it; WorkQueue retention deletes it once acknowledged.
        StreamConfig(
            name=names.stream_intake,
            subjects=[names.workloads_submit],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            num_replicas=replicas,
        ),
        # Lifecycle events, kept a week so `wait` after a restart can replay them.
        StreamConfig(
            name=names.stream_events,
            subjects=[names.workload_events_all],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=WEEK_S,
            num_replicas=replicas,
        ),
        StreamConfig(
            name=names.stream_health_events,
            subjects=[names.health_events_all],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=WEEK_S,
            max_msgs=100_000,
            num_replicas=replicas,
        ),
    ]


def kv_buckets(names: Names) -> dict[str, int]:
    """Bucket name -> history depth."""
    return {
        names.kv_tenants: 1,
        names.kv_workloads: 5,
        names.kv_jobs: 5,
        names.kv_versions: 1,
        names.kv_services: 1,
        # The tenants' checkpoint pointers (moved by the master at every commit).
        names.kv_ckpt_refs: 1,
        # Metered usage per (tenant, workload), written by the master alone.
        names.kv_usage: 1,
        # Registered base name -> directory (`nexus base add`), written by the master alone.
        names.kv_bases: 1,
    }


def object_buckets(names: Names) -> list[str]:
    return [names.obj_weights, names.obj_checkpoints]


def kv_stream(bucket: str) -> str:
    """The JetStream stream behind a KV bucket (nats.py's naming)."""
    return KV_STREAM_TEMPLATE.format(bucket=bucket)


def obj_stream(bucket: str) -> str:
    """The JetStream stream behind an object bucket (nats.py's naming)."""
    return OBJ_STREAM_TEMPLATE.format(bucket=bucket)


def bucket_streams(names: Names) -> list[str]:
    """The streams behind every KV and object bucket (for replica checks)."""
    return [kv_stream(b) for b in kv_buckets(names)] + [obj_stream(b) for b in object_buckets(names)]


async def ensure_layout(js: JetStreamContext, names: Names, replicas: int = 1,
                        settings: DeploymentSettings | None = None) -> DeploymentSettings:
    """Create what is missing, at ``replicas`` (3 on a NATS cluster: R3 survives a node loss).

    Existing streams and buckets are moved to ``replicas``. The settings (``replicas`` and
    the per-tenant training-queue byte limit) are written to the services bucket and
    returned, so training-queue streams created later get the same replica count.
    """
    settings = settings or DeploymentSettings(replicas=replicas)
    if settings.replicas != replicas:
        raise ValueError(f"settings.replicas: {settings.replicas} differs from replicas={replicas}")
    # Every call rides out "JetStream temporarily unavailable": a cluster that just formed (or
    # lost a node) has no meta leader for a moment, and `nexus up` must not fail on it.
    for cfg in stream_configs(names, replicas):
        try:
            before = (await js_retry(js.stream_info, cfg.name)).config.num_replicas
            await js_retry(js.update_stream, cfg)
            if before != replicas:
                await wait_placed(js, cfg.name, replicas)
        except NotFoundError:
            await js_retry(js.add_stream, cfg)
    for bucket, history in kv_buckets(names).items():
        try:
            await js_retry(js.key_value, bucket)
            await _set_replicas(js, kv_stream(bucket), replicas)
        except BucketNotFoundError:
            await js_retry(js.create_key_value, bucket=bucket, history=history, replicas=replicas)
    for bucket in object_buckets(names):
        try:
            await js_retry(js.object_store, bucket)
            await _set_replicas(js, obj_stream(bucket), replicas)
        except BucketNotFoundError:
            await js_retry(js.create_object_store, bucket=bucket, replicas=replicas)
    kv = await js_retry(js.key_value, names.kv_services)
    await js_retry(kv.put, Names.deployment_settings_key, encode(settings))
    return settings


async def _set_replicas(js: JetStreamContext, stream: str, replicas: int) -> None:
    info = await js.stream_info(stream)
    if info.config.num_replicas != replicas:
        info.config.num_replicas = replicas
        await js.update_stream(info.config)
        await wait_placed(js, stream, replicas)


async def wait_placed(js: JetStreamContext, stream: str, replicas: int) -> None:
    """Until a stream whose replica count changed has a leader and every replica current.

    While JetStream moves a stream to new peers it has no leader for a moment (about a
    second here), and a put sent then is lost to a timeout; the layout waits it out once
    instead of every later writer retrying.
    """
    deadline = time.monotonic() + REPLICA_CHANGE_TIMEOUT_S
    while True:
        info = await js.stream_info(stream)
        peers = (info.cluster.replicas or []) if info.cluster else []
        if (info.cluster is None and replicas == 1) or (
                info.cluster is not None and info.cluster.leader and len(peers) == replicas - 1
                and all(p.current and not p.offline for p in peers)):
            return
        if time.monotonic() > deadline:
            raise Unavailable(
                f"stream {stream} has no leader with {replicas} current replicas "
                f"{REPLICA_CHANGE_TIMEOUT_S:g} s after its replica count changed; is every NATS node up?",
                details={"stream": stream, "replicas": replicas},
            )
        await asyncio.sleep(REPLICA_CHANGE_POLL_S)


async def read_deployment_settings(js: JetStreamContext, names: Names) -> DeploymentSettings:
    """The settings `ensure_layout` recorded; the defaults (R1) where none were recorded
    (a layout made before settings existed)."""
    try:
        kv = await js.key_value(names.kv_services)
        entry = await kv.get(Names.deployment_settings_key)
    except (BucketNotFoundError, KeyNotFoundError):
        return DeploymentSettings()
    if entry.value is None:
        return DeploymentSettings()
    return decode(entry.value, DeploymentSettings)


# -- training-queue streams: one per tenant ------------------------------------------------
def tq_stream_config(names: Names, tenant: str, settings: DeploymentSettings) -> StreamConfig:
    return StreamConfig(
        name=names.tq_stream(tenant),
        subjects=[names.tq_tenant_all(tenant)],
        # WorkQueue: the tenant's partition of the training queue. Data is read by
        # sequence (no consumers) and purged per job subject once trained.
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        num_replicas=settings.replicas,
        # One tenant cannot fill the disk: past max_bytes a put is refused (discard=new);
        # the default discard=old would silently drop the oldest queued micro-batches.
        max_bytes=settings.tq_max_bytes,
        discard=DiscardPolicy.NEW,
        # Nats-Msg-Id dedup makes a retried queue_put harmless for as long as any client
        # retries it.
        duplicate_window=DEDUP_WINDOW_S,
    )


async def ensure_tq_stream(js: JetStreamContext, names: Names, tenant: str,
                           settings: DeploymentSettings) -> StreamConfig:
    """Create the tenant's stream, or update one made with other replicas or limits."""
    want = tq_stream_config(names, tenant, settings)
    try:
        try:
            have = (await js.stream_info(want.name)).config
        except NotFoundError:
            await js.add_stream(want)
            return want
        if (have.num_replicas, have.max_bytes, have.discard, have.duplicate_window) != (
                want.num_replicas, want.max_bytes, want.discard, want.duplicate_window):
            await js.update_stream(want)
            if have.num_replicas != want.num_replicas:
                await wait_placed(js, want.name, want.num_replicas)
    except APIError as exc:
        no_room = exc.err_code in (JS_ERR_INSUFFICIENT_RESOURCES, JS_ERR_STORAGE_RESOURCES) or (
            exc.err_code == JS_ERR_NO_PEERS and "insufficient" in (exc.description or ""))
        if no_room:
            raise FailedPrecondition(
                f"cannot create the training-queue stream of tenant {tenant!r}: JetStream has no "
                f"room to reserve its {settings.tq_max_bytes} byte limit ({exc.description}); "
                f"lower the per-tenant limit (nexus up --tq-max-bytes) or free disk",
                details={"tenant": tenant, "max_bytes": settings.tq_max_bytes},
            ) from None
        raise
    return want


async def publish_tq(js: JetStreamContext, names: Names, tenant: str, subject: str, data: bytes,
                     headers: dict[str, str], settings: DeploymentSettings):
    """Publish one micro-batch to the tenant's stream; a full stream raises `Busy` naming the
    tenant and its limit (with a retry hint), not JetStream's bare 'maximum bytes exceeded'."""
    try:
        # Safe to repeat: the Nats-Msg-Id header makes a second copy a duplicate (the stream's
        # duplicate window), so a publish that timed out during a leader election is sent again.
        return await js_retry(js.publish, subject, data, headers=headers)
    except APIError as exc:
        if exc.err_code != JS_ERR_MAX_BYTES:
            raise
        raise Busy(
            f"the training queue of tenant {tenant!r} is full: its stream "
            f"{names.tq_stream(tenant)} holds its limit of {settings.tq_max_bytes} bytes; "
            f"retry once a trainer clears a job (or raise --tq-max-bytes)",
            details={"tenant": tenant, "max_bytes": settings.tq_max_bytes,
                     "retry_after_s": TQ_FULL_RETRY_AFTER_S},
        ) from None
