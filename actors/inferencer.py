"""Inferencer (Inference Model Service): cross-tenant group batching over request-reply.

Serves ``<prefix>.infer.<pool>`` in queue group ``<prefix>-infer-<pool>`` (pool = the base it
hosts). Requests wait in one queue per compatibility key; a group fires when it holds
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
draining one leaves the group first and answers what it already holds.

Run: ``python -m actors.run inferencer`` with NEXUS_INFER_BASE (default tiny-qwen3-vl-64),
NEXUS_INFER_MAX_BATCH_SIZE (32), NEXUS_INFER_BATCH_WAIT_TIMEOUT_S (0.005).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.runtime import Role, RoleConfig
from actors.serving import ServingHeads
from protocol.errors import InternalError, NexusError
from protocol.messages import ErrorReply, PredictReply, PredictRequest, WeightsRef
from protocol.subjects import pool_name
from protocol.wire import decode, encode


DEFAULT_BASE = "tiny-qwen3-vl-64"


@dataclass
class BatchingConfig:
    """Defaults: 32 rows fill a GPU forward well for 2-camera inputs; 5 ms bounds the latency a
    lone request pays waiting for company."""

    max_batch_size: int = 32
    batch_wait_timeout_s: float = 0.005

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch_size <= 1024:
            raise ValueError(f"max_batch_size={self.max_batch_size}: must be in 1..1024")
        if not 0 <= self.batch_wait_timeout_s <= 10:
            raise ValueError(f"batch_wait_timeout_s={self.batch_wait_timeout_s}: must be in [0, 10]")

    @classmethod
    def from_env(cls) -> BatchingConfig:
        env = os.environ
        return cls(max_batch_size=int(env.get("NEXUS_INFER_MAX_BATCH_SIZE", cls.max_batch_size)),
                   batch_wait_timeout_s=float(env.get("NEXUS_INFER_BATCH_WAIT_TIMEOUT_S", cls.batch_wait_timeout_s)))


@dataclass
class _Pending:
    req: PredictRequest
    msg: Any
    slot: Any
    version: int
    arrived: float  # monotonic
    reply: Any = None


@dataclass
class _Queue:
    items: deque = field(default_factory=deque)


class Inferencer(Role):
    name = "inferencer"

    def __init__(self, cfg: RoleConfig, batching: BatchingConfig | None = None, base_source: str | None = None) -> None:
        super().__init__(cfg)
        self.batching = batching or BatchingConfig.from_env()
        # The embedded default serves the built-in task's base; one inferencer serves one pool.
        self.base_source = base_source or os.environ.get("NEXUS_INFER_BASE", DEFAULT_BASE)
        self.pool = pool_name(self.base_source)
        self.device = os.environ.get("NEXUS_INFER_DEVICE") or None
        # The optimized Qwen3-VL encode with CUDA graphs (models.fast); groups are then padded
        # up to a few capture sizes, as vLLM does, so a handful of graphs cover every size.
        self.fast = os.environ.get("NEXUS_INFER_FAST", "") not in ("", "0")
        self.heads: ServingHeads | None = None
        # One thread owns the device: forwards run in order, never two at once.
        self._forward_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self.queues: dict[Any, _Queue] = {}
        self._arrival = asyncio.Event()
        self.served = 0
        self.groups = 0
        self.dropped = 0
        # Forwarded requests per group -> groups: benchmarks replay this distribution in-process.
        self.group_sizes: Counter[int] = Counter()

    async def setup(self) -> None:
        assert self.bus is not None
        import torch

        from models import BaseConfig, BaseModel

        torch.set_num_threads(1)
        base = await asyncio.to_thread(BaseModel.load, BaseConfig(source=self.base_source, device=self.device,
                                                                  fast=self.fast))
        self.heads = ServingHeads(self.bus, self.names, base, self.base_source)
        await self.bus.nc.subscribe(self.names.weights_all, cb=self._on_weights)
        # Elastic join: every live tenant's weights first, then take requests.
        synced = await self.heads.sync_all()
        self.spawn(self._batch_loop(), "batcher")
        self._subs.append(await self.bus.nc.subscribe(
            self.names.infer(self.pool), queue=f"{self.names.prefix}-infer-{self.pool}", cb=self._on_predict,
            pending_msgs_limit=65536))
        self.log.info("serving", pool=self.pool, base=self.base_source, tenants_synced=synced,
                      max_batch_size=self.batching.max_batch_size,
                      batch_wait_timeout_s=self.batching.batch_wait_timeout_s)

    def info_extra(self) -> dict[str, Any]:
        return {
            "pool": self.pool, "base": self.base_source,
            "max_batch_size": self.batching.max_batch_size,
            "batch_wait_timeout_s": self.batching.batch_wait_timeout_s,
            "served": self.served, "groups": self.groups, "dropped": self.dropped,
            "mean_batch": self.served / self.groups if self.groups else 0.0,
            "group_sizes": {str(k): v for k, v in sorted(self.group_sizes.items())},
            "versions": dict(self.heads.current) if self.heads else {},
            "queued": sum(len(q.items) for q in self.queues.values()),
        }

    # -- weight sync ---------------------------------------------------------------------
    async def _on_weights(self, msg: Any) -> None:
        assert self.heads is not None
        try:
            ref = decode(msg.data, WeightsRef)
            lag = await self.heads.on_announce(ref)
        except Exception as exc:
            self.log.error("weight sync failed", subject=msg.subject, error=str(exc))
            return
        if lag is not None:
            self.log.info("weights synced", tenant=ref.tenant, version=ref.version, export_to_servable_s=round(lag, 4))
            await self.metric("weight_sync_s", ref.tenant, lag)

    # -- intake --------------------------------------------------------------------------
    async def _on_predict(self, msg: Any) -> None:
        # Tracked like any request, so a drain waits for it.
        task = asyncio.ensure_future(self._admit(msg))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _admit(self, msg: Any) -> None:
        assert self.heads is not None
        arrived = time.monotonic()
        try:
            req = decode(msg.data, PredictRequest)
            slot, version = await self.heads.get(req.tenant, req.version)
        except NexusError as exc:
            await self._reply(msg, ErrorReply.from_exception(exc))
            return
        except Exception as exc:
            self.log.error("predict admission failed", exc_info=exc)
            await self._reply(msg, ErrorReply.from_exception(InternalError(f"{type(exc).__name__}: {exc}")))
            return
        p = _Pending(req=req, msg=msg, slot=slot, version=version, arrived=arrived)
        self.queues.setdefault(slot.key, _Queue()).items.append(p)
        self._arrival.set()
        done = asyncio.get_running_loop().create_future()
        p.reply = done
        await done  # the batcher resolves it; keeps this task (and the drain) waiting

    # -- batching ------------------------------------------------------------------------
    def _next_group(self, now: float) -> tuple[list[_Pending] | None, float | None]:
        """A group ready to fire, else the time until the earliest one is due."""
        cfg = self.batching
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
        in_flight = asyncio.Semaphore(int(os.environ.get("NEXUS_INFER_PIPELINE_DEPTH", "2")))
        while True:
            group, wait = self._next_group(time.monotonic())
            if group is None:
                self._arrival.clear()
                try:
                    await asyncio.wait_for(self._arrival.wait(), timeout=wait)
                except asyncio.TimeoutError:
                    pass
                continue
            await in_flight.acquire()
            started = time.monotonic()
            try:
                prepared = await asyncio.to_thread(self._prepare, group, started)
                fut = loop.run_in_executor(self._forward_pool, self._forward, group, *prepared)
            except Exception as exc:  # a failed prepare fails its group, never the role
                fut = loop.create_future()
                fut.set_exception(exc)
            self.spawn(self._complete(group, fut, started, in_flight), "predict-replies")

    async def _complete(self, group: list[_Pending], fut: Any, started: float, in_flight: asyncio.Semaphore) -> None:
        try:
            try:
                results = await fut
            except Exception as exc:
                self.log.error("group forward failed", exc_info=exc, size=len(group))
                results = [ErrorReply.from_exception(InternalError(f"forward failed: {type(exc).__name__}: {exc}"))
                           for _ in group]
            forward_s = time.monotonic() - started
            live = 0
            for p, result in zip(group, results):
                if result is None:
                    self.dropped += 1
                else:
                    if isinstance(result, PredictReply):
                        result.queue_wait_s = started - p.arrived
                        result.forward_s = forward_s
                        live += 1
                    await self._reply(p.msg, result)
                if not p.reply.done():
                    p.reply.set_result(None)
            self.served += live
            self.groups += 1
            if live:
                self.group_sizes[live] += 1
        finally:
            in_flight.release()

    def _prepare(self, group: list[_Pending], started: float) -> tuple[list[Any], list[int], Any, Any]:
        """CPU stage: drop requests whose caller gave up, canonicalise each slot's rows in one
        call (a bad request gets its own error, never its group's), pack one batch.

        On CUDA this stage runs on its own stream: a host-to-device copy on the forward's
        stream would queue behind the running forward and stall this thread until it ends,
        which serialises the pipeline. The forward waits on the returned event instead."""
        from models import VLABatch

        results: list[Any] = [None] * len(group)
        by_slot: dict[int, list[int]] = {}
        for i, p in enumerate(group):
            if started - p.arrived > p.req.timeout_s:
                continue  # the caller has given up: no work for it
            by_slot.setdefault(id(p.slot), []).append(i)
        device = self.heads.base.device
        stream = _side_stream(device)
        live: list[int] = []
        parts: list[Any] = []
        with _on_stream(stream):
            # Rows of one slot next to each other, so each head runs once on a contiguous slice.
            for rows in by_slot.values():
                ok, vla = self._canonicalise(group, rows, results, device)
                if ok:
                    live.extend(ok)
                    parts.append(vla)
            packed = VLABatch.cat(parts) if parts else None
            if packed is not None and self.fast:
                packed = pad_to_capture_size(packed)
            ready = None
            if stream is not None:
                import torch

                ready = torch.cuda.Event()
                ready.record(stream)
        return results, live, packed, ready

    @staticmethod
    def _canonicalise(group: list[_Pending], rows: list[int], results: list[Any], device: Any
                      ) -> tuple[list[int], Any]:
        """One slot's rows in one preprocessor call; if any is bad, one by one to find it."""
        from models import InputError, Observation, VLABatch

        def obs(p: _Pending) -> Any:
            return Observation(images={k: np.asarray(v) for k, v in p.req.images.items()},
                               state=np.asarray(p.req.state), instruction=p.req.instruction)

        pre = group[rows[0]].slot.preprocessor
        try:
            return rows, pre([obs(group[i]) for i in rows], device=device)
        except (InputError, ValueError, TypeError):
            pass
        ok, parts = [], []
        for i in rows:
            try:
                parts.append(pre([obs(group[i])], device=device))
                ok.append(i)
            except (InputError, ValueError, TypeError) as exc:
                results[i] = ErrorReply.from_exception(_input_error(exc))
        return ok, (VLABatch.cat(parts) if parts else None)

    def _forward(self, group: list[_Pending], results: list[Any], live: list[int], packed: Any,
                 ready: Any = None) -> list[Any]:
        """Device stage: one base forward for the group, then each (tenant, version) head;
        one host sync at the end, not one per head."""
        import torch

        if not live:
            return results
        heads = self.heads
        assert heads is not None
        # One span per forward: the inferencer's busy timeline in the traces (examples/report.py).
        with self.tracer.start_as_current_span("inferencer.forward", attributes={"nexus.group_size": len(live)}), \
                torch.inference_mode():
            if ready is not None:
                current = torch.cuda.current_stream(packed.device)
                current.wait_event(ready)
                # Made on the side stream, read on this one: keep the allocator from reusing
                # the memory before this stream is done with it.
                packed.images_B_S_C_H_W.record_stream(current)
            feats = heads.base.encode(packed, inference=True)
            outs = []
            start = 0
            while start < len(live):
                slot = group[live[start]].slot
                end = start
                while end < len(live) and group[live[end]].slot is slot:
                    end += 1
                f = feats.split([start, end - start, len(feats) - end])[1]
                vla = packed.index(slice(start, end))
                head = slot.head
                log_prob = value = None
                if hasattr(head, "act"):
                    actions, log_prob, value = head.act(f, vla, slot.generator,
                                                        deterministic=not group[live[start]].req.sample)
                else:
                    actions = head.predict(f, vla, slot.generator)
                outs.append((live[start:end], actions, log_prob, value))
                start = end
            for rows, actions, log_prob, value in outs:
                actions = actions.float().cpu().numpy()
                log_prob = None if log_prob is None else log_prob.float().cpu().numpy()
                value = None if value is None else value.float().cpu().numpy()
                for j, i in enumerate(rows):
                    p = group[i]
                    results[i] = PredictReply(
                        tenant=p.req.tenant, version=p.version, actions=actions[j],
                        log_prob=None if log_prob is None else float(log_prob[j]),
                        value=None if value is None else float(value[j]),
                        batch_size=len(live))
        return results

    def _run_group(self, group: list[_Pending], started: float) -> list[Any]:
        """Both stages in series (the benchmark's in-process ceiling uses this)."""
        return self._forward(group, *self._prepare(group, started))

    async def _reply(self, msg: Any, reply: Any) -> None:
        if not msg.reply:
            return
        try:
            await msg.respond(encode(reply))
        except Exception as exc:  # the caller's connection is gone
            self.log.warning("predict reply failed", error=str(exc))


CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def pad_to_capture_size(packed: Any) -> Any:
    """Repeat the last row up to the next capture size; the extra rows' outputs are ignored."""
    from models import VLABatch

    n = len(packed)
    target = next(c for c in CAPTURE_SIZES if c >= n)
    if target == n:
        return packed
    last = packed.index(slice(n - 1, n))
    return VLABatch.cat([packed] + [last] * (target - n))


@functools.lru_cache(maxsize=None)
def _side_stream(device: Any) -> Any:
    """The canonicalise stage's CUDA stream for ``device`` (None off CUDA)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return torch.cuda.Stream(device)


def _on_stream(stream: Any) -> Any:
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


def _input_error(exc: Exception) -> NexusError:
    from protocol.errors import InvalidField

    text = str(exc)
    field, _, rest = text.partition(": ")
    return InvalidField(field if rest else "observation", rest or text)
