"""Health manager: notices a dead, hung or stalled role, says so on the bus, and has it restarted.

Watches ``<prefix>.health.heartbeat.>``. A role is declared dead when it is silent for
``timeout_s`` (default 3 beats: gone or hung) or when its beat lists a critical loop as
stalled (quiet past the loop's own limit). Then, in order:
  1. a `HealthEvent` ``role_down`` goes to ``<prefix>.health.events.<role>.<instance>``
     (captured by a stream, so late readers see it too); the reason names the silence or the
     loop; the master releases that role's leases and rollouts on it;
  2. a role that went silent is probed once (its ``info`` op, `HUNG_PROBE_TIMEOUT_S`): one that
     answers was only slow to beat (a loaded host) and is not killed;
  3. a `RestartRequest(mode="kill")` goes to the local supervisor (``<prefix>.supervisor.restart``),
     at most `HEALTH_RESTART` times a minute per role. No supervisor (compose, a test) is
     logged: there the container's restart policy restarts the process.
A role that drains announces ``stopped`` in its last beat and gets ``role_stopped`` (no
restart); one that beats again after being declared dead gets ``role_recovered``.

With NEXUS_SCALER on it also scales env workers, inferencers (per pool: an inferencer's beat
names the base it serves) and trainers (`actors/health/scaler.py`) from the same beats: each decision
is a `ScaleDecision` event on ``<prefix>.scale.decisions.<role>`` (before, then with its
outcome) and a `ScaleRequest` to the supervisor, which keeps the bounds and drains what goes
(docs/scaling.md).

Run: ``python -m actors.run health --nats-url nats://127.0.0.1:4222``
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from actors.liveness import Entry, LivenessTable
from actors.health.config import HealthConfig
from actors.health.scaler import RateWindow, Scaler, pool_signals_from_beats, signals_from_beats
from actors.runtime import Role, RoleConfig, op
from protocol import ops
from protocol.errors import NexusError, Unavailable
from protocol.messages import (
    HealthEvent,
    HealthReport,
    HealthReportRequest,
    Heartbeat,
    InfoRequest,
    Ok,
    RestartRequest,
    ScaleDecision,
    ScaleRequest,
)
from protocol.policy import HEALTH_RESTART, HUNG_PROBE_TIMEOUT_S, RESTART_REQUEST_TIMEOUT_S, SCALER
from protocol.scaling import SCALABLE
from protocol.wire import decode

# Checks run 4x a second: detection latency is timeout + at most 0.25 s.
CHECK_INTERVAL_S = 0.25
# The check loop ticks every CHECK_INTERVAL_S; quiet for this long, it is stalled.
CHECK_MAX_QUIET_S = 10.0
# Dead and stopped entries are forgotten after this long.
RETAIN_S = 600.0
# The scaler's last decisions kept for `info` (with their outcomes).
DECISIONS_KEPT = 32


class HealthManager(Role):
    name = "health"

    def __init__(self, cfg: RoleConfig, hcfg: HealthConfig | None = None) -> None:
        super().__init__(cfg)
        self.hcfg = hcfg or HealthConfig.from_env()
        timeout = self.hcfg.health.timeout_s(cfg.heartbeat_interval_s)
        self.table = LivenessTable(timeout_s=timeout)
        self.restarts: dict[str, deque] = {}  # role -> monotonic times of restart requests
        self.restart_requests = 0
        scale = self.hcfg.scale
        self.scaler: Scaler | None = Scaler(SCALER, scale.parsed()) if scale.scaler else None
        self.decisions: deque[ScaleDecision] = deque(maxlen=DECISIONS_KEPT)
        self._scaling: set[tuple[str, str]] = set()  # (role, pool)s whose scale request is in flight

    async def setup(self) -> None:
        assert self.bus is not None
        await self.bus.nc.subscribe(self.names.heartbeat_all, cb=self._on_heartbeat)
        self.spawn(self._check_loop, "health-check", critical=True, max_quiet_s=CHECK_MAX_QUIET_S)
        if self.scaler is not None:
            self.spawn(self._scale_loop, "scaler", critical=True, max_quiet_s=4 * SCALER.every_s + CHECK_MAX_QUIET_S)

    def info_extra(self) -> dict[str, Any]:
        return {"timeout_s": self.table.timeout_s, "tracked": len(self.table.entries),
                "restart_requests": self.restart_requests,
                "scaler": {"on": self.scaler is not None,
                           "decisions": [{"role": d.role, "pool": d.pool, "from": d.from_count, "to": d.to_count,
                                          "reason": d.reason, "outcome": d.outcome, "at": d.at}
                                         for d in self.decisions]}}

    # -- scaler ----------------------------------------------------------------------------
    async def _scale_loop(self) -> None:
        assert self.scaler is not None
        # The rates (busy fraction, step latency, queue wait) are taken from an earlier beat of
        # each instance, about SCALER.rate_s old, to its newest.
        rates = RateWindow(SCALER.rate_s)
        while True:
            beats = [e.last for e in self.table.entries.values() if e.state == "alive"]
            # A role with a request in flight is left out: its count is changing under it.
            busy = {role for role, _ in self._scaling}
            counts = {r: sum(1 for hb in beats if hb.role == r) for r in SCALABLE if r not in busy}
            now = time.monotonic()
            before = rates.look(now, beats)
            # Inferencers per pool (their beats name it): a starved pool gets one of its own.
            pools = pool_signals_from_beats(beats, before)
            for d in self.scaler.decide(now, counts, signals_from_beats(beats, before), pools=pools):
                self._scaling.add((d.role, d.pool))
                self.spawn(self._apply(d), f"scale-{d.role}" + (f"-{d.pool}" if d.pool else ""))
            await self.idle("scaler", SCALER.every_s)

    async def _apply(self, d: ScaleDecision) -> None:
        """Announce ``d``, ask the supervisor for it, announce its outcome."""
        assert self.bus is not None
        try:
            self.log.info("scale decision", target_role=d.role, pool=d.pool, from_count=d.from_count,
                          to_count=d.to_count, reason=d.reason)
            await self.bus.publish(self.names.scale_decision(d.role), d)
            req = ScaleRequest(role=d.role, count=d.to_count, reason=f"scaler: {d.reason}", pool=d.pool)
            try:
                ok = await self.bus.request(self.names.supervisor("scale"), req, Ok, timeout_s=SCALER.request_timeout_s)
                d.outcome = f"applied: {ok.detail}"
            except Unavailable:
                d.outcome = "no supervisor answers scale requests (compose / Kubernetes: KEDA scales there)"
            except NexusError as exc:
                d.outcome = f"refused: {exc.message}"
            self.log.info("scale outcome", target_role=d.role, pool=d.pool, to_count=d.to_count, outcome=d.outcome)
            self.decisions.append(d)
            await self.bus.publish(self.names.scale_decision(d.role), d)
        finally:
            self._scaling.discard((d.role, d.pool))

    async def _on_heartbeat(self, msg: Any) -> None:
        try:
            hb = decode(msg.data, Heartbeat)
        except Exception as exc:  # a bad beat is logged, never fatal
            self.log.warning("bad heartbeat", subject=msg.subject, error=str(exc))
            return
        entry, previous = self.table.observe(hb)
        if entry.state == "dead" and previous != "dead" and hb.stalled:
            await self._down(entry, LivenessTable.stall_reason(hb), probe=False)
        elif previous == "dead" and entry.state == "alive":
            await self._announce("role_recovered", entry, "heartbeats resumed")
        elif entry.state == "stopped" and previous != "stopped":
            await self._announce("role_stopped", entry, "drained and stopped")

    async def _check_loop(self) -> None:
        while True:
            for entry in self.table.expire():
                await self._down(
                    entry, f"no heartbeat for {self.table.timeout_s:g} s (beats every {entry.last.interval_s:g} s)")
            self.table.forget_older_than(RETAIN_S)
            await self.idle("health-check", CHECK_INTERVAL_S)

    async def _down(self, entry: Entry, reason: str, *, probe: bool = True) -> None:
        try:
            await self._announce("role_down", entry, reason)
        except Exception as exc:  # broker hiccup: log it; the restart request still goes out
            self.log.error("health event publish failed", error=str(exc))
        # Its own task: the supervisor's reply (a kill, a wait) must not hold up the checks.
        self.spawn(self._request_restart(entry.last, reason, probe), f"restart-{entry.last.instance}")

    async def _answers(self, hb: Heartbeat) -> bool:
        """Whether a silent instance still answers ``info`` (slow beats, not a hung process)."""
        assert self.bus is not None
        try:
            await self.bus.call(ops.INFO.of(hb.role), InfoRequest(), instance=hb.instance,
                                timeout_s=HUNG_PROBE_TIMEOUT_S)
        except NexusError:  # no responder (gone) or no answer in time (hung)
            return False
        return True

    async def _request_restart(self, hb: Heartbeat, reason: str, probe: bool) -> None:
        assert self.bus is not None
        if probe and await self._answers(hb):
            self.log.warning("silent role still answers info: not restarting it", target_role=hb.role,
                             target_instance=hb.instance)
            return
        history = self.restarts.setdefault(hb.role, deque())
        if not HEALTH_RESTART.spend(history, time.monotonic()):
            self.log.error("restart budget spent: not asking for another restart", target_role=hb.role,
                           target_instance=hb.instance, budget=HEALTH_RESTART.name,
                           max_restarts=HEALTH_RESTART.max_restarts, window_s=HEALTH_RESTART.window_s)
            return
        self.restart_requests += 1
        req = RestartRequest(role=hb.role, instance=hb.instance, mode="kill", reason=reason)
        try:
            ok = await self.bus.request(self.names.supervisor("restart"), req, Ok,
                                        timeout_s=RESTART_REQUEST_TIMEOUT_S)
        except Unavailable:
            self.log.info("no supervisor answers restart requests; the process's own restart policy "
                          "must restart it", target_role=hb.role, target_instance=hb.instance)
            return
        except NexusError as exc:
            self.log.warning("restart refused", target_role=hb.role, target_instance=hb.instance,
                             code=exc.code.value, error=exc.message)
            return
        self.log.info("restart done", target_role=hb.role, target_instance=hb.instance, detail=ok.detail)

    async def _announce(self, event: str, entry: Entry, reason: str) -> None:
        assert self.bus is not None
        hb = entry.last
        ev = HealthEvent(
            event=event,  # type: ignore[arg-type]
            role=hb.role,
            instance=hb.instance,
            pid=hb.pid,
            host=hb.host,
            last_heartbeat_at=entry.seen_wall,
            detected_at=time.time(),
            reason=reason,
        )
        log = self.log.warning if event == "role_down" else self.log.info
        log("health event", health_event=event, target_role=hb.role, target_instance=hb.instance, reason=reason)
        await self.bus.publish(self.names.health_event(hb.role, hb.instance), ev, span_name=f"health {event}")

    @op(ops.HEALTH_REPORT)
    async def report(self, req: HealthReportRequest) -> HealthReport:
        alive = [k for k, e in self.table.entries.items() if e.state == "alive"]
        dead = [k for k, e in self.table.entries.items() if e.state == "dead"]
        return HealthReport(alive=sorted(alive), dead=sorted(dead), timeout_s=self.table.timeout_s)
