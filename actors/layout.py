"""Create the deployment's streams, KV buckets and object buckets, idempotently.

Called by `nexus up` (and by tests) before any role starts; running it twice changes
nothing. Per-tenant training-queue streams are created when a tenant is created, not here.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BucketNotFoundError, NotFoundError

from protocol.subjects import Names

WEEK_S = 7 * 24 * 3600


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
    }


def object_buckets(names: Names) -> list[str]:
    return [names.obj_weights, names.obj_checkpoints]


async def ensure_layout(js: JetStreamContext, names: Names, replicas: int = 1) -> None:
    """Create what is missing. ``replicas`` is 3 on a NATS cluster (R3 survives a node loss)."""
    for cfg in stream_configs(names, replicas):
        try:
            await js.stream_info(cfg.name)
            await js.update_stream(cfg)
        except NotFoundError:
            await js.add_stream(cfg)
    for bucket, history in kv_buckets(names).items():
        try:
            await js.key_value(bucket)
        except BucketNotFoundError:
            await js.create_key_value(bucket=bucket, history=history, replicas=replicas)
    for bucket in object_buckets(names):
        try:
            await js.object_store(bucket)
        except BucketNotFoundError:
            await js.create_object_store(bucket=bucket, replicas=replicas)
