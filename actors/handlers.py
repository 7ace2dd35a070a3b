"""A role's ops: declaring a handler (`@op`), checking a role's handlers against its op table
(`check_ops`), and serving requests (`OpServer`, a mixin of `actors.runtime.Role`): the bound
on requests held, a task and a server span per request, the caller checked against the op's
access, and an `ErrorReply` for a bad request while the role goes on serving. What `OpServer`
uses of its role is `OpServerHost`, and nothing else (tests/actors/test_mixin_hosts.py checks).

    class Monitor(Role):
        @op(ops.MONITOR_STATUS)
        async def status(self, req: StatusRequest) -> ClusterStatus: ...
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from transport.auth import PLATFORM_ACCOUNT
from transport.bus import is_broker_outage
from actors.identity import Caller, authorize, caller_from_headers, check_reply, reset_caller, set_caller
from actors.logs import bound_request
from actors.tracing import extract, inject, messaging, nexus_attrs, trace_id_hex
from protocol.errors import (BACK_PRESSURE_CODES, Busy, Draining, InternalError, NexusError, PayloadTooLarge,
                             Unavailable, UnknownOp)
from protocol.messages import (
    ErrorReply,
)
from protocol import ops
from protocol.ops import Op
from protocol.policy import BROKER_RETRY_AFTER_S
from protocol.wire import decode, encode

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from protocol.messages import RoleState
    from transport.bus import Bus

Handler = Callable[[Any, Any], Awaitable[Any]]
# Ops an operator needs on a saturated role (inspect it, drain it): admitted up to twice
# max_pending, so a flood of ordinary requests cannot lock them out.
CONTROL_OPS = frozenset({ops.INFO.name, ops.DRAIN.name})


@dataclass(frozen=True)
class OpSpec:
    """An op of the table and the name of the method that serves it."""

    op: Op
    handler_name: str


def op(spec: Op) -> Callable[[Callable], Callable]:
    """Mark a coroutine method as the handler of ``spec`` (one of `protocol.ops`): its
    request type, reply type and access come from there."""
    if not isinstance(spec, Op):
        raise TypeError(f"@op takes an op of protocol.ops (e.g. @op(ops.MASTER_LEASE)), not {spec!r}")

    def wrap(fn: Callable) -> Callable:
        fn.__nexus_op__ = OpSpec(spec, fn.__name__)  # type: ignore[attr-defined]
        return fn

    return wrap


def op_sources(role_cls: type) -> list[tuple[type, dict[str, OpSpec]]]:
    """(class, its ``@op`` handlers by op name) for ``role_cls`` and each of its
    `Role.part_types`, each over its own MRO (a subclass's handler of an op replaces its
    base's)."""
    out = []
    for source in (role_cls, *getattr(role_cls, "part_types", ())):
        found: dict[str, OpSpec] = {}
        for klass in reversed(source.__mro__):
            for attr in vars(klass).values():
                spec = getattr(attr, "__nexus_op__", None)
                if spec is not None:
                    found[spec.op.name] = spec
        out.append((source, found))
    return out


def declared_ops(role_cls: type) -> dict[str, OpSpec]:
    """op name -> the `OpSpec` of each ``@op`` handler of ``role_cls``, its bases and its
    parts (`Role.part_types`)."""
    found: dict[str, OpSpec] = {}
    for _, specs in op_sources(role_cls):
        found.update(specs)
    return found


def check_ops(role_cls: type) -> dict[str, Op]:
    """The ops ``role_cls`` serves, bound to its role (op name -> `Op`), after checking its
    handlers against its table (`Role.op_table`): one handler per op, none outside it.
    Raises TypeError naming every mismatch."""
    table = {o.name: o for o in role_cls.op_table()}
    declared = declared_ops(role_cls)
    problems = []
    owners: dict[str, list[str]] = {}
    for source, specs in op_sources(role_cls):
        for name, spec in specs.items():
            owners.setdefault(name, []).append(f"{source.__name__}.{spec.handler_name}")
    problems += [f"op {name} has more than one handler ({', '.join(where)}): keep one"
                 for name, where in sorted(owners.items()) if len(where) > 1]
    for name, spec in sorted(declared.items()):
        served = spec.op.of(role_cls.name) if spec.op.role == ops.EVERY_ROLE else spec.op
        if name not in table:
            problems.append(f"handler {spec.handler_name} serves {spec.op.role}.{name}, which is not an op "
                            f"of role {role_cls.name!r} in protocol/ops.py (add it there)")
        elif served != table[name]:
            problems.append(f"handler {spec.handler_name} serves an op {spec.op.role}.{name} other than the "
                            "table's (another request, reply or access)")
    problems += [f"op {o.role}.{name} of the table has no handler (add an @op(ops...) method)"
                 for name, o in sorted(table.items()) if name not in declared]
    if problems:
        raise TypeError(f"{role_cls.__name__} (role {role_cls.name!r}) does not match its op table: "
                        + "; ".join(problems))
    return table


class RequestBounds(Protocol):
    """The part of a role's config (`actors.runtime.RoleConfig`) the request bound reads."""

    max_pending: int  # requests held at once (control ops: twice this); past it, Busy
    busy_retry_after_s: float  # the Busy reply's retry hint


class OpServerHost(Protocol):
    """What `OpServer` uses of the role it is mixed into, and nothing more (`actors.runtime.Role`
    is the host): its name, state and config, its bus, log and tracer, the bound ops, and the
    bookkeeping of the requests it holds."""

    name: ClassVar[str]
    instance: str
    state: RoleState  # draining / stopped: only control ops are served
    cfg: RequestBounds
    bus: Bus | None
    log: Any  # the role's structlog logger
    tracer: Tracer
    _ops: dict[str, tuple[Op, Handler]]  # op name -> (op, bound handler), bound at `Role.run`
    _sem: asyncio.Semaphore  # max_concurrency handlers at once (control ops skip it)
    _inflight: set[asyncio.Task]  # the request tasks (a drain waits for them)
    _pending: int
    busy_refused: int  # requests answered Busy by the bound


# To a type checker the mixin is its host (`self.cfg` has OpServerHost's type); at run time a
# plain class, so no stub of the protocol sits in `Role`'s MRO.
if TYPE_CHECKING:
    _Host = OpServerHost
else:
    _Host = object


class OpServer(_Host):
    # -- request dispatch (the role's state, bus, tracer and bounds are `Role`'s) ----------
    def parts(self) -> tuple[object, ...]:
        """The objects, one of each `part_types`, whose ``@op`` methods this role serves."""
        return ()

    def _collect_ops(self) -> dict[str, tuple[Op, Handler]]:
        table = check_ops(type(self))
        objects = (self, *self.parts())
        bound: dict[str, tuple[Op, Handler]] = {}
        for source, specs in op_sources(type(self)):
            obj = next((o for o in objects if isinstance(o, source)), None)
            if obj is None:
                raise TypeError(f"{type(self).__name__}.parts() returns no {source.__name__} (named in part_types)")
            bound.update({name: (table[name], getattr(obj, spec.handler_name)) for name, spec in specs.items()})
        return bound

    async def _on_request(self, msg: Msg) -> None:
        # The subscription calls us one message at a time; hand each request to its own
        # task so a slow op never delays the next one. The bound comes first: past it the
        # caller hears Busy now (and retries later or elsewhere) and no task is made, so a
        # flood costs one small reply per message, never memory.
        op_name = msg.subject.rsplit(".", 1)[-1]
        limit = self.cfg.max_pending * (2 if op_name in CONTROL_OPS else 1)
        if self._pending >= limit:
            self.busy_refused += 1
            if msg.reply:
                await self._respond(msg, ErrorReply.from_exception(Busy(
                    f"{self.name}.{self.instance} holds {self._pending} requests (max_pending={self.cfg.max_pending}); "
                    "retry later or on another instance",
                    details={"retry_after_s": self.cfg.busy_retry_after_s, "max_pending": self.cfg.max_pending})))
            return
        self._pending += 1
        task = asyncio.ensure_future(self._handle(msg))
        self._inflight.add(task)
        task.add_done_callback(self._request_done)

    def _request_done(self, task: asyncio.Task) -> None:
        self._inflight.discard(task)
        self._pending -= 1

    async def _handle(self, msg: Msg) -> None:
        op_name = msg.subject.rsplit(".", 1)[-1]
        parent = extract(msg.headers, where=f"{self.name}.{op_name}")
        # Control ops skip the concurrency slots: an operator can inspect or drain a role
        # whose every slot is held by slow requests (their count is bounded in _on_request).
        async with (contextlib.nullcontext() if op_name in CONTROL_OPS else self._sem):
            with self.tracer.start_as_current_span(
                f"{self.name}.{op_name}",
                context=parent,
                kind=SpanKind.SERVER,
                attributes={
                    **messaging(msg.subject, "process"),
                    "nexus.role": self.name,
                    "nexus.instance": self.instance,
                },
            ) as span:
                tenant = None
                with bound_request(op=op_name, trace_id=trace_id_hex()):
                    try:
                        reply = await self._dispatch(op_name, msg.data, caller_from_headers(msg.headers))
                        tenant = getattr(reply, "tenant", None)
                    except NexusError as exc:
                        span.set_attribute("nexus.error_code", exc.code.value)
                        if exc.code.value in BACK_PRESSURE_CODES:
                            # Expected and retried by the caller: not an error span, and at
                            # debug, so the role's log is not flooded with normal waits.
                            span.set_attribute("nexus.back_pressure", True)
                            self.log.debug("request deferred", code=exc.code.value, error=exc.message)
                        else:
                            span.set_status(Status(StatusCode.ERROR, exc.message))
                            self.log.info("request rejected", code=exc.code.value, error=exc.message)
                        reply = ErrorReply.from_exception(exc)
                    except Exception as exc:
                        span.record_exception(exc)
                        span.set_status(Status(StatusCode.ERROR, str(exc)))
                        if is_broker_outage(exc):  # (Unavailable and RequestTimeout were answered above)
                            # The broker, not the request, failed (a stream without a leader
                            # past the handler's own retries): the caller is told to try
                            # again, as for a restarting role, not handed an internal error.
                            self.log.warning("request hit a broker outage", error=f"{type(exc).__name__}: {exc}")
                            reply = ErrorReply.from_exception(Unavailable(
                                f"{self.name} could not reach JetStream on {op_name} "
                                f"({type(exc).__name__}: {exc}); retry",
                                details={"op": op_name, "retry_after_s": BROKER_RETRY_AFTER_S}))
                        else:
                            # A bug in one handler must not take the role down: reply and go on.
                            self.log.error("request failed", exc_info=exc)
                            reply = ErrorReply.from_exception(
                                InternalError(f"{self.name} failed on {op_name}: {type(exc).__name__}: {exc}"))
                    if tenant:
                        span.set_attribute("nexus.tenant", tenant)
                    if msg.reply:
                        await self._respond(msg, reply)

    async def _dispatch(self, op_name: str, data: bytes, caller: Caller | None = None) -> Any:
        entry = self._ops.get(op_name)
        if entry is None:
            raise UnknownOp(
                f"{self.name} has no op {op_name!r}; known ops: {sorted(self._ops)}",
                details={"op": op_name},
            )
        if self.state in ("draining", "stopped") and op_name not in CONTROL_OPS:
            raise Draining(f"{self.name}.{self.instance} is draining; retry on another instance")
        spec, handler = entry
        req = decode(data, spec.request)
        # The broker-asserted caller, checked once here for every op (actors.identity);
        # handlers of `checked` ops find it in current_caller().
        caller = caller or Caller(PLATFORM_ACCOUNT)
        req = authorize(caller, op_name, spec.access, req)
        trace.get_current_span().set_attributes(nexus_attrs(req))
        tenant = getattr(req, "tenant", None)
        token = set_caller(caller)
        try:
            with bound_request(tenant=tenant if isinstance(tenant, str) else None):
                reply = await handler(req)
        finally:
            reset_caller(token)
        check_reply(caller, op_name, reply)
        return reply

    async def _respond(self, msg: Msg, reply: Any) -> None:
        try:
            data = encode(reply)
        except NexusError as exc:
            data = encode(ErrorReply.from_exception(exc))
        assert self.bus is not None
        if len(data) > self.bus.max_payload:
            # The server would drop it and the caller would only see a timeout: say why.
            data = encode(ErrorReply.from_exception(PayloadTooLarge(
                f"the reply is {len(data)} bytes, over the server's max payload of {self.bus.max_payload}; "
                "ask for less at once", details={"size": len(data), "max_payload": self.bus.max_payload})))
        try:
            # The reply carries this server span's context (msg.respond would echo the caller's).
            await self.bus.nc.publish(msg.reply, data, headers=inject() or None)
        except Exception as exc:  # the requester's connection may be gone
            self.log.warning("reply failed", error=str(exc))
