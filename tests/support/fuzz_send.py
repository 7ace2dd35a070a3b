"""Sending and judging of the fuzzing harness (tests/support/fuzzing.py): discover the targets
the live roles list, send cases (bounded concurrency, a timeout each) and judge each answer
against the op's documented reply types; publish intake specs and wait for their events; read a
role's RSS; warm the roles up."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack

from protocol import ops
from protocol.codec import EXT_TENSOR, packb
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import ErrorReply, PredictReply, PredictRequest, WorkloadEvent
from protocol.subjects import Names
from protocol.wire import decode
from tests.support.fuzz_types import (CONCURRENCY, ERROR_CODES, EXCLUDED_OPS, INTAKE, INTAKE_TIMEOUT_S, PREDICT,
                                      REPLY_TIMEOUT_S, Case, Outcome, Target)


# -- targets -------------------------------------------------------------------------------
async def discover(bus: Any, names: Names, roles: list[tuple[str, str]]) -> list[Target]:
    """Every op the live roles list in ``info``, plus instance info, predict and the intake."""
    from protocol.messages import InfoRequest, RoleInfo

    targets: list[Target] = []
    for role, instance in roles:
        info_op = ops.INFO.of(role)
        info = await bus.request(info_op.instance_subject(names, instance), InfoRequest(), RoleInfo, timeout_s=10)
        known = {o.name: o for o in ops.ops_of(role)}
        for op_name in info.ops:
            if op_name in EXCLUDED_OPS:
                continue
            if op_name not in known:
                raise AssertionError(f"{role} lists op {op_name!r} in info but protocol/ops.py has no such op")
            o = known[op_name]
            targets.append(Target(role, op_name, o.subject(names), o.request, o.replies))
        targets.append(Target(role, "info", info_op.instance_subject(names, instance), info_op.request,
                              info_op.replies, kind="instance"))
        if role == "inferencer":
            targets.append(Target(role, PREDICT, names.infer(info.extra["pool"]), PredictRequest, (PredictReply,),
                                  kind="predict"))
    targets.append(Target("master", INTAKE, names.workloads_submit, None, (WorkloadEvent,), kind="intake"))
    return targets


# -- sending and judging -------------------------------------------------------------------
def judge(case: Case, data: bytes | None, latency_s: float) -> Outcome:
    if data is None:
        if case.target.kind == "predict" and _caller_gave_up(case.payload):
            # Documented: a predict whose own timeout_s has passed is dropped unworked (its
            # caller stopped waiting). Counted apart, not a problem.
            return Outcome(case, "dropped_by_timeout_s", latency_s)
        return Outcome(case, "no_reply", latency_s, "no_reply", f"no reply within {REPLY_TIMEOUT_S:g} s")
    try:
        reply = decode(data)
    except ProtocolError as exc:
        return Outcome(case, "bad_reply", latency_s, "bad_reply", str(exc))
    if isinstance(reply, ErrorReply):
        if reply.code not in ERROR_CODES:
            return Outcome(case, "bad_reply", latency_s, "bad_reply", f"unknown error code {reply.code!r}")
        if reply.code == ErrorCode.INTERNAL:
            return Outcome(case, reply.code, latency_s, "internal", reply.message)
        return Outcome(case, reply.code, latency_s)
    if not isinstance(reply, case.target.replies):
        return Outcome(case, "bad_reply", latency_s, "bad_reply",
                       f"{type(reply).__name__}, not {[t.__name__ for t in case.target.replies]}")
    return Outcome(case, type(reply).KIND, latency_s)  # type: ignore[attr-defined]


def _caller_gave_up(payload: bytes) -> bool:
    try:
        req = decode(payload, PredictRequest)
    except ProtocolError:
        return False
    t = req.timeout_s
    return not (t > REPLY_TIMEOUT_S)  # nan, negative, or shorter than our own wait


async def send_cases(nc: Any, cases: list[Case], concurrency: int = CONCURRENCY) -> list[Outcome]:
    """Request-reply cases, ``concurrency`` at a time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(case: Case) -> Outcome:
        async with sem:
            started = time.monotonic()
            try:
                msg = await nc.request(case.target.subject, case.payload, timeout=REPLY_TIMEOUT_S)
                data = msg.data
            except Exception as exc:  # nats timeout / no responders: judged as no reply
                if type(exc).__name__ not in ("TimeoutError", "NoRespondersError"):
                    raise
                data = None
            return judge(case, data, time.monotonic() - started)

    return list(await asyncio.gather(*(one(c) for c in cases)))


def intake_workload_id(stream_seq: int) -> str:
    # Mirrors master/workloads.py `_intake_loop`: the id is derived from the stream sequence.
    return f"i{stream_seq:010d}"


async def send_intake(nc: Any, js: Any, names: Names, cases: list[Case]) -> list[Outcome]:
    """Publish specs with JetStream; each must be answered by a `rejected` WorkloadEvent."""
    events: dict[str, tuple[WorkloadEvent, float]] = {}

    async def on_event(msg: Any) -> None:
        try:
            ev = decode(msg.data, WorkloadEvent)
        except ProtocolError:
            return
        events.setdefault(ev.workload, (ev, time.monotonic()))

    sub = await nc.subscribe(names.workload_events_all, cb=on_event)
    try:
        sent: list[tuple[Case, str, float]] = []
        for case in cases:
            started = time.monotonic()
            ack = await js.publish(names.workloads_submit, case.payload, timeout=10)
            sent.append((case, intake_workload_id(ack.seq), started))
        deadline = time.monotonic() + INTAKE_TIMEOUT_S
        while time.monotonic() < deadline and any(w not in events for _, w, _ in sent):
            await asyncio.sleep(0.05)
    finally:
        await sub.unsubscribe()
    out = []
    for case, workload, started in sent:
        if workload not in events:
            out.append(Outcome(case, "no_reply", INTAKE_TIMEOUT_S, "no_reply",
                               f"no event for {workload} within {INTAKE_TIMEOUT_S:g} s"))
            continue
        ev, at = events[workload]
        if ev.kind != "rejected":
            out.append(Outcome(case, ev.kind, at - started, "bad_reply", f"spec was {ev.kind}: {ev.message}"))
        else:
            out.append(Outcome(case, "rejected", at - started))
    return out


async def run_plan(bus: Any, names: Names, cases: list[Case]) -> list[Outcome]:
    intake = [c for c in cases if c.target.kind == "intake"]
    ops = [c for c in cases if c.target.kind != "intake"]
    results = await send_cases(bus.nc, ops)
    if intake:
        results += await send_intake(bus.nc, bus.js, names, intake)
    return results


def rss_kib(pid: int) -> int:
    """Resident set size of a process, from /proc/<pid>/status (VmRSS, KiB); -1 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        pass
    return -1  # exited (a zombie has no VmRSS line either)


async def warm_up(nc: Any, targets: list[Target]) -> None:
    """One tensor-bearing request per role: decoding a tensor ext imports torch (about 180 MiB
    once) in a role that had not needed it, which would read as growth after the warm-up."""
    tensor = msgpack.ExtType(EXT_TENSOR, msgpack.packb(["float32", [1], b"\0" * 4], use_bin_type=True))
    data = packb({"kind": "info.request", "v": 1, "body": {"warm": tensor}})
    for t in targets:
        if t.kind == "instance":
            try:
                await nc.request(t.subject, data, timeout=REPLY_TIMEOUT_S)
            except Exception as exc:  # a dead role: its cases report it, one per request
                if type(exc).__name__ not in ("TimeoutError", "NoRespondersError"):
                    raise
