"""The role runtime every process (master, trainer, inferencer, env, health, monitor) uses.
Each role lives in its own package beside this one (`actors/trainer/`, ...; the master in
`master/`); declaring, checking and serving ops is `actors/handlers.py`.

A role subclasses `Role`, sets ``name``, and serves its ops of the one op table
(`protocol.ops`: role, name, request and reply types, access) with `@op`::

    class Monitor(Role):
        name = "monitor"

        @op(ops.MONITOR_STATUS)
        async def status(self, req: StatusRequest) -> ClusterStatus: ...

A role whose handlers and the table's ops of its role disagree (a handler for an op not in
the table, or a table op without a handler) refuses to start, naming them.

The runtime then, in order:
  1. connects to NATS (reconnecting forever) and installs the process's tracer and logger;
  2. runs the role's `setup()`;
  3. subscribes ``<prefix>.<role>.*`` (queue group: one instance answers) and
     ``<prefix>.svc.<role>.<instance>.*`` (this instance only);
  4. registers in the services KV bucket and heartbeats every ``heartbeat_interval_s``;
  5. serves: each request runs in its own task; a bad request gets an `ErrorReply` and the
     role keeps serving; the caller (the account the broker asserts in ``Nats-Request-Info``)
     is checked against the op's declared ``access`` before its handler runs
     (`actors.identity`; a refusal is `permission_denied`);
  6. on SIGTERM/SIGINT (or a ``drain`` request) drains: stops taking requests, lets the
     in-flight ones finish, runs `on_drain()`, marks itself stopped, exits 0. A second
     signal exits at once with status 143.

Every role answers ``info``; every instance answers ``info`` and ``drain`` on its own
subject. Heavy compute must go through ``asyncio.to_thread`` so heartbeats keep flowing.

Background loops: ``self.spawn(self._loop, "name", critical=True, max_quiet_s=30)`` runs
the loop from its factory and starts it again (``LOOP_RESTART`` back-off) when it raises;
past that budget the process drains and exits with `EXIT_LOOP_FAILED`, so its supervisor
starts a clean one. A loop with ``max_quiet_s`` calls ``self.tick("name")`` (or
``await self.idle("name", seconds)``) each iteration; each heartbeat carries the seconds since
every such loop's last tick, and names the loops quiet past their limit as ``stalled``, which
the health manager treats as a dead role.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import structlog

from transport.creds import creds_from_env, redact_url
from transport.bus import Bus, js_retry
from actors.logs import configure_logging
from actors.handlers import Handler, OpServer, check_ops, op
from actors.tracing import setup_tracing, shutdown_tracing
from protocol.errors import (NexusError)
from protocol.messages import (
    DrainRequest,
    Heartbeat,
    InfoRequest,
    Metric,
    Ok,
    RoleInfo,
    RoleState,
    ServiceRecord,
)
from protocol import ops
from protocol.ops import Op
from protocol.policy import LOOP_HEALTHY_S, LOOP_RESTART, RetryPolicy
from protocol.settings import RoleSettings
from protocol.subjects import Names, check_token
from protocol.wire import encode

VERSION = "0.1.0"
EXIT_NOW_STATUS = 143  # 128 + SIGTERM, as a shell reports a process killed by SIGTERM
EXIT_LOOP_FAILED = 70  # EX_SOFTWARE: a critical loop spent its restart budget
# After a fatal loop failure the drain gets drain_timeout_s plus this; then the process exits
# anyway, so a drain stuck on the same fault cannot keep a broken process alive.
FATAL_EXIT_GRACE_S = 5.0
# After the drain, the teardown (cancelled tasks, bus close, trace flush, then asyncio.run
# joining its executor's threads) gets this long; a worker thread that never returns (a
# device call stuck in a forked child was seen) would otherwise keep a stopped process alive.
EXIT_TEARDOWN_GRACE_S = 20.0
_ENV_DEFAULTS = RoleSettings()


@dataclass
class RoleConfig:
    """Settings every role takes (CLI flags or NEXUS_* environment variables)."""

    # Defaults (and their reasons) live in protocol.settings.RoleSettings, with the variables.
    nats_url: str = _ENV_DEFAULTS.nats_url
    prefix: str = _ENV_DEFAULTS.prefix
    data_dir: Path = _ENV_DEFAULTS.data_dir
    instance: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    heartbeat_interval_s: float = _ENV_DEFAULTS.heartbeat_interval_s
    # Upper bound on the drain: in-flight work still running then is abandoned.
    drain_timeout_s: float = 60.0
    max_concurrency: int = _ENV_DEFAULTS.max_concurrency
    # Requests held at once (running + waiting for a concurrency slot); past it a request is
    # answered `Busy` at once, before any task is made for it. 0 = 4 x max_concurrency: enough
    # queue to keep every slot busy through a burst, short enough that a waiter is served
    # within a few handler times rather than piling up memory and timing out.
    max_pending: int = 0
    # The retry hint a `Busy` reply carries when the bound above is hit.
    busy_retry_after_s: float = 0.25
    log_level: str = "INFO"
    # Credentials file the role connects with (its own user's, DATA_DIR/role-creds/<role>.creds
    # from `nexus up`); None: the file the URL names (``?creds=``), or none without auth.
    creds: Path | None = None

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if self.creds is not None:
            self.creds = Path(self.creds)
        check_token("instance", self.instance)
        Names(self.prefix)  # validates the prefix
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s: must be > 0")
        if self.drain_timeout_s <= 0:
            raise ValueError("drain_timeout_s: must be > 0")
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency: must be >= 1")
        if self.max_pending == 0:
            self.max_pending = 4 * self.max_concurrency
        if self.max_pending < 1:
            raise ValueError(f"max_pending={self.max_pending}: must be >= 1 (0 = 4 x max_concurrency)")
        if not 0 < self.busy_retry_after_s <= 60:
            raise ValueError(f"busy_retry_after_s={self.busy_retry_after_s}: must be in (0, 60]")

    @classmethod
    def from_env(cls, **overrides: Any) -> RoleConfig:
        """The NEXUS_* variables of `RoleSettings` (raises `SettingsError`), then ``overrides``
        (CLI flags) where not None."""
        env = RoleSettings.from_env()
        kwargs: dict[str, Any] = {name: getattr(env, name) for name in (
            "nats_url", "prefix", "data_dir", "heartbeat_interval_s", "max_concurrency", "max_pending")}
        creds = creds_from_env()
        if creds is not None:
            kwargs["creds"] = creds
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kwargs)


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc; elsewhere the peak, from getrusage)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def device_memory_bytes(device: Any) -> int:
    """Memory in use on a torch device: allocated tensors on CUDA, the process RSS on a CPU
    device (there the device's memory is the process's)."""
    import sys

    torch = sys.modules.get("torch")  # never imported here: only a role that has torch asks
    if torch is not None and torch.cuda.is_available() and (device is None or str(device).startswith("cuda")):
        return int(torch.cuda.memory_allocated(device))  # None: the role's default, cuda when present
    return rss_bytes()


LoopFactory = Callable[[], Awaitable[Any]]


@dataclass
class LoopState:
    """A critical background loop: how to start it again, and when it last showed progress."""

    name: str
    factory: LoopFactory
    max_quiet_s: float | None
    last_tick: float = field(default_factory=time.monotonic)
    failures: int = 0  # in a row; reset once the loop ran LOOP_HEALTHY_S without failing
    starts: int = 0



class Role(OpServer):
    name: ClassVar[str] = ""
    # How a failed critical loop is started again; a role (or a test role) may name another.
    loop_restart: ClassVar[RetryPolicy] = LOOP_RESTART
    # The inference pool this instance serves (an inferencer sets it), carried on its beats.
    pool: str = ""

    # Classes whose ``@op`` methods this role serves besides its own: a role composed of parts
    # (the master) names them here, so the table check runs on the class, before any instance.
    part_types: ClassVar[tuple[type, ...]] = ()

    @classmethod
    def op_table(cls) -> tuple[Op, ...]:
        """The ops this role must serve: its role's in `protocol.ops`. Only a test role, whose
        ops are no part of the platform, returns its own."""
        return ops.ops_of(cls.name)

    def __init__(self, cfg: RoleConfig) -> None:
        if not self.name:
            raise TypeError(f"{type(self).__name__} must set a role name")
        self.cfg = cfg
        self.names = Names(cfg.prefix)
        self.instance = cfg.instance
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self.started_at = time.time()
        self.state: RoleState = "starting"
        self.log = configure_logging(self.name, self.instance, cfg.log_level)
        self.tracer = setup_tracing(self.name, self.instance, cfg.data_dir)
        self.bus: Bus | None = None
        check_ops(type(self))  # a role that disagrees with the table refuses to start
        # op name -> (op, bound handler); bound at `run` (a part exists once __init__ is done).
        self._ops: dict[str, tuple[Op, Handler]] = {}
        self._subs: list[Any] = []
        self._instance_sub: Any = None
        self._inflight: set[asyncio.Task] = set()
        self._background: set[asyncio.Task] = set()
        self._sem = asyncio.Semaphore(cfg.max_concurrency)
        self._pending = 0  # requests admitted by _on_request and not yet finished
        self.busy_refused = 0  # requests answered Busy by that bound
        self._stop = asyncio.Event()
        self._signals = 0
        self._seq = 0
        # The state last written to the services bucket (None: nothing yet, or the last write
        # failed): the heartbeat loop writes it again until it lands.
        self._registered_state: str | None = None
        self._registering = False
        self._loops: dict[str, LoopState] = {}
        self._exit_status = 0
        # Set by `run_role` only: a role run inside another process (a test) never exits it.
        self.exit_watchdog = False

    # -- hooks for subclasses ------------------------------------------------------------
    async def setup(self) -> None:
        """Acquire resources (models, KV handles, subscriptions of the role's own)."""

    async def on_drain(self) -> None:
        """Called after in-flight requests finished, before deregistering."""

    def info_extra(self) -> dict[str, Any]:
        """Role-specific facts added to the ``info`` reply."""
        return {}

    def heartbeat_gauges(self) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """Numbers each heartbeat carries for the monitor's series: role-level ones, and
        signal -> tenant -> value. Cheap (read counters, never compute); subclasses add to
        ``super()``'s. Every role reports its resident memory."""
        return {"memory_bytes": float(rss_bytes())}, {}

    # -- built-in ops --------------------------------------------------------------------
    @op(ops.INFO)
    async def _op_info(self, req: InfoRequest) -> RoleInfo:
        return RoleInfo(
            role=self.name,
            instance=self.instance,
            pid=self.pid,
            host=self.host,
            started_at=self.started_at,
            state=self.state,
            version=VERSION,
            ops=sorted(self._ops),
            in_flight=len(self._inflight),
            extra=self.info_extra(),
        )

    @op(ops.DRAIN)
    async def _op_drain(self, req: DrainRequest) -> Ok:
        self.log.info("drain requested", reason=req.reason)
        self.request_stop()
        return Ok(detail=f"{self.name}.{self.instance} draining")

    # -- helpers for subclasses ----------------------------------------------------------
    def spawn(
        self,
        coro_or_factory: Awaitable[Any] | LoopFactory,
        name: str,
        *,
        critical: bool = False,
        max_quiet_s: float | None = None,
    ) -> asyncio.Task:
        """Start a background task that is recorded, never fails in silence, and is cancelled on exit.

        One-shot (``critical=False``): a coroutine or a zero-argument factory; a failure is
        logged. Critical: a factory (``self._loop``, not ``self._loop()``), started again
        with back-off when it raises; past `loop_restart` the process exits non-zero. With
        ``max_quiet_s`` the loop must `tick` at least that often or heartbeats call it stalled.
        """
        if critical:
            if not callable(coro_or_factory):
                raise TypeError(f"spawn({name!r}, critical=True) needs a factory that returns a new "
                                "coroutine on each call (pass self._loop, not self._loop())")
            if max_quiet_s is not None and max_quiet_s <= 0:
                raise ValueError(f"spawn({name!r}): max_quiet_s must be > 0 or None")
            if name in self._loops:
                raise ValueError(f"spawn({name!r}): a critical loop of that name already runs")
            state = LoopState(name, coro_or_factory, max_quiet_s)
            self._loops[name] = state
            coro: Awaitable[Any] = self._supervise(state)
        else:
            coro = coro_or_factory() if callable(coro_or_factory) else coro_or_factory
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._background.add(task)

        def done(t: asyncio.Task) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self.log.error("background task failed", task=name, exc_info=t.exception())

        task.add_done_callback(done)
        return task

    def tick(self, name: str) -> None:
        """A critical loop says it made progress (call once per iteration)."""
        state = self._loops.get(name)
        if state is None:
            raise KeyError(f"tick({name!r}): no critical loop of that name; loops: {sorted(self._loops)}")
        state.last_tick = time.monotonic()

    async def idle(self, name: str, seconds: float) -> None:
        """Tick, then sleep: the wait between iterations of a loop counts as progress."""
        self.tick(name)
        await asyncio.sleep(seconds)

    def loop_ages(self) -> dict[str, float]:
        """Seconds since each watched critical loop's last tick."""
        now = time.monotonic()
        return {n: round(now - s.last_tick, 3) for n, s in self._loops.items() if s.max_quiet_s is not None}

    def stalled_loops(self) -> list[str]:
        """Watched loops quiet past their limit; none while not ready (loops wind down in a drain)."""
        if self.state != "ready":
            return []
        now = time.monotonic()
        return sorted(n for n, s in self._loops.items()
                      if s.max_quiet_s is not None and now - s.last_tick > s.max_quiet_s)

    async def _supervise(self, state: LoopState) -> None:
        policy = self.loop_restart
        while True:
            started = time.monotonic()
            state.last_tick, state.starts = started, state.starts + 1
            try:
                await state.factory()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if time.monotonic() - started >= LOOP_HEALTHY_S:
                    state.failures = 0
                state.failures += 1
                if state.failures > policy.attempts:
                    reason = (f"critical loop {state.name!r} failed {state.failures} times in a row "
                              f"(budget {policy.name}: {policy.attempts} restarts): {type(exc).__name__}: {exc}")
                    self.log.error("critical loop out of restarts: exiting", task=state.name,
                                   exit_status=EXIT_LOOP_FAILED, reason=reason, exc_info=exc)
                    self.fail(reason)
                    return
                delay = policy.delay(state.failures)
                self.log.error("critical loop failed: restarting", task=state.name, attempt=state.failures,
                               of=policy.attempts, restart_in_s=round(delay, 3), exc_info=exc)
                await asyncio.sleep(delay)
                continue
            # A critical loop runs until cancelled or the role stops; one that returns before is
            # over, and says so loudly.
            log = self.log.warning if self.state == "ready" and not self._stop.is_set() else self.log.info
            log("critical loop returned; not restarted", task=state.name)
            self._loops.pop(state.name, None)
            return

    def fail(self, reason: str) -> None:
        """Stop this process with `EXIT_LOOP_FAILED`: drain (bounded), then exit non-zero."""
        self._exit_status = EXIT_LOOP_FAILED
        self.request_stop()
        # The drain may hang on the same fault; the process still exits, and says why.
        loop = asyncio.get_running_loop()
        loop.call_later(self.cfg.drain_timeout_s + FATAL_EXIT_GRACE_S, self._exit_hard, reason)

    def _exit_hard(self, reason: str) -> None:
        self.log.error("drain after a fatal failure did not finish: exiting now", reason=reason,
                       exit_status=EXIT_LOOP_FAILED)
        os._exit(EXIT_LOOP_FAILED)

    async def metric(self, signal_name: str, scope: str, value: float, **labels: str) -> None:
        assert self.bus is not None
        await self.bus.publish(
            self.names.metrics(signal_name, scope),
            Metric(signal=signal_name, scope=scope, value=float(value), at=time.time(), labels=labels),
        )

    def request_stop(self) -> None:
        self._stop.set()

    # -- lifecycle -----------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self._ops = self._collect_ops()  # the parts exist now (built in __init__)
        # 1. connect
        self.bus = await Bus.connect(
            self.cfg.nats_url,
            name=f"{self.name}.{self.instance}",
            tracer=self.tracer,
            creds=self.cfg.creds,
            prefix=self.cfg.prefix,
            disconnected_cb=self._on_disconnect,
            reconnected_cb=self._on_reconnect,
            error_cb=self._on_nats_error,
        )
        try:
            # 2. role resources
            await self.setup()
            # 3. subscriptions
            self._subs.append(
                await self.bus.nc.subscribe(
                    self.names.role_ops(self.name),
                    queue=self.names.queue_group(self.name),
                    cb=self._on_request,
                )
            )
            # Kept apart from self._subs: it stays up through the drain (below).
            self._instance_sub = await self.bus.nc.subscribe(
                self.names.instance_ops(self.name, self.instance), cb=self._on_request
            )
            # 4. register and beat
            self.state = "ready"
            await self._register()
            self.spawn(self._heartbeat_loop, "heartbeat", critical=True)
            self.log.info("role ready", pid=self.pid, nats_url=redact_url(self.cfg.nats_url), ops=sorted(self._ops))
            # 5. serve until asked to stop
            await self._stop.wait()
            # 6. drain
            await self._drain()
            return self._exit_status
        finally:
            if self.exit_watchdog:
                self._arm_exit_watchdog()
            for task in list(self._background):
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            await self.bus.close()
            shutdown_tracing()

    def _arm_exit_watchdog(self) -> None:
        """Exit with the role's status if the teardown outlives ``EXIT_TEARDOWN_GRACE_S``."""
        import sys
        import threading

        def overdue() -> None:
            stuck = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
            self.log.error("teardown did not finish: exiting now", grace_s=EXIT_TEARDOWN_GRACE_S,
                           threads=stuck, exit_status=self._exit_status)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(self._exit_status)

        timer = threading.Timer(EXIT_TEARDOWN_GRACE_S, overdue)
        timer.daemon = True  # a teardown that finishes in time exits without waiting for it
        timer.start()

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals == 1:
            self.log.info("signal received: draining", signal=sig.name)
            self._stop.set()
        else:
            # Second signal: the operator wants out now. Skip cleanup on purpose.
            self.log.warning("second signal: exiting now", signal=sig.name, in_flight=len(self._inflight))
            os._exit(EXIT_NOW_STATUS)

    async def _drain(self) -> None:
        assert self.bus is not None
        self.state = "draining"
        started = time.monotonic()
        self.log.info("draining", in_flight=len(self._inflight))
        await self._register(retry=False)
        await self._beat()
        # Stop taking new requests first; requests already delivered still get handled
        # (drain, not unsubscribe: the latter would drop delivered-but-unread requests, whose
        # callers would see only a timeout instead of a `draining` answer).
        # The instance's own subject stays up until the role's work is done: it answers `info`
        # (so the master's owner check sees a draining trainer finishing its round as alive,
        # not gone, and does not take its lease away mid-finish) and `Draining` to work ops.
        await self._drain_subs(self._subs)
        if self._inflight:
            done, pending = await asyncio.wait(set(self._inflight), timeout=self.cfg.drain_timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                self.log.error("drain timeout: abandoned requests", abandoned=len(pending))
        await self.on_drain()
        await self._drain_subs([self._instance_sub] if self._instance_sub is not None else [])
        self.state = "stopped"
        await self._register(retry=False)
        await self._beat()
        await self.bus.nc.flush(timeout=2)
        self.log.info("stopped", drain_s=round(time.monotonic() - started, 3))

    async def _drain_subs(self, subs: list[Any]) -> None:
        for sub in subs:
            try:
                await sub.drain()
            except Exception as exc:  # connection may be gone; nothing to unsubscribe then
                self.log.warning("unsubscribe failed", error=str(exc))

    # -- registration and heartbeat ------------------------------------------------------
    async def _register(self, retry: bool = True) -> None:
        """``retry=False`` (drain, stop): one attempt, so a stop with the broker gone is not
        held up by the retries; the heartbeats say the same."""
        assert self.bus is not None
        record = ServiceRecord(
            role=self.name,
            instance=self.instance,
            pid=self.pid,
            host=self.host,
            started_at=self.started_at,
            state=self.state,
            version=VERSION,
            updated_at=time.time(),
        )
        try:
            # Through a leader election (a NATS node lost: the services stream has no leader
            # for seconds): a role started then stayed unregistered for good, so nothing saw
            # its replacement ready (found by the default suite's chaos run, issue 24).
            call = js_retry if retry else _once
            kv = await call(self.bus.js.key_value, self.names.kv_services)
            await call(kv.put, Names.service_key(self.name, self.instance), encode(record))
            self._registered_state = record.state
        except Exception as exc:  # broker down or bucket missing: keep running, say so
            # ... and write it again from the heartbeat loop: a replacement inferencer whose one
            # write fell into a NATS node's loss stayed unregistered for good, so nothing saw it
            # ready (the default suite's chaos run, stop 35).
            self._registered_state = None
            self.log.warning("service registration failed; retried with the heartbeats",
                             error=f"{type(exc).__name__}: {exc}")

    async def _reregister(self) -> None:
        """One more registration attempt (from the heartbeat loop); never two at once."""
        self._registering = True
        try:
            await self._register(retry=False)
            if self._registered_state is not None:
                self.log.info("service registered after retry", state=self._registered_state)
        finally:
            self._registering = False

    async def _beat(self) -> None:
        assert self.bus is not None
        self._seq += 1
        hb = Heartbeat(
            role=self.name,
            instance=self.instance,
            pid=self.pid,
            host=self.host,
            started_at=self.started_at,
            sent_at=time.time(),
            seq=self._seq,
            state=self.state,
            in_flight=len(self._inflight),
            interval_s=self.cfg.heartbeat_interval_s,
            loops=self.loop_ages(),
            loop_limits_s={n: s.max_quiet_s for n, s in self._loops.items() if s.max_quiet_s is not None},
            stalled=self.stalled_loops(),
            pool=self.pool,
        )
        try:
            hb.gauges, hb.tenant_gauges = self.heartbeat_gauges()
        except Exception as exc:  # a broken gauge must not stop the beat that says the role lives
            self.log.warning("heartbeat gauges failed", error=f"{type(exc).__name__}: {exc}")
        # Heartbeats are plain publishes without spans: one a second per role would bury
        # the traces worth reading.
        await self.bus.nc.publish(self.names.heartbeat(self.name, self.instance), encode(hb))

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self._beat()
            except Exception as exc:  # reconnecting: the next beat goes out after it
                self.log.warning("heartbeat failed", error=str(exc))
            if self._registered_state != self.state and self.state == "ready" and not self._registering:
                self.spawn(self._reregister(), "re-register")
            await asyncio.sleep(self.cfg.heartbeat_interval_s)

    # -- connection callbacks ------------------------------------------------------------
    async def _on_disconnect(self) -> None:
        if self.state != "stopped":  # the final drain disconnects on purpose
            self.log.warning("disconnected from NATS")

    async def _on_reconnect(self) -> None:
        self.log.info("reconnected to NATS")
        if self.state == "ready":
            self.spawn(self._register(), "re-register")

    async def _on_nats_error(self, exc: Exception) -> None:
        self.log.warning("nats error", error=str(exc))


async def _once(fn, *args):
    return await fn(*args)


def run_role(role_cls: type[Role], cfg: RoleConfig) -> int:
    """Process entry point: run one role until it drains; return the exit status."""
    # One torch / BLAS thread per process: with 2 cores, more threads fight each other.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    async def main() -> int:
        role = role_cls(cfg)
        role.exit_watchdog = True  # this process is the role's: it may end itself
        return await role.run()

    try:
        return asyncio.run(main())
    except NexusError as exc:
        structlog.get_logger().error("role failed to start", error=str(exc))
        return 1
