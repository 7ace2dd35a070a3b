"""Monitor: aggregates heartbeats, health events, metrics and workload progress over time.

Subscribes to ``<prefix>.health.heartbeat.>``, ``<prefix>.health.events.>``,
``<prefix>.metrics.>`` and ``<prefix>.workloads.events.>`` and keeps the three families of
signals the design names as retained series (`actors.monitor.series`: a bounded ring per series,
capped series and tenants): control, learning and system (docs/observability.md lists each).

* ``<prefix>.monitor.status`` answers a `ClusterStatus` (``nexus status``): one row per role
  instance and the latest value of every metric keyed ``<signal>.<scope>``;
* ``<prefix>.monitor.snapshot`` answers a `MonitorSnapshot` (``nexus top``): the roles and
  the retained series, newest points (and ``history`` more);
* a Prometheus endpoint on ``NEXUS_METRICS_HOST``:``NEXUS_METRICS_PORT`` (`actors.monitor.prom`; loopback by default);
* TensorBoard event files per tenant under ``<data_dir>/tensorboard/`` (`actors.monitor.boards`).

Run: ``python -m actors.run monitor --nats-url nats://127.0.0.1:4222``
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from typing import Any

from actors.monitor.config import MonitorConfig
from actors.monitor.boards import TenantBoards
from actors.liveness import Entry, LivenessTable
from actors.runtime import Role, RoleConfig, op
from actors.monitor.series import SeriesStore
from protocol import ops
from protocol.messages import (
    ClusterStatus,
    HealthEvent,
    Heartbeat,
    Metric,
    MonitorSnapshot,
    ScaleDecision,
    SnapshotRequest,
    StatusRequest,
    WorkloadEvent,
)
from protocol.scaling import SCALABLE
from protocol.wire import decode

RETAIN_S = 600.0
# The scaler's decisions a snapshot carries (`nexus top`).
DECISIONS_KEPT = 16
# Heartbeat gauges taken as they come (the signal name the series uses for each).
_LEVELS = {"memory_bytes": "memory_bytes", "device_memory_bytes": "device_memory_bytes",
           "queued": "infer_queued", "slot_bytes": "slot_bytes", "slot_evictions": "slot_evictions",
           "slot_restores": "slot_restores"}
# Metric messages kept as series: signal -> series name (scope is the tenant).
_METRICS = {"loss": "loss", "version": "policy_version", "weight_sync_s": "weight_sync_seconds"}
# A training metric's name as a TensorBoard tag (the trainer's heads name them; bounded anyway).
TRAIN_METRIC = re.compile(r"[a-z][a-z0-9_]{0,39}")
# Workload progress / done metrics kept as learning series.
_PROGRESS = ("success_rate", "mean_return")
# The queue curves in TensorBoard: one point per tenant this often, not one per master beat.
TB_CONTROL_EVERY_S = 5.0


class Monitor(Role):
    name = "monitor"

    def __init__(self, cfg: RoleConfig, mcfg: MonitorConfig | None = None) -> None:
        super().__init__(cfg)
        config = mcfg or MonitorConfig.from_env()
        timeout = config.health.timeout_s(cfg.heartbeat_interval_s)
        self.table = LivenessTable(timeout_s=timeout)
        self.metrics: dict[str, float] = {}
        self.mcfg = config.monitor
        self.store = SeriesStore(points=self.mcfg.points, retain_s=self.mcfg.retain_s,
                                 series_max=self.mcfg.series_max, tenant_cap=self.mcfg.tenant_cap)
        self.boards: TenantBoards | None = None
        self.metrics_url = ""
        self._server: Any = None
        # Running totals of the previous beat per instance: rates need two points.
        self._prev: dict[str, Heartbeat] = {}
        self._down_unreplaced: dict[str, int] = {}  # role -> instances gone, none new seen since
        self._restarts: dict[str, int] = {}
        self._tb_control_at = float("-inf")
        # The scaler's newest decisions (nexus top), each kept once with its latest outcome.
        self.decisions: deque[ScaleDecision] = deque(maxlen=DECISIONS_KEPT)

    async def setup(self) -> None:
        assert self.bus is not None
        if self.mcfg.tensorboard:
            self.boards = TenantBoards(self.cfg.data_dir / "tensorboard", max_open=self.mcfg.tenant_cap)
            await asyncio.to_thread(TenantBoards.preload)  # in setup: before the first heartbeat
        self._start_endpoint()
        nc = self.bus.nc
        await nc.subscribe(self.names.heartbeat_all, cb=self._on_heartbeat)
        await nc.subscribe(self.names.health_events_all, cb=self._on_health_event)
        await nc.subscribe(self.names.metrics_all, cb=self._on_metric)
        await nc.subscribe(self.names.workload_events_all, cb=self._on_workload_event)
        await nc.subscribe(self.names.tenant_deleted_all, cb=self._on_tenant_deleted)
        await nc.subscribe(self.names.scale_decisions_all, cb=self._on_scale_decision)
        self.spawn(self._tick_loop, "tick", critical=True)

    def _start_endpoint(self) -> None:
        from actors.monitor.prom import serve

        try:
            self._server, self.metrics_url = serve(self.store, self.mcfg.metrics_port, self.mcfg.metrics_host)
        except OSError as exc:  # another deployment holds the port: run on, without the endpoint
            self.log.warning("metrics endpoint off: cannot listen", host=self.mcfg.metrics_host,
                             port=self.mcfg.metrics_port, error=str(exc))
            return
        self.log.info("metrics endpoint", url=self.metrics_url)

    async def on_drain(self) -> None:
        if self._server is not None:  # shutdown() waits out the server's poll: not on the loop
            await asyncio.to_thread(self._server.shutdown)
        if self.boards is not None:
            self.boards.close()

    def info_extra(self) -> dict[str, Any]:
        return {"tracked_roles": len(self.table.entries), "metrics": len(self.metrics),
                "series": len(self.store), "series_evicted": self.store.evicted, "metrics_url": self.metrics_url,
                "tensorboard": str(self.boards.root) if self.boards else ""}

    # -- intake --------------------------------------------------------------------------
    async def _on_heartbeat(self, msg: Any) -> None:
        try:
            hb = decode(msg.data, Heartbeat)
        except Exception as exc:
            self.log.warning("bad heartbeat", subject=msg.subject, error=str(exc))
            return
        key = LivenessTable.key(hb.role, hb.instance)
        new = key not in self.table.entries
        entry, previous = self.table.observe(hb)
        if new and self._down_unreplaced.get(hb.role, 0) > 0:
            self._down_unreplaced[hb.role] -= 1
            self._restarts[hb.role] = self._restarts.get(hb.role, 0) + 1
        if previous == "alive" and entry.state != "alive":
            self._went_down(entry)
        self._record_beat(hb, self._prev.get(key))
        self._prev[key] = hb

    def _record_beat(self, hb: Heartbeat, prev: Heartbeat | None) -> None:
        at, ri = hb.sent_at, {"role": hb.role, "instance": hb.instance}
        g = hb.gauges
        for gauge, series in _LEVELS.items():
            if gauge in g:
                self.store.record(series, g[gauge], at=at, **ri)
        if hb.role == "trainer" and "group_size" in g:
            self.store.record("group_size", g["group_size"], at=at, **ri)
        # Rates over the interval between two beats of the same sender (its own clock).
        if prev is not None and hb.seq > prev.seq and hb.sent_at > prev.sent_at:
            p, dt = prev.gauges, hb.sent_at - prev.sent_at
            if "busy_s" in g and "busy_s" in p:
                busy = max(0.0, min(1.0, (g["busy_s"] - p["busy_s"]) / dt))
                self.store.record("busy_fraction", busy, at=at, **ri)
            if "groups" in g and "groups" in p and g["groups"] > p["groups"]:
                groups = g["groups"] - p["groups"]
                served = g.get("served", 0.0) - p.get("served", 0.0)
                self.store.record("group_size", served / groups, at=at, **ri)
                if served > 0:
                    wait = (g.get("batch_wait_s", 0.0) - p.get("batch_wait_s", 0.0)) / served
                    self.store.record("batch_wait_seconds", wait, at=at, **ri)
            if hb.role == "env" and g.get("steps", 0.0) > p.get("steps", 0.0):
                steps = g["steps"] - p.get("steps", 0.0)
                self.store.record("env_step_seconds", (g.get("step_s", 0.0) - p.get("step_s", 0.0)) / steps,
                                  at=at, **ri)
        for signal, per_tenant in hb.tenant_gauges.items():
            self.store.record_tenants(signal, per_tenant, at=at)
        if self.boards is not None and hb.tenant_gauges and time.monotonic() - self._tb_control_at >= TB_CONTROL_EVERY_S:
            self._tb_control_at = time.monotonic()
            for signal in ("queue_depth", "jobs_in_flight"):
                for tenant, value in hb.tenant_gauges.get(signal, {}).items():
                    self.boards.scalar(self.store.tenant_label(tenant), f"control/{signal}", value, at=at)

    def _went_down(self, entry: Entry) -> None:
        role = entry.last.role
        self._down_unreplaced[role] = self._down_unreplaced.get(role, 0) + 1
        self.store.record("role_up", 0.0, role=role, instance=entry.last.instance)

    async def _on_health_event(self, msg: Any) -> None:
        try:
            ev = decode(msg.data, HealthEvent)
        except Exception as exc:
            self.log.warning("bad health event", subject=msg.subject, error=str(exc))
            return
        if ev.event == "role_down":
            entry = self.table.entries.get(LivenessTable.key(ev.role, ev.instance))
            was_alive = entry is not None and entry.state == "alive"
            self.table.mark_dead(ev.role, ev.instance)
            if was_alive and entry is not None:
                self._went_down(entry)

    async def _on_scale_decision(self, msg: Any) -> None:
        try:
            d = decode(msg.data, ScaleDecision)
        except Exception as exc:
            self.log.warning("bad scale decision", subject=msg.subject, error=str(exc))
            return
        if d.role not in SCALABLE:
            return
        if not d.outcome:  # announced: the count it moves to (the role's total, a pool's decision too)
            self.store.record("scale_target", float(d.to_count), at=d.at or time.time(), role=d.role)
        # The same decision again with its outcome replaces the announcement.
        same = [x for x in self.decisions
                if (x.role, x.pool, x.at, x.to_count) == (d.role, d.pool, d.at, d.to_count)]
        for x in same:
            self.decisions.remove(x)
        self.decisions.append(d)

    async def _on_metric(self, msg: Any) -> None:
        try:
            m = decode(msg.data, Metric)
        except Exception as exc:
            self.log.warning("bad metric", subject=msg.subject, error=str(exc))
            return
        self.metrics[f"{m.signal}.{m.scope}"] = m.value
        version = int(m.labels["version"]) if m.labels.get("version", "").isdigit() else -1
        if m.signal == "train":
            # A job's training metrics beside its loss (the head's: policy_loss, entropy, kl_ref,
            # ...): TensorBoard only, as learning/<name>; the series store keeps the loss alone.
            name = m.labels.get("name", "")
            if self.boards is not None and version >= 0 and TRAIN_METRIC.fullmatch(name):
                self.boards.scalar(self.store.tenant_label(m.scope), f"learning/{name}", m.value, step=version, at=m.at)
            return
        series = _METRICS.get(m.signal)
        if series is None:
            return
        self.store.record(series, m.value, at=m.at, version=version, tenant=m.scope)
        if self.boards is not None and m.signal == "loss" and version >= 0:
            self.boards.scalar(self.store.tenant_label(m.scope), "learning/loss", m.value, step=version, at=m.at)

    async def _on_workload_event(self, msg: Any) -> None:
        try:
            ev = decode(msg.data, WorkloadEvent)
        except Exception as exc:
            self.log.warning("bad workload event", subject=msg.subject, error=str(exc))
            return
        if ev.kind not in ("progress", "done") or not ev.tenant:
            return
        at = ev.at or time.time()
        tenant = self.store.tenant_label(ev.tenant)
        for name in _PROGRESS:
            if name in ev.metrics:
                self.store.record(name, ev.metrics[name], at=at, version=ev.step, tenant=ev.tenant)
                if self.boards is not None:
                    self.boards.scalar(tenant, f"learning/{name}", ev.metrics[name], step=ev.step, at=at)
        if "eval_success_rate" in ev.metrics:
            self.store.record("eval_success_rate", ev.metrics["eval_success_rate"], at=at, version=ev.step,
                              tenant=ev.tenant)
        if ev.kind == "done" and self.boards is not None:
            for name, value in ev.metrics.items():
                self.boards.scalar(tenant, f"eval/{name}", value, step=ev.step, at=at)

    async def _on_tenant_deleted(self, msg: Any) -> None:
        tenant = msg.subject.rsplit(".", 1)[-1]
        label = self.store.tenant_label(tenant)
        dropped = self.store.drop_tenant(tenant)
        # Its TensorBoard run too (a tenant past the cap shares `other`: that run stays).
        board = bool(self.boards is not None and label == tenant
                     and await asyncio.to_thread(self.boards.drop, tenant))
        self.log.info("tenant series dropped (tenant deleted)", tenant=tenant, series=dropped, board=board)

    # -- the periodic pass ---------------------------------------------------------------
    async def _tick_loop(self) -> None:
        """Once a beat interval: silent roles go dead, liveness and restarts become points,
        instances long gone are forgotten (their series too)."""
        while True:
            self._tick()
            await self.idle("tick", self.cfg.heartbeat_interval_s)

    def _expire(self) -> None:
        for entry in self.table.expire():
            self._went_down(entry)

    def _tick(self) -> None:
        self._expire()
        before = set(self.table.entries)
        self.table.forget_older_than(RETAIN_S)
        for key in before - set(self.table.entries):
            role, instance = key.split(".", 1)
            self._prev.pop(key, None)
            self.store.forget(role=role, instance=instance)
        now = time.time()
        for entry in self.table.entries.values():
            if entry.state == "alive":
                self.store.record("role_up", 1.0, at=now, role=entry.last.role, instance=entry.last.instance)
        for role in {e.last.role for e in self.table.entries.values()} | set(self._restarts):
            self.store.record("role_restarts", float(self._restarts.get(role, 0)), at=now, role=role)

    # -- ops -----------------------------------------------------------------------------
    @op(ops.MONITOR_STATUS)
    async def status(self, req: StatusRequest) -> ClusterStatus:
        self._expire()
        self.table.forget_older_than(RETAIN_S)
        rows = self.table.statuses()
        if not req.include_dead:
            rows = [r for r in rows if r.state == "alive"]
        return ClusterStatus(roles=rows, metrics=dict(self.metrics), generated_at=time.time())

    @op(ops.MONITOR_SNAPSHOT)
    async def snapshot(self, req: SnapshotRequest) -> MonitorSnapshot:
        from protocol.errors import InvalidField

        if not 0 <= req.history <= self.mcfg.points:
            raise InvalidField("history", f"{req.history}: must be in [0, {self.mcfg.points}] (points kept per series)")
        if req.family not in ("", "control", "learning", "system"):
            raise InvalidField("family", f"{req.family!r}: allowed control, learning, system or empty (all)")
        self._expire()
        return MonitorSnapshot(roles=self.table.statuses(), series=self.store.snapshot(req.history, req.family),
                               generated_at=time.time(), metrics_url=self.metrics_url,
                               decisions=list(self.decisions))
