"""Health manager: notices a role that stopped beating and says so on the bus.

Watches ``<prefix>.health.heartbeat.>``. A role silent for ``timeout_s`` (default 3 beats)
is declared dead: a `HealthEvent` ``role_down`` goes to ``<prefix>.health.events.<role>.<instance>``
(captured by a stream, so late readers see it too). A role that drains announces
``stopped`` in its last beat and gets ``role_stopped`` instead; one that beats again after
being declared dead gets ``role_recovered``.

Run: ``python -m actors.run health --nats-url nats://127.0.0.1:4222``
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from actors.liveness import Entry, LivenessTable
from actors.runtime import Role, RoleConfig, op
from protocol.messages import HealthEvent, HealthReport, HealthReportRequest, Heartbeat
from protocol.wire import decode

# Checks run 4x a second: detection latency is timeout + at most 0.25 s.
CHECK_INTERVAL_S = 0.25
# Dead and stopped entries are forgotten after this long.
RETAIN_S = 600.0


class HealthManager(Role):
    name = "health"

    def __init__(self, cfg: RoleConfig) -> None:
        super().__init__(cfg)
        timeout = float(os.environ.get("NEXUS_HEALTH_TIMEOUT_S", 3 * cfg.heartbeat_interval_s))
        self.table = LivenessTable(timeout_s=timeout)

    async def setup(self) -> None:
        assert self.bus is not None
        await self.bus.nc.subscribe(self.names.heartbeat_all, cb=self._on_heartbeat)
        self.spawn(self._check_loop(), "health-check")

    def info_extra(self) -> dict[str, Any]:
        return {"timeout_s": self.table.timeout_s, "tracked": len(self.table.entries)}

    async def _on_heartbeat(self, msg: Any) -> None:
        try:
            hb = decode(msg.data, Heartbeat)
        except Exception as exc:  # a bad beat is logged, never fatal
            self.log.warning("bad heartbeat", subject=msg.subject, error=str(exc))
            return
        entry, previous = self.table.observe(hb)
        if previous == "dead" and entry.state == "alive":
            await self._announce("role_recovered", entry, "heartbeats resumed")
        elif entry.state == "stopped" and previous != "stopped":
            await self._announce("role_stopped", entry, "drained and stopped")

    async def _check_loop(self) -> None:
        while True:
            for entry in self.table.expire():
                try:
                    await self._announce(
                        "role_down",
                        entry,
                        f"no heartbeat for {self.table.timeout_s:g} s (beats every {entry.last.interval_s:g} s)",
                    )
                except Exception as exc:  # broker hiccup: log it; the loop must keep watching
                    self.log.error("health event publish failed", error=str(exc))
            self.table.forget_older_than(RETAIN_S)
            await asyncio.sleep(CHECK_INTERVAL_S)

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

    @op("report", HealthReportRequest)
    async def report(self, req: HealthReportRequest) -> HealthReport:
        alive = [k for k, e in self.table.entries.items() if e.state == "alive"]
        dead = [k for k, e in self.table.entries.items() if e.state == "dead"]
        return HealthReport(alive=sorted(alive), dead=sorted(dead), timeout_s=self.table.timeout_s)
