"""Monitor: aggregates heartbeats, health events and metrics; serves ``nexus status``.

Subscribes to ``<prefix>.health.heartbeat.>``, ``<prefix>.health.events.>`` and
``<prefix>.metrics.>``; answers ``<prefix>.monitor.status`` with a `ClusterStatus`: one row
per role instance (alive / dead / stopped, pid, uptime, last heartbeat) and the latest value
of every metric keyed ``<signal>.<scope>``.

Run: ``python -m actors.run monitor --nats-url nats://127.0.0.1:4222``
"""

from __future__ import annotations

import os
import time
from typing import Any

from actors.liveness import LivenessTable
from actors.runtime import Role, RoleConfig, op
from protocol.messages import ClusterStatus, HealthEvent, Heartbeat, Metric, StatusRequest
from protocol.wire import decode

RETAIN_S = 600.0


class Monitor(Role):
    name = "monitor"

    def __init__(self, cfg: RoleConfig) -> None:
        super().__init__(cfg)
        timeout = float(os.environ.get("NEXUS_HEALTH_TIMEOUT_S", 3 * cfg.heartbeat_interval_s))
        self.table = LivenessTable(timeout_s=timeout)
        self.metrics: dict[str, float] = {}

    async def setup(self) -> None:
        assert self.bus is not None
        nc = self.bus.nc
        await nc.subscribe(self.names.heartbeat_all, cb=self._on_heartbeat)
        await nc.subscribe(self.names.health_events_all, cb=self._on_health_event)
        await nc.subscribe(self.names.metrics_all, cb=self._on_metric)

    def info_extra(self) -> dict[str, Any]:
        return {"tracked_roles": len(self.table.entries), "metrics": len(self.metrics)}

    async def _on_heartbeat(self, msg: Any) -> None:
        try:
            self.table.observe(decode(msg.data, Heartbeat))
        except Exception as exc:
            self.log.warning("bad heartbeat", subject=msg.subject, error=str(exc))

    async def _on_health_event(self, msg: Any) -> None:
        try:
            ev = decode(msg.data, HealthEvent)
        except Exception as exc:
            self.log.warning("bad health event", subject=msg.subject, error=str(exc))
            return
        if ev.event == "role_down":
            self.table.mark_dead(ev.role, ev.instance)

    async def _on_metric(self, msg: Any) -> None:
        try:
            m = decode(msg.data, Metric)
        except Exception as exc:
            self.log.warning("bad metric", subject=msg.subject, error=str(exc))
            return
        self.metrics[f"{m.signal}.{m.scope}"] = m.value

    @op("status", StatusRequest, access="admin")
    async def status(self, req: StatusRequest) -> ClusterStatus:
        self.table.expire()
        self.table.forget_older_than(RETAIN_S)
        rows = self.table.statuses()
        if not req.include_dead:
            rows = [r for r in rows if r.state == "alive"]
        return ClusterStatus(roles=rows, metrics=dict(self.metrics), generated_at=time.time())
