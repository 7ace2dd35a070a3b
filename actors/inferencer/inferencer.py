"""Inferencer (Inference Model Service): cross-tenant group batching over request-reply.

Serves ``<prefix>.infer.<pool>`` in queue group ``<prefix>-infer-<pool>`` (pool =
`protocol.subjects.pool_name` of the base it hosts: two bases never share one). Requests wait in one queue per compatibility key; a group fires when it holds
``max_batch_size`` requests or its oldest has waited ``batch_wait_timeout_s`` (Ray Serve's
names; Triton calls them preferred_batch_size and max_queue_delay_microseconds). Then, in
order:
  1. requests whose caller's timeout has passed are dropped unworked;
  2. each slot's requests are canonicalised together (a bad one gets its own error reply,
     the others go on); on CUDA on a side stream, so group N+1's copies overlap forward N;
  3. one base forward for the whole group;
  4. each (tenant, version) head runs on its rows;
  5. replies carry the actions (+ log-prob and value for RL heads), the version used and the
     server-side queue wait and forward time.

Incompatible requests never share a forward: different keys are different queues. Weight
sync: ``<prefix>.weights.<tenant>`` announcements load the new version and swap it in; a new
inferencer loads every live tenant's current version before it joins the queue group; a
draining one leaves the group first, answers what it already holds, and answers `Draining`
to what reaches it after (the caller retries on another instance).

Bounded work and failover: a request is refused with `Busy` (``details.retry_after_s``) at
once when the instance already holds ``max_queued`` requests or its key's queue holds
``max_queue_per_key``, and with `QuotaExceeded` (a `Busy`) when its tenant already has
``max_queued_per_tenant`` held here; nothing is queued past those bounds. A request carrying a
``request_id`` is worked once per instance: a retry of one still in flight joins it (both
callers get the one reply), and a retry of one already answered gets the same reply again
from a bounded cache (``reply_cache_size`` entries for ``reply_cache_ttl_s``).

Run: ``python -m actors.run inferencer`` with the NEXUS_INFER_* variables of
`protocol.settings.InferencerSettings` (NEXUS_INFER_BASE, default tiny-qwen3-vl-64; the
batching, queue and reply-cache bounds; see the README's table).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from collections import Counter
from typing import Any


from actors.metering import Meter, final_flush, flush_loop
from actors.inferencer.ratelimit import TenantBuckets
from actors.inferencer.reply_cache import ReplyCache
from actors.identity import caller_from_headers, require_tenant
from actors.runtime import Role, RoleConfig, device_memory_bytes
from actors.budget import budget_bytes
from actors.inferencer.serving import ServingHeads
from actors.tracing import (
    carrier_of,
    consumer_span,
    extract,
    is_sampled,
    messaging,
    nexus_attrs,
    now_ns,
    record_span,
)
from protocol.errors import Busy, Draining, InternalError, NexusError, QuotaExceeded
from protocol.messages import ErrorReply, PredictReply, PredictRequest, WeightsRef, is_slot_reset
from protocol.settings import BaseImageSettings, InferencerSettings, default_quotas, usage_flush_from_env
from protocol.subjects import check_token, pool_name
from protocol.wire import decode, encode

from opentelemetry.trace import SpanKind, Status, StatusCode


from actors.inferencer.batching import KeyQueue, Pending, fast_engine_for
from actors.inferencer.config import InferencerConfig
from actors.inferencer.forward import Forwarding


class Inferencer(Forwarding, Role):
    name = "inferencer"

    def __init__(self, cfg: RoleConfig, icfg: InferencerConfig | None = None, base_source: str | None = None) -> None:
        super().__init__(cfg)
        self.icfg = icfg or InferencerConfig.from_env()
        # The embedded default serves the built-in task's base; one inferencer serves one pool.
        env = InferencerSettings.from_env()
        self.base_source = base_source or env.base
        self.pool = pool_name(self.base_source)
        self.device = env.device
        # The optimized Qwen3-VL encode with CUDA graphs (models.fast); groups are then padded
        # up to a few capture sizes, as vLLM does, so a handful of graphs cover every size.
        # None = auto (resolved in `setup`, once the device is known): on CUDA with a Qwen3-VL
        # base the fast engine with compiled blocks and a warm-up, as vLLM serves by default.
        self.fast: bool | None = env.fast
        self.compile: bool | None = env.compile  # with fast on CUDA: compiled blocks (models.fast)
        self.warmup: bool | None = env.warmup
        self.euler: str | None = env.euler  # action experts' Euler loop (models.heads.expert.EulerOptions)
        self.image_size = BaseImageSettings.from_env().image_size  # None: the base's own
        # (layout, adapter-pool generation or None, prefix-KV outputs, head-pool generation or
        # None): the graph variants whose every capture size up to the largest group has run
        # once (`_warm`).
        self._warmed: set[tuple[Any, int | None, bool, int | None]] = set()
        self.warmup_s = 0.0  # seconds spent warming (not charged to any tenant)
        self.pipeline_depth = env.pipeline_depth
        self.head_budget_mb = env.head_budget_mb  # 0: no budget (actors/inferencer/serving.py)
        self.heads: ServingHeads | None = None
        # One thread owns the device: forwards run in order, never two at once.
        self._forward_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self.queues: dict[Any, KeyQueue] = {}
        self._arrival = asyncio.Event()
        self.served = 0
        self.busy_s = 0.0  # seconds in forwards (the device's busy time)
        self.batch_wait_s = 0.0  # summed over served requests: arrival to their group's start
        self.groups = 0
        self.heads_in_forward = 0  # groups whose heads ran inside the base's forward (models.heads.pool)
        self.dropped = 0
        # Bounded work and dedup (see the module docstring).
        self.held = 0  # requests admitted and not yet answered
        self.held_by_tenant: Counter[str] = Counter()  # the same, per tenant (no zero entries)
        self.tenant_refused = 0  # requests refused past max_queued_per_tenant
        self.busy = 0  # requests refused Busy
        self.replayed = 0  # retries answered from the reply cache
        self.joined = 0  # retries that joined their request in flight
        self.draining_refused = 0
        self.replies = ReplyCache(self.icfg.reply_cache_size, self.icfg.reply_cache_ttl_s)
        self._by_id: dict[tuple[str, str], Pending] = {}
        self._forward_ewma_s = 0.0  # recent group forward time: the Busy hint's unit
        self._predict_sub: Any = None
        # Weight announcements: the newest waiting per tenant, and its loading task (`_on_weights`).
        self._weights_waiting: dict[str, tuple[WeightsRef, str, Any]] = {}
        self._weights_tasks: dict[str, asyncio.Task] = {}
        # Forwarded requests per group -> groups: benchmarks replay this distribution in-process.
        self.group_sizes: Counter[int] = Counter()
        # Metered device time (every group forward, charged to its tenants by rows) and the
        # predict rate quota (a token bucket per tenant, on this instance).
        self.usage_flush = usage_flush_from_env()
        self.meter = Meter({"train": self.usage_flush.train_overhead_rows,
                            "infer": self.usage_flush.infer_overhead_rows})
        self.default_quotas = default_quotas()
        self.rate = TenantBuckets()

    async def setup(self) -> None:
        assert self.bus is not None
        import torch

        from models import BaseConfig, BaseModel

        torch.set_num_threads(1)
        cuda = (self.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        if self.fast is None:
            self.fast = cuda and fast_engine_for(self.base_source)
        if self.compile is None:
            self.compile = self.fast and cuda
        if self.warmup is None:
            self.warmup = self.fast
        if self.euler is None:
            self.euler = ("compile+tf32" if self.fast and self.compile else "tf32") if cuda else "fp32"
        from models.heads.expert import EulerOptions, set_euler_options

        set_euler_options(EulerOptions.parse(self.euler))
        base = await asyncio.to_thread(BaseModel.load, BaseConfig(source=self.base_source, device=self.device,
                                                                  fast=self.fast, compile=self.fast and self.compile,
                                                                  image_size=self.image_size))
        self.heads = ServingHeads(self.bus, self.names, base, self.base_source,
                                  budget_bytes=budget_bytes(self.head_budget_mb), log=self.log)
        await self.bus.nc.subscribe(self.names.weights_all, cb=self._on_weights)
        await self.bus.nc.subscribe(self.names.tenant_deleted_all, cb=self._on_tenant_deleted)
        await self.bus.nc.subscribe(self.names.tenant_updated_all, cb=self._on_tenant_updated)
        # Elastic join: every live tenant's weights first, then take requests.
        synced = await self.heads.sync_all()
        for (tenant, version), exc in self.heads.refused.items():
            self.log.error("weights refused", tenant=tenant, version=version, error=str(exc))
        if self.warmup:
            await self._warm_known()
        self.spawn(self._batch_loop, "batcher", critical=True)
        self.spawn(lambda: flush_loop(self, self.meter, self.usage_flush), "usage-flush", critical=True)
        # Kept out of self._subs: the runtime's drain unsubscribes those, which discards
        # messages already delivered but not yet read. This one is drained instead (every
        # delivered message is read and answered: worked before the drain, Draining after).
        self._predict_sub = await self.bus.nc.subscribe(
            self.names.infer(self.pool), queue=f"{self.names.prefix}-infer-{self.pool}", cb=self._on_predict,
            pending_msgs_limit=65536)
        self.spawn(self._leave_group_on_stop(), "predict-drain")
        self.log.info("serving", pool=self.pool, base=self.base_source, tenants_synced=synced, fast=self.fast,
                      compile=bool(self.fast and self.compile), warmup=self.warmup,
                      warmed_layouts=self.warmed_layouts(), warmup_s=round(self.warmup_s, 2),
                      max_batch_size=self.icfg.max_batch_size,
                      batch_wait_timeout_s=self.icfg.batch_wait_timeout_s)

    def info_extra(self) -> dict[str, Any]:
        return {
            "pool": self.pool, "base": self.base_source,
            "engine": {"fast": self.fast, "compile": bool(self.fast and self.compile), "warmup": self.warmup,
                       "euler": self.euler,
                       "image_size": self.heads.base.layout.image_size[0] if self.heads is not None else None,
                       "warmed_layouts": self.warmed_layouts(), "warmed_variants": len(self._warmed),
                       "heads_in_forward": self.heads_in_forward,
                       "warmup_s": self.warmup_s,
                       "warm_sizes": self.warm_sizes() if self.warmup else []},
            "max_batch_size": self.icfg.max_batch_size,
            "batch_wait_timeout_s": self.icfg.batch_wait_timeout_s,
            "served": self.served, "groups": self.groups, "dropped": self.dropped,
            "mean_batch": self.served / self.groups if self.groups else 0.0,
            "group_sizes": {str(k): v for k, v in sorted(self.group_sizes.items())},
            "versions": dict(self.heads.current) if self.heads else {},
            # Export -> servable per stage (actors/inferencer/serving.py): recent syncs' p50 / p95 seconds.
            "weight_sync": self.heads.sync_report() if self.heads else {},
            "weight_sync_spares_used": self.heads.spares_used if self.heads else 0,
            # (tenant, version)s whose manifest names another base or schema: never served.
            "refused": {f"{t}/v{v}": str(e) for (t, v), e in self.heads.refused.items()} if self.heads else {},
            "queued": sum(len(q.items) for q in self.queues.values()),
            "held": self.held, "busy": self.busy, "replayed": self.replayed, "joined": self.joined,
            "draining_refused": self.draining_refused, "reply_cache": len(self.replies),
            "max_queue_per_key": self.icfg.max_queue_per_key, "max_queued": self.icfg.max_queued,
            "max_queued_per_tenant": self.icfg.max_queued_per_tenant, "tenant_refused": self.tenant_refused,
            "usage": self.meter.info(), "rate_refused": dict(self.rate.refused),
            # NEXUS_INFER_HEAD_BUDGET_MB: bytes of loaded heads, heads evicted / reloaded so far.
            "head_budget": self.heads.budget_report() if self.heads else {},
        }

    def heartbeat_gauges(self) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        gauges, per_tenant = super().heartbeat_gauges()
        gauges.update(busy_s=self.busy_s, served=float(self.served), groups=float(self.groups),
                      batch_wait_s=self.batch_wait_s, queued=float(sum(len(q.items) for q in self.queues.values())))
        if self.heads is not None:
            gauges["device_memory_bytes"] = float(device_memory_bytes(self.heads.base.device))
            gauges.update(slot_bytes=float(self.heads.loaded_bytes()), slot_evictions=float(self.heads.evictions),
                          slot_restores=float(self.heads.reloads))
        return gauges, per_tenant

    async def _leave_group_on_stop(self) -> None:
        """On a drain, leave the queue group at once (new requests go to the other instances)
        but read what was already delivered: each such message gets an answer."""
        await self._stop.wait()
        try:
            await self._predict_sub.drain()
        except Exception as exc:  # connection gone: nothing more will be delivered anyway
            self.log.warning("predict subscription drain failed", error=str(exc))

    # -- weight sync ---------------------------------------------------------------------
    async def _on_tenant_deleted(self, msg: Any) -> None:
        tenant = msg.subject.rsplit(".", 1)[-1]
        self._weights_waiting.pop(tenant, None)
        if self.heads is not None:
            self.heads.forget(tenant)
        self.rate.forget(tenant)
        if not is_slot_reset(msg.data):  # a reset keeps the tenant's usage: its unsent deltas too
            self.meter.forget(tenant)

    async def _on_tenant_updated(self, msg: Any) -> None:
        # Its quotas changed: the next request reads the config again (the new predict rate).
        if self.heads is not None:
            self.heads.configs.pop(msg.subject.rsplit(".", 1)[-1], None)

    async def on_drain(self) -> None:
        # Every answered request's device time reaches the master before the process exits.
        await final_flush(self, self.meter, self.usage_flush)

    async def _on_weights(self, msg: Any) -> None:
        """An announcement. NATS hands one subscription's messages over one at a time, so a load
        here would make every other tenant's announcement wait (a shared trainer step ends
        several tenants' jobs together): each tenant's newest announcement loads in its own task,
        one task per tenant at a time; an announcement arriving meanwhile replaces the one
        waiting (a newer version supersedes it). At most one task and one waiting per tenant."""
        try:
            ref = decode(msg.data, WeightsRef)
        except Exception as exc:
            self.log.error("weight announcement refused", subject=msg.subject, error=str(exc))
            return
        waiting = self._weights_waiting.get(ref.tenant)
        if waiting is None or ref.version > waiting[0].version:
            self._weights_waiting[ref.tenant] = (ref, msg.subject, msg.headers)
        if ref.tenant not in self._weights_tasks:
            self._weights_tasks[ref.tenant] = asyncio.ensure_future(self._sync_tenant(ref.tenant))

    async def _sync_tenant(self, tenant: str) -> None:
        try:
            while (item := self._weights_waiting.pop(tenant, None)) is not None:
                await self._sync_one(*item)
        finally:
            self._weights_tasks.pop(tenant, None)

    async def _sync_one(self, ref: WeightsRef, subject: str, headers: Any) -> None:
        assert self.heads is not None
        # The trainer's announcement span is the parent: the load joins the job's trace.
        with consumer_span(self.tracer, "inferencer.weights_load", subject, headers) as span:
            try:
                span.set_attributes({**nexus_attrs(ref), "nexus.version": ref.version})
                lag = await self.heads.on_announce(ref)
                span.set_attribute("nexus.loaded", lag is not None)
            except Exception as exc:
                self.log.error("weight sync failed", subject=subject, tenant=ref.tenant, version=ref.version,
                               error=str(exc))
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                return
        if lag is not None:
            self.log.info("weights synced", tenant=ref.tenant, version=ref.version, export_to_servable_s=round(lag, 4))
            await self.metric("weight_sync_s", ref.tenant, lag)

    # -- intake --------------------------------------------------------------------------
    async def _on_predict(self, msg: Any) -> None:
        """Intake, in order, all before any task is made: decode; a retry of an answered
        request gets its reply again, one of a request still held joins it; a draining
        instance refuses; past ``max_queued`` the caller hears Busy. Only then a task.

        The request's span (`inferencer.predict`, SERVER) has the caller's context as its
        parent (a missing or malformed one makes it a new root); it ends here on an answer
        given at once, else when the held request's reply goes (`_finish`)."""
        span = self.tracer.start_span(
            "inferencer.predict", context=extract(msg.headers, where="inferencer.predict"), kind=SpanKind.SERVER,
            attributes={**messaging(msg.subject, "process"), "nexus.role": self.name, "nexus.instance": self.instance})
        held = False
        try:
            held = await self._intake(msg, span)
        finally:
            if not held:
                span.end()

    async def _intake(self, msg: Any, span: Any) -> bool:
        """`_on_predict`'s work; True when the request is held (its span then ends later)."""
        now = time.monotonic()
        arrived_ns = now_ns()
        try:
            req = decode(msg.data, PredictRequest)
            span.set_attributes(nexus_attrs(req))
            # A tenant predicts with its own heads only (the broker asserts who is calling).
            require_tenant(req.tenant, "predict", caller_from_headers(msg.headers))
        except NexusError as exc:
            span.set_status(Status(StatusCode.ERROR, exc.message))
            await self._reply(msg, ErrorReply.from_exception(exc), span)
            return False
        key = (req.tenant, req.request_id) if req.request_id else None
        if key is not None:
            cached = self.replies.get(key, now)
            if cached is not None:
                self.replayed += 1
                span.set_attribute("nexus.outcome", "replayed")
                await self._send(msg, cached, span)
                return False
            first = self._by_id.get(key)
            if first is not None:
                if len(first.joined) >= self.icfg.max_joined_per_request:
                    await self._refuse_busy(msg, f"request {req.request_id!r} is already held with "
                                                 f"{len(first.joined)} copies", self.held, span)
                    return False
                self.joined += 1
                first.joined.append(msg)
                first.expires = max(first.expires, now + req.timeout_s)
                span.set_attribute("nexus.outcome", "joined")
                if first.span is not None:
                    span.add_link(first.span.get_span_context(), {"nexus.link": "joined"})
                return False
        if self.state in ("draining", "stopped"):
            # Tasks made now would outlive the drain's wait: refuse, the caller retries elsewhere.
            self.draining_refused += 1
            span.set_attribute("nexus.outcome", "draining")
            await self._reply(msg, ErrorReply.from_exception(Draining(
                f"inferencer {self.instance} is draining; retry on another instance")), span)
            return False
        if self.held >= self.icfg.max_queued:
            await self._refuse_busy(msg, f"inferencer {self.instance} holds {self.held} requests "
                                         f"(max_queued={self.icfg.max_queued})", self.held, span)
            return False
        tenant_held = self.held_by_tenant[req.tenant]
        if tenant_held >= self.icfg.max_queued_per_tenant:
            self.busy += 1
            self.tenant_refused += 1
            hint = self._busy_hint_s(tenant_held)
            span.set_attribute("nexus.outcome", "busy")
            await self._reply(msg, ErrorReply.from_exception(QuotaExceeded.of(
                "max_queued_per_tenant", self.icfg.max_queued_per_tenant,
                f"tenant {req.tenant!r} has {tenant_held} requests held by inferencer {self.instance} "
                f"(NEXUS_INFER_MAX_QUEUED_PER_TENANT); retry in {hint:g} s", hint, tenant=req.tenant,
                setting="NEXUS_INFER_MAX_QUEUED_PER_TENANT")), span)
            return False
        p = Pending(req=req, msg=msg, arrived=now, expires=now + req.timeout_s, key=key, span=span,
                     arrived_ns=arrived_ns)
        p.reply = asyncio.get_running_loop().create_future()
        self.held += 1
        self.held_by_tenant[req.tenant] += 1
        if key is not None:
            self._by_id[key] = p
        # Tracked like any request, so a drain waits for it.
        task = asyncio.ensure_future(self._admit(p))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return True

    def _end_request_span(self, p: Pending, result: Any, replied_ns: int) -> None:
        """End ``p``'s span; a sampled one first gets its `PREDICT_STAGES` children, made now
        from the stamps (never on the device thread)."""
        span = p.span
        if span is None:
            return
        end = now_ns()
        if result is None:
            span.set_attribute("nexus.outcome", "expired")
        elif isinstance(result, ErrorReply):
            span.set_status(Status(StatusCode.ERROR, result.message))
            span.set_attribute("nexus.error_code", result.code)
        else:
            span.set_attributes({"nexus.version": p.version, "nexus.batch_size": result.batch_size})
        st = p.stamps or {}
        if is_sampled(span) and p.enqueued_ns:
            prep = st.get("prep_start", replied_ns)
            marks = [("predict.queue_wait", p.arrived_ns, p.enqueued_ns),
                     ("predict.batch_wait", p.enqueued_ns, prep)]
            if "prep_end" in st:
                marks.append(("predict.canonicalise", prep, st["prep_end"]))
            if "fwd_end" in st:
                marks += [("predict.forward", st["fwd_start"], st["fwd_end"]),
                          ("predict.head", st["fwd_end"], st["head_end"])]
            marks.append(("predict.reply", st.get("head_end", replied_ns), end))
            for name, start, stop in marks:
                record_span(self.tracer, name, span, start, stop)
        span.end(end_time=end)

    def _busy_hint_s(self, queued: int) -> float:
        """Roughly when the queue ahead will have drained: its groups x a recent forward."""
        cfg = self.icfg
        groups = -(-queued // self.icfg.max_batch_size)
        return round(min(cfg.busy_max_retry_after_s, max(cfg.busy_retry_after_s, groups * self._forward_ewma_s)), 3)

    async def _refuse_busy(self, msg: Any, why: str, queued: int, span: Any = None) -> None:
        self.busy += 1
        hint = self._busy_hint_s(queued)
        if span is not None:
            span.set_attribute("nexus.outcome", "busy")
        await self._reply(msg, ErrorReply.from_exception(Busy(
            f"{why}; retry in {hint:g} s or on another instance", details={"retry_after_s": hint})), span)

    async def _admit(self, p: Pending) -> None:
        assert self.heads is not None
        try:
            # Held until answered (`_finish`): never dropped under the head budget meanwhile.
            p.slot, p.version = await self.heads.get(p.req.tenant, p.req.version, hold=True)
            if p.req.workload:
                check_token("workload", p.req.workload)  # a usage key at the master
            self._check_rate(p.req.tenant)
        except NexusError as exc:
            await self._finish(p, ErrorReply.from_exception(exc))
            return
        except Exception as exc:
            self.log.error("predict admission failed", exc_info=exc)
            await self._finish(p, ErrorReply.from_exception(InternalError(f"{type(exc).__name__}: {exc}")))
            return
        q = self.queues.setdefault(p.slot.key, KeyQueue())
        if len(q.items) >= self.icfg.max_queue_per_key:
            self.busy += 1
            hint = self._busy_hint_s(len(q.items))
            await self._finish(p, ErrorReply.from_exception(Busy(
                f"inferencer {self.instance}: the queue of this request's key holds {len(q.items)} "
                f"(max_queue_per_key={self.icfg.max_queue_per_key}); retry in {hint:g} s or on another instance",
                details={"retry_after_s": hint})))
            return
        p.enqueued_ns = now_ns()
        q.items.append(p)
        self._arrival.set()
        await p.reply  # the batcher resolves it; keeps this task (and the drain) waiting

    def _check_rate(self, tenant: str) -> None:
        """The tenant's predict rate quota on this instance (after `heads.get`, which loaded
        its config): QuotaExceeded naming the rate, with the wait until a token is back."""
        assert self.heads is not None
        cfg = self.heads.configs.get(tenant)
        q = (cfg.quotas if cfg is not None else None) or self.default_quotas
        wait_s = self.rate.take(tenant, q.predict_rate_per_s, q.predict_burst, time.monotonic())
        if wait_s > 0:
            raise QuotaExceeded.of("predict_rate_per_s", q.predict_rate_per_s,
                                   f"tenant {tenant!r} sent more than {q.predict_rate_per_s:g} predicts/s "
                                   f"(burst {q.predict_burst}) to inferencer {self.instance}",
                                   round(wait_s, 4), tenant=tenant, burst=q.predict_burst)

    async def _finish(self, p: Pending, result: Any) -> None:
        """Answer every caller of ``p`` (None: all gave up, no answer), remember a good reply
        for retries, and release ``p``'s place in the bounds."""
        replied_ns = now_ns()
        try:
            if result is not None:
                data = encode(result)
                if p.key is not None and isinstance(result, PredictReply):
                    # Only successes replay: an error (busy, not found, a failed forward) may
                    # not hold on a retry, which is then worked afresh.
                    self.replies.put(p.key, data, time.monotonic())
                for m in [p.msg, *p.joined]:
                    await self._send(m, data, p.span)
        finally:
            self._end_request_span(p, result, replied_ns)
            if p.key is not None and self._by_id.get(p.key) is p:
                del self._by_id[p.key]
            self.held -= 1
            self.held_by_tenant[p.req.tenant] -= 1
            if self.held_by_tenant[p.req.tenant] <= 0:
                del self.held_by_tenant[p.req.tenant]  # bounded by the tenants holding requests now
            if p.slot is not None and self.heads is not None:
                self.heads.release(p.req.tenant, p.version)
                p.slot = None  # released once
            if not p.reply.done():
                p.reply.set_result(None)

    # -- batching ------------------------------------------------------------------------
    def _next_group(self, now: float) -> tuple[list[Pending] | None, float | None]:
        """A group ready to fire, else the time until the earliest one is due."""
        cfg = self.icfg
        wait: float | None = None
        for key, q in self.queues.items():
            if not q.items:
                continue
            due = q.items[0].arrived + cfg.batch_wait_timeout_s
            if len(q.items) >= cfg.max_batch_size or now >= due:
                n = min(len(q.items), cfg.max_batch_size)
                return [q.items.popleft() for _ in range(n)], None
            wait = due - now if wait is None else min(wait, due - now)
        return None, wait

    async def _batch_loop(self) -> None:
        """Two-stage pipeline: group N+1 is canonicalised on the CPU while group N's forward
        runs; replies go out from their own task, so the device never waits on the event loop."""
        loop = asyncio.get_running_loop()
        # Groups between forming and replied: one in the forward, one prepared and queued
        # behind it (measured on an H200: depth 3 made throughput worse, 146 -> 131 req/s).
        in_flight = asyncio.Semaphore(self.pipeline_depth)
        while True:
            group, wait = self._next_group(time.monotonic())
            if group is None:
                self._arrival.clear()
                try:
                    await asyncio.wait_for(self._arrival.wait(), timeout=wait)
                except asyncio.TimeoutError:
                    pass
                continue
            stamps = {"picked": now_ns()}  # shared by the group's requests (their stage spans)
            for p in group:
                p.stamps = stamps
            await in_flight.acquire()
            started = time.monotonic()
            try:
                prepared = await asyncio.to_thread(self._prepare, group, started)
                fut = loop.run_in_executor(self._forward_pool, self._timed_forward, group, *prepared)
            except Exception as exc:  # a failed prepare fails its group, never the role
                fut = loop.create_future()
                fut.set_exception(exc)
            self.spawn(self._complete(group, fut, started, in_flight), "predict-replies")

    async def _complete(self, group: list[Pending], fut: Any, started: float, in_flight: asyncio.Semaphore) -> None:
        try:
            try:
                results = await fut
            except Exception as exc:
                self.log.error("group forward failed", exc_info=exc, size=len(group))
                results = [ErrorReply.from_exception(InternalError(f"forward failed: {type(exc).__name__}: {exc}"))
                           for _ in group]
            forward_s = time.monotonic() - started
            # The Busy hint's unit: a smoothed group time (this includes the pipeline wait).
            self._forward_ewma_s = forward_s if not self._forward_ewma_s else 0.8 * self._forward_ewma_s + 0.2 * forward_s
            live = 0
            for p, result in zip(group, results):
                if result is None:
                    self.dropped += 1
                elif isinstance(result, PredictReply):
                    result.queue_wait_s = started - p.arrived
                    self.batch_wait_s += result.queue_wait_s
                    result.forward_s = forward_s
                    live += 1
                await self._finish(p, result)
            self.served += live
            self.groups += 1
            if live:
                self.group_sizes[live] += 1
        finally:
            in_flight.release()

    async def _reply(self, msg: Any, reply: Any, span: Any = None) -> None:
        await self._send(msg, encode(reply), span)

    async def _send(self, msg: Any, data: bytes, span: Any = None) -> None:
        """Reply; a sampled request's reply headers carry its span's context (the caller's span
        links to it; an unsampled one's would be dropped anyway, so none is made)."""
        if not msg.reply:
            return
        headers = carrier_of(span) if span is not None and is_sampled(span) else None
        try:
            await self.bus.nc.publish(msg.reply, data, headers=headers)
        except Exception as exc:  # the caller's connection is gone
            self.log.warning("predict reply failed", error=str(exc))
