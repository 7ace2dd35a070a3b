"""The inferencer's device side, on its forward thread: warming the graph variants its tenants
will use (`_warm_known`, `_warm`), and a group's two stages, canonicalise (`_prepare`) then one
base forward with every head on its rows (`_forward`). A mixin of `Inferencer`
(`inferencer.py`), which owns the queues, the heads and the forward thread; what the mixin
uses of it is `ForwardHost`, and nothing else (tests/actors/test_mixin_hosts.py checks)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from transport.bus import js_retry
from actors.tracing import (
    now_ns,
)
from protocol.messages import ErrorReply, PredictReply

from opentelemetry import trace

from actors.inferencer.batching import (
    CAPTURE_SIZES, WARM_HEAD_BUILDS, Pending, input_error, lora_segments, on_stream, pad_to_capture_size, side_stream,
    slot_runs, warmup_row,
)

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from opentelemetry.trace import Tracer

    from actors.inferencer.config import InferencerConfig
    from actors.inferencer.serving import ServingHeads
    from actors.metering import Meter
    from protocol.subjects import Names
    from transport.bus import Bus


class ForwardHost(Protocol):
    """What `Forwarding` uses of the inferencer it is mixed into, and nothing more (`Inferencer`
    is the host): the heads and the config, the forward thread, the counters the device side
    adds to, and the role's bus, names, log and tracer."""

    heads: ServingHeads | None  # the base and each tenant's head (None until setup)
    icfg: InferencerConfig  # max_batch_size: the largest capture size warmed
    fast: bool | None  # the fast engine: a group is padded to a capture size
    warmup: bool | None  # a variant first seen is warmed at every capture size
    bus: Bus | None
    names: Names
    log: Any  # the role's structlog logger
    tracer: Tracer
    meter: Meter  # each forward's device time, charged to the group's tenants
    _forward_pool: ThreadPoolExecutor  # the one forward thread (warm-ups run there too)
    _warmed: set[tuple[Any, int | None, bool, int | None]]  # (layout, LoRA generation, kv, head generation)
    warmup_s: float  # seconds spent warming (nobody's)
    busy_s: float  # seconds in forwards (the device's busy time)
    heads_in_forward: int  # groups whose heads ran inside the base's graph


# To a type checker the mixin is its host (`self.heads` has ForwardHost's type); at run time a
# plain class, so no stub of the protocol sits in `Inferencer`'s MRO.
if TYPE_CHECKING:
    _Host = ForwardHost
else:
    _Host = object


class Forwarding(_Host):
    async def _warm_known(self) -> None:
        """Before ready: every graph variant the tenants of this pool (registered, trained or not)
        will use, through every capture size (`_warm`): per layout the frozen forward, the
        adapted one where a tenant has a LoRA adapter (warmed with one throwaway adapter at the
        tenants' largest rank over all their targets, so no later rank or target grows the pool
        and drops what was captured), with the plain `mlp` heads inside where tenants have them
        (their shapes' buckets made first) and without where others do, and the one with the
        prefix-KV outputs where a tenant's head is an action expert. Distinct variants are few,
        tenants may be many."""
        from nats.js.errors import NoKeysError

        from models import TenantPreprocessor, TenantSchema, TenantSlot
        from models.heads.pool import HEAD_SHAPES_MAX, poolable, shape_of
        from models.lora import warmup_adapter

        assert self.heads is not None and self.bus is not None
        kv = await js_retry(self.bus.js.key_value, self.names.kv_tenants)
        try:
            keys = await kv.keys()
        except NoKeysError:
            keys = []
        base = self.heads.base
        # (layout, expert head) -> a warm-up row, whether LoRA tenants use it, whether plain `mlp`
        # heads (inside the graph) and other heads (after it) serve it. Graphs depend on ranks,
        # targets and head shapes, never on weights, and what a tenant registered is its own
        # choice: one throwaway adapter at the largest rank over every target any tenant adapts
        # (what the pool grows to), and one throwaway head per head shape, at most
        # HEAD_SHAPES_MAX of them and WARM_HEAD_BUILDS builds (the rest warm at their first group).
        variants: dict[tuple[Any, bool], tuple[Any, list[bool], list[bool], list[bool]]] = {}
        rank, targets = 0, set()
        heads_by_shape: dict[Any, Any] = {}
        seen_heads: set[str] = set()
        for tenant in keys:
            try:
                cfg = await self.heads.config(tenant)
                schema = TenantSchema.from_dict(cfg.schema)
                pre = TenantPreprocessor.for_base(schema, base)
                expert = cfg.head == "expert"
                v = variants.setdefault((pre.key.layout, expert), (warmup_row(pre, schema, base.device), [], [], []))
                if cfg.base_adapter:
                    v[1].append(True)
                    rank = max(rank, int(cfg.base_adapter["rank"]))
                    targets |= set(cfg.base_adapter.get("target_modules", ("q_proj", "v_proj")))
                if expert:
                    continue
                text = json.dumps([cfg.schema, cfg.head, cfg.head_params], sort_keys=True)
                if text in seen_heads or len(seen_heads) >= WARM_HEAD_BUILDS:
                    v[2].append(True)  # warmed with the shapes found (or at its first group)
                    continue
                seen_heads.add(text)
                head = TenantSlot.create(f"warm-{len(seen_heads)}", schema, base, head_kind=cfg.head,
                                         head_options=cfg.head_params).head
                if not poolable(head):
                    v[3].append(True)
                    continue
                v[2].append(True)
                if len(heads_by_shape) < HEAD_SHAPES_MAX:
                    heads_by_shape.setdefault(shape_of(head), head)
            except Exception:  # another pool's tenant, or one deleted meanwhile
                continue
        adapters = [warmup_adapter(base, {"rank": rank, "target_modules": sorted(targets)})] if rank else []
        # Every known head shape resident first (the pool's buckets and generation final), then warm.
        plan = base.head_plan([(0, 0, h) for h in heads_by_shape.values()], 1) if heads_by_shape else None
        loop = asyncio.get_running_loop()
        for (layout, expert), (one, ads, pooled, other) in variants.items():
            with_heads = [plan] if (pooled and plan is not None) else []
            without = [None] if (expert or other or not with_heads) else []
            for variant in ([], adapters) if ads else ([],):
                for heads_plan in with_heads + without:
                    try:
                        await loop.run_in_executor(self._forward_pool, self._warm, one, None, variant, expert,
                                                   heads_plan)
                    except Exception as exc:  # a warm-up is an optimisation: the variant warms at its first group
                        self.log.warning("warm-up of a layout failed", layout=str(layout), adapted=bool(variant),
                                         expert=expert, heads=heads_plan is not None, error=str(exc))

    def warm_sizes(self) -> list[int]:
        """The capture sizes a group can be padded to: up to the first >= max_batch_size."""
        cap = next((c for c in CAPTURE_SIZES if c >= self.icfg.max_batch_size), CAPTURE_SIZES[-1])
        return [c for c in CAPTURE_SIZES if c <= cap]

    def _warm(self, packed: Any, ready: Any = None, adapters: list[Any] | None = None, kv: bool = False,
              plan: Any = None) -> None:
        """On the forward thread: run the base at every capture size for ``packed``'s layout
        once (captures, compiles), unless done: frozen, or with ``adapters`` (LoRA adapters made
        resident first; the graphs of their pool generation serve any mix of them), with the
        prefix-KV outputs when ``kv``, with the heads inside when ``plan`` (a head-pool plan: its
        generation's graphs serve any mix of resident heads). Its time is nobody's: not metered."""
        import torch

        from models import VLABatch
        from models.lora import Segment

        base = self.heads.base
        generation = None
        if adapters:
            generation = base.lora_generation(adapters)
            if generation is None:
                return  # such groups take the plain forward: nothing to capture
        key = (packed.key.layout, generation, kv, plan.generation if plan is not None else None)
        if key in self._warmed:
            return
        started = time.perf_counter()
        if ready is not None:
            torch.cuda.current_stream(packed.device).wait_event(ready)
        one = packed.index(slice(0, 1))
        with torch.inference_mode():
            for n in self.warm_sizes():
                heads = None if plan is None else dataclasses.replace(
                    plan, idx=[torch.zeros(n, dtype=torch.int64) for _ in plan.idx])  # any index: same graph
                base.encode(VLABatch.cat([one] * n), inference=True, prefix_kv=kv, heads=heads,
                            adapters=[Segment(0, n, adapters[0])] if adapters else None)
        if packed.device.type == "cuda":
            torch.cuda.synchronize(packed.device)
        self._warmed.add(key)
        took = time.perf_counter() - started
        self.warmup_s += took
        self.log.info("warmed a layout", sizes=self.warm_sizes(), seconds=round(took, 2), adapted=generation,
                      kv=kv, heads=key[3], layouts=self.warmed_layouts())

    def warmed_layouts(self) -> int:
        return len({key[0] for key in self._warmed})

    def _prepare(self, group: list[Pending], started: float) -> tuple[list[Any], list[int], Any, Any]:
        """CPU stage: drop requests whose caller gave up, canonicalise each slot's rows in one
        call (a bad request gets its own error, never its group's), pack one batch.

        On CUDA this stage runs on its own stream: a host-to-device copy on the forward's
        stream would queue behind the running forward and stall this thread until it ends,
        which serialises the pipeline. The forward waits on the returned event instead."""
        from models import VLABatch

        stamps = group[0].stamps if group and group[0].stamps is not None else {}
        stamps["prep_start"] = now_ns()
        results: list[Any] = [None] * len(group)
        by_slot: dict[int, list[int]] = {}
        for i, p in enumerate(group):
            if started > p.expires:
                continue  # every caller (the first and any retry) has given up: no work for it
            by_slot.setdefault(id(p.slot), []).append(i)
        device = self.heads.base.device
        stream = side_stream(device)
        live: list[int] = []
        parts: list[Any] = []
        with on_stream(stream):
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
        stamps["prep_end"] = now_ns()
        return results, live, packed, ready

    @staticmethod
    def _canonicalise(group: list[Pending], rows: list[int], results: list[Any], device: Any
                      ) -> tuple[list[int], Any]:
        """One slot's rows in one preprocessor call; if any is bad, one by one to find it."""
        from models import InputError, Observation, VLABatch

        def obs(p: Pending) -> Any:
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
                results[i] = ErrorReply.from_exception(input_error(exc))
        return ok, (VLABatch.cat(parts) if parts else None)

    def _timed_forward(self, *args: Any) -> list[Any]:
        """`_forward`, its time added to ``busy_s`` (one forward thread: the device's busy time)."""
        started = time.perf_counter()
        try:
            return self._forward(*args)
        finally:
            self.busy_s += time.perf_counter() - started

    def _forward(self, group: list[Pending], results: list[Any], live: list[int], packed: Any,
                 ready: Any = None) -> list[Any]:
        """Device stage: one base forward for the group, then each (tenant, version) head;
        one host sync at the end, not one per head."""
        if not live:
            return results
        runs = slot_runs(group, live)
        kv = any(slot.head.needs_prefix_kv for _, _, slot in runs)
        # The group's heads inside the base's graph where they are all plain `mlp` heads
        # (models.heads.pool; None: they run after the forward, one tenant at a time).
        plan = None if kv else self.heads.base.head_plan([(a, b, slot.head) for a, b, slot in runs], len(packed))
        if self.warmup:
            # A variant first seen (layout; adapted, with its pool generation; prefix-KV
            # outputs; heads, with theirs): every capture size once, unmetered. Known variants
            # return at once.
            segments = lora_segments(group, live)
            self._warm(packed, ready, [seg.adapter for seg in segments], kv, plan)
        t0 = time.perf_counter()
        try:
            return self._forward_group(group, results, live, packed, ready, plan)
        finally:
            # Metered: the wall time of the device work (ended by a synchronize on CUDA),
            # charged to the group's tenants by their rows; padding rows (capture sizes) are
            # shared out with the rest, so the charges add up to the measured time.
            if packed.device.type == "cuda":
                import torch

                torch.cuda.synchronize(packed.device)
            busy_s = time.perf_counter() - t0
            rows: dict[tuple[str, str], int] = {}
            for i in live:
                req = group[i].req
                rows[(req.tenant, req.workload)] = rows.get((req.tenant, req.workload), 0) + 1
            answered: dict[tuple[str, str], int] = {}
            for i in live:
                if isinstance(results[i], PredictReply):
                    req = group[i].req
                    answered[(req.tenant, req.workload)] = answered.get((req.tenant, req.workload), 0) + 1
            self.meter.charge("infer", busy_s, rows, requests=answered)

    def _forward_group(self, group: list[Pending], results: list[Any], live: list[int], packed: Any,
                       ready: Any = None, plan: Any = None) -> list[Any]:
        import torch

        heads = self.heads
        assert heads is not None
        stamps = group[live[0]].stamps if group[live[0]].stamps is not None else {}
        stamps["fwd_start"] = now_ns()
        # One span per forward: the inferencer's busy timeline in the traces (examples/report.py),
        # linked to every request it serves (each request's own `predict.forward` is its child).
        links = [trace.Link(group[i].span.get_span_context()) for i in live if group[i].span is not None]
        with self.tracer.start_as_current_span("inferencer.forward", attributes={"nexus.group_size": len(live)},
                                               links=links), \
                torch.inference_mode():
            if ready is not None:
                current = torch.cuda.current_stream(packed.device)
                current.wait_event(ready)
                # Made on the side stream, read on this one: keep the allocator from reusing
                # the memory before this stream is done with it.
                packed.images_B_S_C_H_W.record_stream(current)
            # Action-expert tenants in the group: the same forward returns the per-layer KV cache.
            runs = slot_runs(group, live)
            feats = heads.base.encode(packed, inference=True, adapters=lora_segments(group, live),
                                      prefix_kv=any(slot.head.needs_prefix_kv for _, _, slot in runs), heads=plan)
            stamps["fwd_end"] = now_ns()
            outs = []
            if feats.head_actions is not None:  # the heads ran inside the forward's graph
                self.heads_in_forward += 1
                for k, (start, end, _) in enumerate(runs):
                    outs.append((live[start:end], feats.head_actions[plan.bucket_of_run[k]][start:end], None, None))
                runs = []
            for start, end, slot in runs:
                f = feats.split([start, end - start, len(feats) - end])[1]
                vla = packed.index(slice(start, end))
                head = slot.head
                log_prob = value = None
                if hasattr(head, "act"):
                    # Per row: requests of one tenant share this slice but each asked for
                    # its own mean (sample=False) or sampled action (sample=True).
                    deterministic = [not group[i].req.sample for i in live[start:end]]
                    actions, log_prob, value = head.act(f, vla, slot.generator, deterministic=deterministic)
                else:
                    actions = head.predict(f, vla, slot.generator)
                outs.append((live[start:end], actions, log_prob, value))
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
                        batch_size=len(live), request_id=p.req.request_id)
        stamps["head_end"] = now_ns()
        return results

    def _run_group(self, group: list[Pending], started: float) -> list[Any]:
        """Both stages in series (the benchmark's in-process ceiling uses this)."""
        return self._forward(group, *self._prepare(group, started))
