"""The one NATS client wrapper that roles and the SDK share.

`Bus` connects with endless reconnect, encodes typed messages, puts W3C trace context in
the headers of every publish and request, and turns error replies back into exceptions.
Every request has a timeout; none waits forever::

    bus = await Bus.connect("nats://127.0.0.1:4222", name="sdk", prefix="nexus")
    info = await bus.call(ops.INFO.of("master"), InfoRequest())   # a RoleInfo
    env = await bus.call(ops.ENV_STEP, step, instance=session.worker)

`call` takes an op of the one table (`protocol.ops`), which gives the subject and the reply
type; `request` is for subjects outside it (predictions, the supervisor) and for tests that
send a raw or wrong message on purpose.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import nats
import structlog
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from transport.trace_api import hop_name, inject, messaging, nexus_attrs, reply_link
from transport.creds import Credentials, redact_url, strip_userinfo, url_creds
from protocol.errors import PayloadTooLarge, RequestTimeout, Unauthenticated, Unavailable
from protocol.messages import ErrorReply, ok_or_raise
from protocol.ops import Op
from protocol.subjects import Names
from protocol.policy import MASTER_OUTAGE, RetryPolicy
from protocol.wire import decode, encode

T = TypeVar("T")

DEFAULT_REQUEST_TIMEOUT_S = 10.0
# JetStream API calls (stream / KV / consumer management) of every role. nats.py's default is
# 5 s, which a 2-core machine starting six roles at once has been seen to exceed (a master's
# start-up KV listing timed out and the master exited).
JS_API_TIMEOUT_S = 15.0


def _is_auth_refusal(reason: str) -> bool:
    """A connect error that is the server refusing the login (not a lost server)."""
    low = reason.lower()
    # 'Authentication Timeout' is the server giving up on a client too slow to finish its
    # CONNECT (a starved process signing its nonce): not a refusal, so nats.py tries again.
    if "authentication timeout" in low:
        return False
    return "authorization" in low or "authentication" in low


class Bus:
    def __init__(self, nc: NATS, tracer: trace.Tracer | None = None, names: Names | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=JS_API_TIMEOUT_S)
        self.tracer = tracer or trace.get_tracer("vla-nexus")
        # The deployment whose ops `call` reaches; None: connected without a prefix (`request` only).
        self.names = names

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        name: str,
        connect_timeout_s: float = 5.0,
        reconnect_forever: bool = True,
        tracer: trace.Tracer | None = None,
        creds: Path | Credentials | None = None,
        prefix: str | None = None,
        **callbacks: Any,
    ) -> Bus:
        """``creds``: a NATS credentials file (`transport.creds`) or its contents; without it,
        the file the URL names (``nats://host:4222?creds=PATH``), or none. ``prefix``: the
        deployment's (`protocol.subjects.Names`), needed by `call`."""
        names = Names(prefix) if prefix is not None else None
        if creds is None:
            creds = url_creds(url)
        who = creds if isinstance(creds, Credentials) or creds is None else Credentials.read(creds)
        if who is not None and who.expired():
            # The server would say only 'Authorization Violation': name the cause here.
            raise Unauthenticated(
                f"the credentials of user {who.user!r}{f' in {who.path}' if who.path else ''} expired at "
                f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(who.expires_at))}; issue new ones "
                f"(`nexus tenant create {who.user}`, which revokes these)",
                details={"expires_at": who.expires_at, "user": who.user})
        login = who.connect_options() if who is not None else {}
        refused: list[str] = []  # the server's reasons while connecting (bounded below)
        connecting = True
        # nats.py retries a refused login like a lost server, forever for a role
        # (max_reconnect_attempts=-1): a refusal while connecting ends the attempt instead, so
        # a role without valid credentials exits with one line rather than waiting forever.
        login_refused = asyncio.Event()
        caller_cb = callbacks.pop("error_cb", None)

        async def on_error(exc: Exception) -> None:
            # While connecting: the server's reason for refusing us (e.g. 'Authorization
            # Violation'), raised below as one line; without a callback nats.py prints a
            # traceback per attempt. After: the caller's callback, or logged.
            if connecting and _is_auth_refusal(str(exc)):
                if len(refused) < 8:
                    refused.append(str(exc))
                login_refused.set()
            elif connecting and (caller_cb is None or login_refused.is_set()):
                if len(refused) < 8:  # (after a refusal: its socket closing, not news)
                    refused.append(str(exc))
            elif caller_cb is not None:
                await caller_cb(exc)
            else:
                structlog.get_logger().warning("nats error", error=str(exc))

        nc = NATS()
        # "nats://a:4222,nats://b:4222" names the servers of a cluster.
        servers = [strip_userinfo(u.strip()) for u in url.split(",") if u.strip()]
        attempt = asyncio.ensure_future(nc.connect(
            servers,
            name=name,
            connect_timeout=connect_timeout_s,
            # A role rides out a broker restart; an SDK call can opt for failing fast.
            max_reconnect_attempts=-1 if reconnect_forever else 3,
            reconnect_time_wait=0.5,
            allow_reconnect=True,
            error_cb=on_error,
            **login,
            **callbacks,
        ))
        refusal = asyncio.ensure_future(login_refused.wait())
        try:
            await asyncio.wait({attempt, refusal}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            refusal.cancel()
        try:
            if not attempt.done():  # refused: stop nats.py's retries, drop its socket
                attempt.cancel()
                await asyncio.gather(attempt, return_exceptions=True)
                await nc.close()
                raise OSError(refused[0] if refused else "login refused")
            attempt.result()
            if not nc.is_connected:
                # nats.py returns from connect() when the server hangs up mid-handshake (its
                # PING answered by neither PONG nor -ERR): not a connection, say so.
                await nc.close()
                raise OSError(f"the server closed the connection during the handshake ({nc.last_error or 'no reason given'})")
        except Exception as exc:  # nats raises OSError / NoServersError / TimeoutError
            reasons = [str(exc), *refused]
            auth = next((r for r in reasons if _is_auth_refusal(r)), None)
            if auth is not None:
                whom = f"user {who.user!r}" if who is not None else "no credentials"
                reason = auth.removeprefix("nats: ").strip("'")
                raise Unauthenticated(
                    f"NATS at {redact_url(url)} refused the connection ({whom}): {reason}; "
                    "pass valid credentials with --creds FILE or NEXUS_CREDS",
                    details={"reason": reason}) from None
            raise Unavailable(f"cannot connect to NATS at {redact_url(url)}: {exc}") from None
        connecting = False
        return cls(nc, tracer, names)

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload

    def _check_size(self, subject: str, data: bytes) -> None:
        if len(data) > self.nc.max_payload:
            raise PayloadTooLarge(
                f"message for {subject} is {len(data)} bytes, over the server's max payload "
                f"of {self.nc.max_payload} bytes; send it in chunks or through the object store",
                details={"size": len(data), "max_payload": self.nc.max_payload},
            )

    async def publish(self, subject: str, msg: Any, *, span_name: str | None = None) -> None:
        data = encode(msg)
        self._check_size(subject, data)
        with self.tracer.start_as_current_span(
            span_name or hop_name(subject, "publish"),
            kind=SpanKind.PRODUCER,
            attributes={**messaging(subject, "send"), **nexus_attrs(msg)},
        ):
            await self.nc.publish(subject, data, headers=inject() or None)

    async def request(
        self,
        subject: str,
        msg: Any,
        expect: type[T] | tuple[type, ...],
        *,
        timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        raw: bytes | None = None,
    ) -> T:
        """Send ``msg`` (or ``raw`` bytes) and return the decoded reply of type ``expect``.

        An error reply raises the matching `NexusError`; no responder raises `Unavailable`;
        no answer within ``timeout_s`` raises `RequestTimeout`.
        """
        data = raw if raw is not None else encode(msg)
        self._check_size(subject, data)
        allowed = (expect if isinstance(expect, tuple) else (expect,)) + (ErrorReply,)
        with self.tracer.start_as_current_span(
            hop_name(subject, "request"),
            kind=SpanKind.CLIENT,
            attributes={**messaging(subject, "send"), **nexus_attrs(msg)},
        ) as span:
            try:
                reply = await self.nc.request(subject, data, timeout=timeout_s, headers=inject() or None)
            except NoRespondersError:
                raise Unavailable(f"no role is serving {subject}", details={"subject": subject}) from None
            except (NatsTimeoutError, asyncio.TimeoutError):
                raise RequestTimeout(
                    f"no reply on {subject} within {timeout_s:g} s",
                    details={"subject": subject, "timeout_s": timeout_s},
                ) from None
            reply_link(span, reply.headers)
            result = decode(reply.data, allowed)
            if isinstance(result, ErrorReply):
                span.set_attribute("nexus.error_code", result.code)
            return ok_or_raise(result)

    async def call(self, op: Op, msg: Any, *, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                   instance: str | None = None) -> Any:
        """`request` ``op`` (`protocol.ops`) with ``msg``: on the role-wide subject (one instance
        of the role answers), or on ``instance``'s own; the reply is decoded as the op's."""
        if self.names is None:
            raise TypeError(f"call({op.role}.{op.name}): this Bus knows no deployment prefix; "
                            "connect with Bus.connect(..., prefix=PREFIX)")
        if not isinstance(msg, op.request):
            raise TypeError(f"call({op.role}.{op.name}): the request is a {type(msg).__name__}, "
                            f"the op takes a {op.request.__name__}")
        subject = op.subject(self.names) if instance is None else op.instance_subject(self.names, instance)
        return await self.request(subject, msg, op.reply, timeout_s=timeout_s)

    async def close(self) -> None:
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=5.0)
            except (asyncio.TimeoutError, nats.errors.ConnectionClosedError):
                await self.nc.close()


async def retry(fn, *args, policy: RetryPolicy, on_retry=None,
                retry_on: tuple[type[BaseException], ...] = (Unavailable, RequestTimeout),
                transient: Callable[[BaseException], bool] | None = None, **kwargs):
    """Call ``fn`` until it stops failing with one of ``retry_on`` (and, given ``transient``,
    one it says is transient), under ``policy``.

    Only for calls that are safe to repeat (idempotent updates, puts carrying a seq or an
    idempotency key, reads). A server's ``retry_after_s`` hint is honoured. The last error is
    raised once the policy's deadline or attempts are spent.
    """
    deadline = time.monotonic() + policy.deadline_s if policy.deadline_s else float("inf")
    attempt = 0
    while True:
        try:
            return await fn(*args, **kwargs)
        except retry_on as exc:
            if transient is not None and not transient(exc):
                raise
            attempt += 1
            hint = float(getattr(exc, "details", {}).get("retry_after_s", 0.0) or 0.0)
            wait = policy.delay(attempt, hint)
            if (policy.attempts and attempt >= policy.attempts) or time.monotonic() + wait > deadline:
                raise
            if on_retry is not None:
                on_retry(exc)
            await asyncio.sleep(wait)


def jetstream_errors() -> tuple[type[BaseException], ...]:
    """What a JetStream call (KV, object store, stream API, publish) raises while its stream has
    no leader or the node it asked is gone: transient, worth another try."""
    from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

    return (NatsTimeoutError, asyncio.TimeoutError, NoStreamResponseError, ServiceUnavailableError)


# JetStream answers of code 503 that are final, not a leader election: 10077 is "stream store
# failed" (the stream at max_bytes with discard=new, a full disk). Retrying one only delays
# the caller's real error (`transport.layout.publish_tq` turns a full queue into `Busy`).
FINAL_JS_ERR_CODES = frozenset({10077})


def is_transient_js(exc: BaseException) -> bool:
    """Whether a `jetstream_errors` exception is worth another try."""
    return getattr(exc, "err_code", None) not in FINAL_JS_ERR_CODES


def is_broker_outage(exc: BaseException) -> bool:
    """Whether the broker, not the caller, failed a call (after its own retries): JetStream's
    timeouts and leaderless streams (not its final answers), `Bus.request`'s no-responder and
    timeout, a closed connection. Work cut short by one may be handed back and done again."""
    return (isinstance(exc, (*jetstream_errors(), Unavailable, RequestTimeout, nats.errors.ConnectionClosedError))
            and is_transient_js(exc))


async def js_retry(fn, *args, policy: RetryPolicy | None = None, **kwargs):
    """A JetStream call (KV, object store, stream API) that rides out a leader election: a
    lost node's streams have no leader for 5-7 s, and their calls time out meanwhile
    (`protocol.policy.STORE_WRITE`). Reads and idempotent writes only."""
    from protocol.policy import STORE_WRITE

    return await retry(fn, *args, policy=policy or STORE_WRITE, retry_on=jetstream_errors(),
                       transient=is_transient_js, **kwargs)


async def retry_through_outage(fn, *args, policy: RetryPolicy = MASTER_OUTAGE, on_retry=None, **kwargs):
    """Call ``fn`` again while its role is unreachable (no responder / timeout): a restarting
    master or inferencer takes seconds. Only for calls that are safe to repeat."""
    return await retry(fn, *args, policy=policy, on_retry=on_retry, **kwargs)
