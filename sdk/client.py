"""The tenant-facing SDK: the async client (the sync facade over it is sdk/sync_client.py).

    from sdk import Client
    with Client.from_data_dir(".nexus") as c:      # or Client("nats://127.0.0.1:4222")
        for row in c.status().roles:
            print(row.role, row.state)

`AsyncClient` has the same methods as coroutines. Both speak only NATS: the same calls work
against the embedded cluster and a remote one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from transport.bus import DEFAULT_REQUEST_TIMEOUT_S, Bus, retry
from transport.bus import retry_through_outage  # noqa: F401 - public: loops ride out a master restart with it
from transport.cluster import ClusterState
from protocol import ops
from protocol.ops import Op
from protocol.errors import Busy, InvalidField, NotFound, PayloadTooLarge, QuotaExceeded, RequestTimeout, Unavailable
# CHUNK_HEADROOM_BYTES: queue_put's split; MASTER_OUTAGE: predict's pool lookup.
from protocol.policy import CHUNK_HEADROOM_BYTES, INFERENCE_OUTAGE, MASTER_OUTAGE, RetryPolicy
from protocol.messages import (
    ClusterStatus,
    CreateTenantRequest,
    DatasetBatch,
    SampleRequest,
    EnvCloseRequest,
    EnvCreateRequest,
    EnvObs,
    EnvResetRequest,
    EnvSession,
    EnvStepRequest,
    ExportRequest,
    GetTenantRequest,
    InfoRequest,
    JobRecord,
    JobRef,
    JobsRequest,
    LoadWeightsRequest,
    ListReply,
    ListRequest,
    Ok,
    PredictReply,
    PredictRequest,
    QueueGetReply,
    QueueGetRequest,
    QueuePutReply,
    QueuePutRequest,
    ReserveRequest,
    RoleInfo,
    StatusRequest,
    SubmitRequest,
    TenantConfig,
    TenantDeleted,
    TenantDeleteRequest,
    TenantResetRequest,
    TenantShow,
    TenantQuotas,
    TenantQuotasRequest,
    TenantsReply,
    UsageReply,
    UsageRequest,
    TrainBatchReply,
    WeightsRef,
    WorkloadEvent,
    WorkloadRecord,
    WorkloadRef,
    WorkloadsReply,
    WorkloadsRequest,
    MAX_ITEM_SEQ,
)
from protocol.subjects import DEFAULT_PREFIX, Names, check_token, pool_name
from sdk.progress import format_progress
from sdk.queue_chunks import split_item

# JetStream API error codes of an account past its storage limits: a publish past them
# (10002 "resource limits exceeded for account"), a stream reserving more than is left
# (10047 storage, 10028 memory: a tenant account has none).
STORAGE_LIMIT_ERRORS = (10002, 10047, 10028)


@dataclass(frozen=True)
class PredictFailover:
    """How `predict` rides out an inferencer restart, a drain and back-pressure.

    (To fold into protocol/policy.py.) Every attempt of one call carries the same request id,
    so a retry that reaches an instance still working on the request joins it, and one that
    reaches an instance that answered it gets that reply again: a retry never costs a second
    forward on that instance, which is what makes a short attempt timeout safe."""

    policy: RetryPolicy = INFERENCE_OUTAGE
    # One attempt's wait. A request lost with a killed instance is re-sent after this rather
    # than after the caller's whole timeout; 10 s covers a cold tenant-slot load on a busy
    # 2-core machine, and a retry of a request still being worked just joins it.
    attempt_timeout_s: float = 10.0
    # No responder (restarting), lost reply (killed mid-request), draining, back-pressure.
    retry_on: tuple[type[BaseException], ...] = (Unavailable, RequestTimeout, Busy)


PREDICT_FAILOVER = PredictFailover()


def resolve_cluster(data_dir: str | Path | None, nats_url: str | None, prefix: str | None) -> tuple[str, str]:
    """Find (nats_url, prefix): an explicit URL wins, else ``<data_dir>/cluster.json``."""
    if nats_url:
        return nats_url, prefix or DEFAULT_PREFIX
    data_dir = Path(data_dir or ".nexus")
    state = ClusterState.read(data_dir)
    if state is None:
        raise Unavailable(
            f"no cluster found in {data_dir} ({data_dir / 'cluster.json'} is missing): "
            "start one with `nexus up`, or pass --nats-url / --data-dir"
        )
    return state.nats_url, prefix or state.prefix


class AsyncClient:
    """``creds``: a credentials file (a tenant's from `nexus tenant create`, or the admin's);
    default ``NEXUS_CREDS``, else the file the URL names (cluster.json's names the admin's)."""

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX,
                 timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, creds: str | Path | None = None,
                 tracer: Any = None) -> None:
        """``tracer``: an OpenTelemetry tracer for this client's CLIENT / PRODUCER spans
        (default: the global provider's; with none set, no spans and no trace context)."""
        from transport.creds import creds_from_env

        self.url = url
        self.names = Names(prefix)
        self.timeout_s = timeout_s
        self.creds = Path(creds) if creds else creds_from_env()
        self.tracer = tracer
        self._bus: Bus | None = None
        self._pools: dict[str, str] = {}

    async def connect(self) -> AsyncClient:
        if self._bus is None:
            self._bus = await Bus.connect(self.url, name="sdk", reconnect_forever=False, creds=self.creds,
                                          tracer=self.tracer, prefix=self.names.prefix)
        return self

    async def close(self) -> None:
        if self._bus is not None:
            await self._bus.close()
            self._bus = None

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise Unavailable("client is not connected: use `async with AsyncClient(...)` or await connect()")
        return self._bus

    async def status(self, include_dead: bool = True) -> ClusterStatus:
        return await self.bus.call(ops.MONITOR_STATUS, StatusRequest(include_dead=include_dead),
                                   timeout_s=self.timeout_s)

    async def info(self, role: str, instance: str | None = None) -> RoleInfo:
        return await self.bus.call(ops.INFO.of(role), InfoRequest(), instance=instance, timeout_s=self.timeout_s)

    async def list(self) -> ListReply:
        """Tenant names and every workload id (the master's pages, followed)."""
        pages = await self._all_pages(ops.MASTER_LIST, ListRequest())
        return ListReply(tenants=pages[0].tenants, workloads=[w for p in pages for w in p.workloads])

    # -- low-level training-queue primitives (compose your own algorithm) ---------------
    async def _call(self, op: Op, msg: Any) -> Any:
        return await self.bus.call(op, msg, timeout_s=self.timeout_s)

    async def _all_pages(self, op: Op, req: Any) -> list[Any]:
        """Every page of a list op (master/paging.py): each reply is bounded (records, bytes)
        and names the next page's cursor until the last. A failed page raises: a caller never
        gets part of a list as if it were all of it."""
        pages: list[Any] = []
        while True:
            reply = await self._call(op, req)
            pages.append(reply)
            cursor = getattr(reply, "next_cursor", "")
            if not cursor or cursor == req.cursor:
                return pages
            req = msgspec.structs.replace(req, cursor=cursor)

    async def create_tenant(self, config: TenantConfig, exist_ok: bool = False) -> TenantConfig:
        return await self._call(ops.MASTER_TENANT_CREATE, CreateTenantRequest(config=config, exist_ok=exist_ok))

    async def tenant(self, name: str) -> TenantConfig:
        return await self._call(ops.MASTER_TENANT_GET, GetTenantRequest(tenant=name))

    async def set_quotas(self, tenant: str, quotas: TenantQuotas | None) -> TenantConfig:
        """Set a tenant's quotas (None: the deployment's defaults); an operator op."""
        return await self._call(ops.MASTER_TENANT_QUOTAS, TenantQuotasRequest(tenant=tenant, quotas=quotas))

    async def update_quotas(self, tenant: str, **changes: Any) -> TenantConfig:
        """Change some of a tenant's quotas (`TenantQuotas` fields), the others kept as they
        are (or the deployment's defaults); an operator op."""
        return await self._call(ops.MASTER_TENANT_QUOTAS, TenantQuotasRequest(tenant=tenant, changes=changes))

    async def usage(self, tenant: str = "", workload: str = "") -> UsageReply:
        """Metered usage per (tenant, workload): device-seconds, rows, requests, bytes."""
        pages = await self._all_pages(ops.MASTER_USAGE, UsageRequest(tenant=tenant, workload=workload))
        return UsageReply(records=[r for p in pages for r in p.records],
                          stored_now={t: n for p in pages for t, n in p.stored_now.items()})

    async def reserve(self, tenant: str, task: str, *, auto: bool = True, wait_s: float = 0.0,
                      priority: int | None = None, key: str = "", workload: str = "") -> JobRecord:
        """A new job id. With ``wait_s`` > 0, waits out back-pressure (busy) up to that long.

        ``key``: an idempotency key; calling again with the same key (a retry after a timeout)
        returns the job the first call made."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return await self._call(ops.MASTER_RESERVE, ReserveRequest(tenant=tenant, task=task, auto=auto,
                                                                           priority=priority, key=key,
                                                                           workload=workload))
            except Busy as exc:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(float(exc.details.get("retry_after_s", 0.5)))

    async def queue_put(self, item: QueuePutRequest) -> QueuePutReply:
        """Append one micro-batch; one over the server's max payload is split along the batch
        into parts, each its own item. A part's seq is `protocol.messages.chunk_seq` (seq,
        log2 parts, index): never an ordinary seq (0..MAX_ITEM_SEQ) nor another part's, so a
        retried put (whole or split) is recognised as a duplicate and nothing else is."""
        if not 0 <= item.seq <= MAX_ITEM_SEQ:
            raise InvalidField("seq", f"{item.seq}: an item's seq must be in 0..{MAX_ITEM_SEQ} "
                                      "(larger seqs are reserved for the parts of a split item)")
        try:
            return await self._call(ops.MASTER_QUEUE_PUT, item)
        except PayloadTooLarge:
            if len(item.instructions) < 2:
                raise
        # Nothing of the item was stored (the size check refuses before any publish). The
        # split is decided here, from the encoded sizes, before any part is sent: the layout
        # is a function of the item and the max payload alone, so a retry of this call sends
        # the very same parts under the very same seqs.
        chunks = split_item(item, self.bus.max_payload - CHUNK_HEADROOM_BYTES)
        reply = None
        for chunk in chunks:
            reply = await self._call(ops.MASTER_QUEUE_PUT, chunk)
        assert reply is not None
        return reply

    async def mark_ready(self, tenant: str, job: str) -> JobRecord:
        return await self._call(ops.MASTER_MARK_READY, JobRef(tenant=tenant, job=job))

    async def job(self, tenant: str, job: str) -> JobRecord:
        return await self._call(ops.MASTER_JOB, JobRef(tenant=tenant, job=job))

    async def jobs(self, tenant: str = "", states: list[str] | None = None) -> list[JobRecord]:
        pages = await self._all_pages(ops.MASTER_JOBS, JobsRequest(tenant=tenant, states=states or []))
        return [j for p in pages for j in p.jobs]

    async def queue_get(self, tenant: str, job: str, start: int = 0, max_items: int = 1) -> QueueGetReply:
        return await self._call(ops.MASTER_QUEUE_GET, QueueGetRequest(tenant=tenant, job=job, start=start,
                                                                      max_items=max_items))

    async def queue_clear(self, tenant: str, job: str) -> JobRecord:
        return await self._call(ops.MASTER_QUEUE_CLEAR, JobRef(tenant=tenant, job=job))

    async def train_batch(self, tenant: str, job: str, timeout_s: float = 600.0) -> TrainBatchReply:
        return await self.bus.call(ops.TRAINER_TRAIN_BATCH, JobRef(tenant=tenant, job=job), timeout_s=timeout_s)

    async def export_params(self, tenant: str, timeout_s: float = 120.0) -> WeightsRef:
        return await self.bus.call(ops.TRAINER_EXPORT_PARAMS, ExportRequest(tenant=tenant), timeout_s=timeout_s)

    async def load_weights(self, tenant: str, object_name: str, timeout_s: float = 120.0) -> Ok:
        return await self.bus.call(ops.TRAINER_LOAD_WEIGHTS, LoadWeightsRequest(tenant=tenant, object_name=object_name),
                                   timeout_s=timeout_s)

    async def wait_job(self, tenant: str, job: str, states: tuple[str, ...] = ("cleared", "failed", "dropped_stale"),
                       timeout_s: float = 300.0) -> JobRecord:
        """Poll a job until it reaches one of ``states``; RequestTimeout after ``timeout_s``."""
        from protocol.errors import RequestTimeout

        deadline = time.monotonic() + timeout_s
        while True:
            rec = await self.job(tenant, job)
            if rec.state in states:
                return rec
            if time.monotonic() > deadline:
                raise RequestTimeout(f"job {job} of {tenant} still {rec.state} after {timeout_s:g} s")
            await asyncio.sleep(0.1)

    # -- workflow primitives (what workflows/ builds its workflow loops on) ----------------
    async def rollout_begin(self, tenant: str, workload: str, timeout_s: float | None = None) -> Ok:
        """Take a turn at the master's rollout gate (1 active rollout per tenant, 3 in all):
        Busy, with ``retry_after_s``, while the gate is full. Safe to repeat."""
        return await self.bus.call(ops.MASTER_ROLLOUT_BEGIN, JobRef(tenant=tenant, job=workload),
                                   timeout_s=self.timeout_s if timeout_s is None else timeout_s)

    async def rollout_end(self, tenant: str, workload: str, timeout_s: float | None = None) -> Ok:
        """Give the rollout gate's turn back (a turn not held is a no-op)."""
        return await self.bus.call(ops.MASTER_ROLLOUT_END, JobRef(tenant=tenant, job=workload),
                                   timeout_s=self.timeout_s if timeout_s is None else timeout_s)

    async def publish_event(self, event: WorkloadEvent) -> None:
        """Publish a workload's lifecycle event (progress, done) on its events subject; the
        master folds them into the workload record (a ``done`` ends it)."""
        await self.bus.publish(self.names.workload_events(event.workload), event)

    # -- inference -----------------------------------------------------------------------
    async def predict(self, tenant: str, images: dict[str, Any], state: Any, instruction: str, *,
                      version: int = -1, sample: bool = True, timeout_s: float | None = None,
                      request_id: str = "", failover: PredictFailover = PREDICT_FAILOVER,
                      workload: str = "") -> PredictReply:
        """Actions for one observation in the tenant's own schema (group-batched server side).

        Fails over within ``timeout_s`` (the whole call's deadline): no instance (restarting),
        a lost reply (an instance killed), Draining and Busy are retried on whichever instance
        of the pool the queue group picks, every attempt with the same request id (generated
        here unless given), so the request is worked once per instance. ``workload``: the
        workload the call is metered to (default: the tenant's active workload)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        budget = timeout_s  # what the predict may take: the caller's timeout less the lookup's time
        pool = self._pools.get(tenant)
        if pool is None:
            # The first call of a tenant reads its base from the master: a master restarting
            # then (seconds) is ridden out like an inferencer's, within the caller's deadline
            # (an eval workload's first episode failed on a master killed under it).
            started = time.monotonic()
            lookup = MASTER_OUTAGE
            if timeout_s > 0 and timeout_s < lookup.deadline_s:
                lookup = dataclasses.replace(lookup, deadline_s=timeout_s)
            pool = pool_name((await retry(self.tenant, tenant, policy=lookup)).base)
            self._pools[tenant] = pool
            budget = timeout_s - (time.monotonic() - started)
        request_id = request_id or uuid.uuid4().hex
        # The caller's deadline wins over the policy's when it is shorter.
        policy = failover.policy
        if timeout_s > 0 and (policy.deadline_s == 0 or budget < policy.deadline_s):
            policy = dataclasses.replace(policy, deadline_s=max(budget, 1e-3))  # 0 would mean none
        deadline = time.monotonic() + budget
        subject = self.names.infer(pool)
        sent = 0

        async def attempt() -> PredictReply:
            nonlocal sent
            # The first attempt always goes out with the whole budget (capped): the server drops
            # it unworked if it waited longer than that (a caller that gave up is not worked for).
            left = budget if not sent else deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout(f"predict for {tenant!r} found no answer within {timeout_s:g} s",
                                     details={"subject": subject, "timeout_s": timeout_s})
            sent += 1
            t = min(left, failover.attempt_timeout_s)
            req = PredictRequest(tenant=tenant, images=images, state=state, instruction=instruction,
                                 version=version, sample=sample, timeout_s=t, request_id=request_id,
                                 workload=workload)
            return await self.bus.request(subject, req, PredictReply, timeout_s=t)

        return await retry(attempt, policy=policy, retry_on=failover.retry_on)

    # -- workloads ---------------------------------------------------------------------------
    async def submit(self, spec: dict[str, Any] | str | bytes | Path) -> AsyncWorkload:
        """Submit a workload spec (a dict, YAML/JSON text or bytes, or a file path)."""
        if isinstance(spec, Path) or (isinstance(spec, str) and "\n" not in spec and spec.endswith((".yaml", ".yml", ".json"))):
            spec = Path(spec).read_text()
        req = SubmitRequest(spec=spec) if isinstance(spec, dict) else SubmitRequest(
            spec_text=spec.decode() if isinstance(spec, bytes) else spec)
        rec = await self._call(ops.MASTER_SUBMIT, req)
        return AsyncWorkload(self, rec.workload, rec.tenant)

    def workload_handle(self, workload: str, tenant: str = "") -> AsyncWorkload:
        return AsyncWorkload(self, workload, tenant)

    async def workload(self, workload: str) -> WorkloadRecord:
        return await self._call(ops.MASTER_WORKLOAD, WorkloadRef(workload=workload))

    async def workloads(self, tenant: str = "") -> list[WorkloadRecord]:
        """Every workload record (of ``tenant``), oldest first: the master's pages, followed."""
        pages = await self._all_pages(ops.MASTER_WORKLOADS, WorkloadsRequest(tenant=tenant))
        return [w for p in pages for w in p.workloads]

    async def workloads_page(self, tenant: str = "", limit: int = 0, cursor: str = "") -> WorkloadsReply:
        """One page of workload records; its ``next_cursor`` ("" after the last) asks for the next."""
        return await self._call(ops.MASTER_WORKLOADS, WorkloadsRequest(tenant=tenant, limit=limit, cursor=cursor))

    async def tenants(self) -> TenantsReply:
        """Every tenant, its version and workload history: the master's pages, followed."""
        pages = await self._all_pages(ops.MASTER_TENANTS, WorkloadsRequest())
        return TenantsReply(tenants=[t for p in pages for t in p.tenants],
                            versions={t: v for p in pages for t, v in p.versions.items()},
                            history={t: h for p in pages for t, h in p.history.items()})

    async def add_base(self, name: str, path: str) -> Any:
        """Register the base directory ``path`` (on the master's host) as ``name``; tenants then
        name it ``registered:<name>`` in a spec's base (an operator op)."""
        from protocol.messages import BaseAddRequest

        return await self._call(ops.MASTER_BASE_ADD, BaseAddRequest(name=name, path=path))

    async def bases(self) -> Any:
        """`BasesReply`: the presets and registered names a spec's base may name (paths: the
        platform's callers only)."""
        from protocol.messages import BasesRequest

        return await self._call(ops.MASTER_BASES, BasesRequest())

    async def delete_tenant(self, tenant: str, wait_s: float = 60.0) -> TenantDeleted:
        """Remove a tenant (slot, queue stream, versions, checkpoints, records); refused while
        one of its workloads is pending or running. Waits up to ``wait_s`` for trainers to let
        go of its jobs (busy)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return await self._call(ops.MASTER_TENANT_DELETE, TenantDeleteRequest(tenant=tenant))
            except Busy as exc:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(float(exc.details.get("retry_after_s", 1.0)))

    async def tenant_show(self, tenant: str = "") -> TenantShow:
        """One tenant: config (schema, head, base; None when it has no slot), newest version,
        quotas in force, workload ids. A tenant sees itself (``""``: the caller's own)."""
        return await self._call(ops.MASTER_TENANT_SHOW, GetTenantRequest(tenant=tenant))

    async def reset_tenant(self, tenant: str = "", wait_s: float = 60.0) -> TenantDeleted:
        """Drop a tenant's slot (config, versions, checkpoints, jobs, queue) so its next submit
        registers a new schema; its account, workload records and usage stay. A tenant resets
        itself (``""``: the caller's own); refused while one of its workloads runs. Waits up to
        ``wait_s`` for trainers to let go of its jobs (busy)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return await self._call(ops.MASTER_TENANT_RESET, TenantResetRequest(tenant=tenant))
            except Busy as exc:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(float(exc.details.get("retry_after_s", 1.0)))

    async def cancel(self, workload: str) -> WorkloadRecord:
        return await self._call(ops.MASTER_CANCEL, WorkloadRef(workload=workload))

    async def download_report(self, workload: str, out_dir: str | Path = ".") -> Path:
        """Write a finished workload's report (the master's copy at its outputs.report_path)
        to ``<out_dir>/<workload>.report.json``; return the path."""
        import json


        rep = await self._call(ops.MASTER_WORKLOAD_REPORT, WorkloadRef(workload=workload))
        out = Path(out_dir) / f"{workload}.report.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rep.report, indent=2, sort_keys=True))
        return out

    async def put_own_object(self, bucket: str, name: str, data: bytes) -> int:
        """Store ``data`` in an object bucket of the caller's own account (made on first
        use): a tenant's private store, which no other account reaches, bounded by its
        account's JetStream storage quota (`nexus tenant create --storage-mb`). Returns the
        size stored. Past the quota: `QuotaExceeded` naming ``storage_bytes`` and its value
        (nothing of the refused object stays)."""
        import nats.js.errors
        from nats.js.api import ObjectStoreConfig, StorageType

        js = self.bus.js
        try:
            try:
                store = await js.object_store(check_token("bucket", bucket))
            except nats.js.errors.BucketNotFoundError:
                store = await js.create_object_store(bucket, config=ObjectStoreConfig(storage=StorageType.FILE))
            return (await store.put(name, data)).size
        except nats.js.errors.APIError as exc:
            if exc.err_code not in STORAGE_LIMIT_ERRORS:
                raise
            info = await js.account_info()
            limit = info.limits.max_storage
            # Not QuotaExceeded.of: its %g would print 1048576 as 1.04858e+06.
            raise QuotaExceeded(
                f"quota storage_bytes={limit} exceeded: {len(data)} more bytes in bucket {bucket!r} would pass "
                f"this account's JetStream storage ({info.storage} bytes in use; the server: {exc.description})",
                details={"quota": "storage_bytes", "limit": limit, "retry_after_s": 0.0, "used": info.storage,
                         "bucket": bucket}) from None

    async def get_own_object(self, bucket: str, name: str) -> bytes:
        """An object of the caller's own account (`put_own_object`)."""
        store = await self.bus.js.object_store(check_token("bucket", bucket))
        return (await store.get(name)).data or b""

    @property
    def is_tenant(self) -> bool:
        """Logged in with a tenant's credentials (its account has no JetStream)."""
        from transport.creds import Credentials, url_creds

        creds = self.creds or url_creds(self.url)
        return creds is not None and Credentials.read(creds).tenant is not None

    async def _read_object(self, tenant: str, version: int, manifest: bool) -> tuple[int, bytes]:
        """(version, bytes) of a tenant's export through the master, slice by slice."""
        from protocol.messages import WeightsReadRequest

        out, offset, total, v = bytearray(), 0, None, version
        while total is None or offset < total:
            chunk = await self._call(ops.MASTER_WEIGHTS_READ, WeightsReadRequest(
                       tenant=tenant, version=v, manifest=manifest, offset=offset))
            v, total = chunk.version, chunk.total
            out += chunk.data
            offset += len(chunk.data)
            if not chunk.data and offset < total:
                raise Unavailable(f"download of {chunk.object_name} stopped at {offset} of {total} bytes")
        return v, bytes(out)

    async def upload_weights(self, name: str, path: str | Path, tenant: str | None = None) -> str:
        """Upload a safetensors file as starting weights ``name`` in the tenant's own area (a
        spec's ``init: {weights: NAME}``; master/uploads.py), in slices of `UPLOAD_SLICE_BYTES`.
        ``tenant``: the caller's own by default (a tenant's login); the admin names one. Returns
        the master's summary (tensors, bytes)."""
        from protocol.messages import WeightsUploadRequest
        from protocol.policy import MAX_UPLOAD_BYTES, UPLOAD_SLICE_BYTES

        check_token("name", name)
        if tenant is None:
            from transport.creds import Credentials, url_creds

            creds = self.creds or url_creds(self.url)
            tenant = Credentials.read(creds).tenant if creds is not None else None
            if tenant is None:
                raise InvalidField("tenant", "the admin uploads for a named tenant: pass tenant=")
        size = Path(path).stat().st_size
        if size > MAX_UPLOAD_BYTES:
            raise InvalidField("file", f"{path} is {size} bytes, past the largest upload of {MAX_UPLOAD_BYTES} bytes")
        detail = ""
        with open(path, "rb") as f:
            offset = 0
            while True:
                data = f.read(UPLOAD_SLICE_BYTES)
                final = offset + len(data) >= size
                reply = await self._call(ops.MASTER_WEIGHTS_UPLOAD, WeightsUploadRequest(
                           tenant=tenant, name=name, offset=offset, data=data, final=final))
                offset += len(data)
                detail = reply.detail
                if final:
                    return detail

    async def download_policy(self, tenant: str, version: int | None = None, out_dir: str | Path = ".") -> tuple[Path, Path]:
        """Write ``<tenant>-v<version>.safetensors`` and its manifest JSON; return both paths.
        A LoRA tenant's export also becomes ``<tenant>-v<version>.peft/`` (adapter_config.json +
        adapter_model.safetensors), which `PeftModel.from_pretrained` loads on the same base.
        A tenant's client downloads through the master (`weights_read`); the admin's reads
        the object store."""
        if self.is_tenant:
            v, payload = await self._read_object(tenant, -1 if version is None else version, False)
            _, mbytes = await self._read_object(tenant, v, True)
            return _write_policy(Path(out_dir), tenant, v, payload, json.loads(mbytes))
        if version is None:
            ref = await self.latest_weights(tenant)
            if ref is None:
                raise NotFound(f"tenant {tenant!r} has no exported version yet")
        else:
            from transport.weights import weights_name

            ref = WeightsRef(tenant=tenant, version=version, object_name=weights_name(tenant, version), size=0,
                             manifest={})
        try:
            payload, manifest = await self.download_weights(ref)
        except Exception as exc:
            from nats.js.errors import ObjectNotFoundError

            if isinstance(exc, ObjectNotFoundError):
                raise NotFound(f"tenant {tenant!r} has no version {ref.version}") from None
            raise
        return _write_policy(Path(out_dir), tenant, ref.version, payload, manifest)

    # -- environment service --------------------------------------------------------------
    async def env_create(self, env_id: str, lease_s: float = 30.0, **options: Any) -> EnvSession:
        return await self.bus.call(ops.ENV_CREATE, EnvCreateRequest(env_id=env_id, options=options,
                                                                    lease_s=lease_s), timeout_s=self.timeout_s)

    async def env_reset(self, session: EnvSession, seed: int | None = None, task: str | None = None) -> EnvObs:
        return await self.bus.call(ops.ENV_RESET, EnvResetRequest(session=session.session, seed=seed, task=task),
                                   instance=session.worker, timeout_s=self.timeout_s)

    async def env_step(self, session: EnvSession, action: Any) -> EnvObs:
        return await self.bus.call(ops.ENV_STEP, EnvStepRequest(session=session.session, action=action),
                                   instance=session.worker, timeout_s=self.timeout_s)

    async def env_close(self, session: EnvSession) -> Ok:
        return await self.bus.call(ops.ENV_CLOSE, EnvCloseRequest(session=session.session), instance=session.worker,
                                   timeout_s=self.timeout_s)

    async def sample(self, root: str, n: int = 16, seed: int | None = None,
                     indices: list[int] | None = None) -> DatasetBatch:
        """Frames of a LeRobot v3.0 dataset read by an env worker (the path is on its host)."""
        return await self.bus.call(ops.ENV_SAMPLE, SampleRequest(root=str(root), n=n, seed=seed,
                                                                 indices=list(indices or [])), timeout_s=self.timeout_s)

    async def latest_weights(self, tenant: str) -> WeightsRef | None:
        from nats.js.errors import KeyNotFoundError

        from protocol.wire import decode

        from transport.bus import js_retry

        kv = await js_retry(self.bus.js.key_value, self.names.kv_versions)
        try:
            return decode((await js_retry(kv.get, tenant)).value, WeightsRef)
        except KeyNotFoundError:
            return None

    async def download_weights(self, ref: WeightsRef) -> tuple[bytes, dict[str, Any]]:
        """(safetensors payload, manifest) of an export."""
        store = await self.bus.js.object_store(self.names.obj_weights)
        buf = io.BytesIO()
        await store.get(ref.object_name, writeinto=buf)
        mbuf = io.BytesIO()
        await store.get(ref.object_name + ".manifest.json", writeinto=mbuf)
        return buf.getvalue(), json.loads(mbuf.getvalue())


def _write_peft_dir(path: Path, config: dict[str, Any], payload: bytes) -> None:
    """peft's two files from an export: the adapter's tensors (peft's names) and its config."""
    from safetensors.numpy import load, save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v for k, v in load(payload).items() if k.startswith("base_model.model.")}
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def _write_policy(out: Path, tenant: str, version: int, payload: bytes, manifest: dict[str, Any]) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    weights = out / f"{tenant}-v{version}.safetensors"
    meta = out / f"{tenant}-v{version}.manifest.json"
    weights.write_bytes(payload)
    meta.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    if manifest.get("peft_config"):
        _write_peft_dir(out / f"{tenant}-v{version}.peft", manifest["peft_config"], payload)
    return weights, meta


class AsyncWorkload:
    """A submitted workload: status, progress, cancel, download."""

    def __init__(self, client: AsyncClient, workload: str, tenant: str = "") -> None:
        self.client, self.id, self.tenant = client, workload, tenant

    def __repr__(self) -> str:
        return f"Workload({self.id!r}, tenant={self.tenant!r})"

    async def status(self) -> WorkloadRecord:
        return await self.client.workload(self.id)

    async def metrics(self) -> dict[str, float]:
        return dict((await self.status()).metrics)

    async def cancel(self) -> WorkloadRecord:
        return await self.client.cancel(self.id)

    async def download_policy(self, version: int | None = None, out_dir: str | Path = ".") -> tuple[Path, Path]:
        return await self.client.download_policy(self.tenant or (await self.status()).tenant, version, out_dir)

    async def wait(self, progress: bool = False, timeout_s: float = 3600.0, poll_s: float = 1.0,
                   out: Any = None) -> WorkloadRecord:
        """Until completed / failed / cancelled; with ``progress``, one updating line per change."""
        import sys

        from protocol.errors import RequestTimeout
        from protocol.messages import TERMINAL_WORKLOAD_STATES

        out = out or sys.stderr
        deadline = time.monotonic() + timeout_s
        last = ""
        while True:
            rec = await self.status()
            if progress:
                line = format_progress(rec)
                if line != last:
                    print(line, file=out, flush=True)
                    last = line
            if rec.state in TERMINAL_WORKLOAD_STATES:
                return rec
            if time.monotonic() > deadline:
                raise RequestTimeout(f"workload {self.id} still {rec.state} after {timeout_s:g} s")
            await asyncio.sleep(poll_s)

