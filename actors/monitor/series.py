"""The monitor's retained series: a bounded ring of points per (signal, labels).

Every signal the monitor keeps is in `SIGNALS` (its family, kind, labels and meaning; the
Prometheus endpoint, `nexus top` and docs/observability.md read this table). Bounds, so a
long run or many tenants cannot grow the monitor without limit:

* a ring of ``points`` per series, and points older than ``retain_s`` are dropped;
* ``series_max`` series in all: past it the least recently updated one goes;
* ``tenant_cap`` tenants get their own ``tenant`` label; later ones share ``tenant="other"``
  (an additive signal such as a queue depth is summed there, any other keeps the last value).

The monitor's event loop writes; the Prometheus endpoint's thread reads: one lock guards both.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Literal

from protocol.messages import SeriesSnapshot

Family = Literal["control", "learning", "system"]
OTHER_TENANT = "other"


@dataclass(frozen=True)
class Signal:
    name: str  # the Prometheus family is ``nexus_<name>`` (``_total`` added to a counter)
    family: Family
    kind: Literal["gauge", "counter"]
    labels: tuple[str, ...]
    help: str
    additive: bool = False  # tenants in the "other" bucket: summed (else the last value)
    unit: str = ""


_T, _RI = ("tenant",), ("role", "instance")
SIGNALS: dict[str, Signal] = {s.name: s for s in (
    # control: from the master's heartbeats (per tenant) and the inferencers' (per instance)
    Signal("queue_depth", "control", "gauge", _T, "training jobs queued (reserved, filling, ready)", True),
    Signal("ready_jobs", "control", "gauge", _T, "training jobs ready to lease (of queue_depth): the trainers' backlog", True),
    Signal("jobs_in_flight", "control", "gauge", _T, "training jobs on a trainer (leased to synced)", True),
    Signal("staleness_versions", "control", "gauge", _T,
           "policy versions between the tenant's newest and its oldest ready rollout's behaviour policy"),
    Signal("dropped_stale", "control", "counter", _T, "rollout jobs dropped as too stale", True),
    Signal("active_rollouts", "control", "gauge", _T, "rollouts holding the master's rollout gate", True),
    Signal("waiting_rollouts", "control", "gauge", _T,
           "rollouts refused a turn of the master's rollout gate and still asking (their workflows retry)", True),
    Signal("priority", "control", "gauge", _T,
           "the tenant's priority as routing uses it (its spec's, within its max_priority quota; 'other': the min)"),
    Signal("infer_queued", "control", "gauge", _RI, "predict requests queued in an inferencer"),
    Signal("group_size", "control", "gauge", _RI,
           "rows per grouped forward (inferencer, mean since its last beat) or jobs in the round (trainer)"),
    Signal("batch_wait_seconds", "control", "gauge", _RI,
           "mean wait of a predict request from arrival to its group's forward, since the last beat", unit="s"),
    Signal("env_step_seconds", "control", "gauge", _RI,
           "mean simulator step latency in an env worker (workflows' and sessions' steps), since the last beat",
           unit="s"),
    # the health manager's scaler (NEXUS_SCALER; docs/scaling.md), from its ScaleDecision events
    Signal("scale_target", "control", "gauge", ("role",), "instance count the scaler last decided for the role"),
    # learning: the trainer's metrics and the workloads' progress events
    Signal("loss", "learning", "gauge", _T, "training loss of the tenant's last job (point: its version)"),
    Signal("policy_version", "learning", "gauge", _T, "the tenant's newest trained policy version"),
    Signal("success_rate", "learning", "gauge", _T, "rollout success rate over the workload's window"),
    Signal("mean_return", "learning", "gauge", _T, "mean episode return over the workload's window"),
    Signal("eval_success_rate", "learning", "gauge", _T, "success rate of the tenant's last evaluation"),
    # system: liveness (monitor), every role's beats, the inferencers' weight syncs
    Signal("role_up", "system", "gauge", _RI, "1 while the instance's heartbeats arrive, 0 once dead or stopped"),
    Signal("role_restarts", "system", "counter", ("role",),
           "a new instance of the role seen after one went dead or stopped"),
    Signal("weight_sync_seconds", "system", "gauge", _T,
           "export of a version to an inferencer serving it (last sync)", unit="s"),
    Signal("busy_fraction", "system", "gauge", _RI,
           "share of wall time in device work (train steps, forwards) since the last beat"),
    Signal("memory_bytes", "system", "gauge", _RI, "resident memory of the role's process", unit="bytes"),
    Signal("device_memory_bytes", "system", "gauge", _RI,
           "memory in use on the role's torch device (CUDA allocated; on a CPU device the RSS)", unit="bytes"),
    # The memory budgets (NEXUS_TRAINER_SLOT_BUDGET_MB, NEXUS_INFER_HEAD_BUDGET_MB; docs/scale.md).
    Signal("slot_bytes", "system", "gauge", _RI,
           "tenant slots resident in a trainer / serving heads loaded in an inferencer", unit="bytes"),
    Signal("slot_evictions", "system", "counter", _RI,
           "tenant slots (trainer) or serving heads (inferencer) dropped from memory under the budget"),
    Signal("slot_restores", "system", "counter", _RI,
           "dropped slots restored from their checkpoint (trainer) or heads reloaded from the weights store (inferencer)"),
)}


@dataclass
class _Series:
    signal: Signal
    labels: dict[str, str]
    points: deque  # (at, value, version)


Key = tuple[str, tuple[tuple[str, str], ...]]


class SeriesStore:
    def __init__(self, points: int, retain_s: float, series_max: int, tenant_cap: int) -> None:
        self.points, self.retain_s = points, retain_s
        self.series_max, self.tenant_cap = series_max, tenant_cap
        self._series: OrderedDict[Key, _Series] = OrderedDict()
        self._tenants: dict[str, None] = {}  # the tenants with their own label, first come
        self._lock = threading.Lock()
        self.evicted = 0

    def tenant_label(self, tenant: str) -> str:
        """``tenant`` itself for the first ``tenant_cap`` tenants seen, then "other"."""
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) < self.tenant_cap and tenant != OTHER_TENANT:
            self._tenants[tenant] = None
            return tenant
        return OTHER_TENANT

    def record(self, name: str, value: float, *, at: float | None = None, version: int = -1,
               **labels: str) -> None:
        """Append a point to the series ``name{labels}`` (a ``tenant`` label is capped here)."""
        signal = SIGNALS[name]
        if set(labels) != set(signal.labels):
            raise ValueError(f"signal {name}: labels {sorted(labels)}, expected {list(signal.labels)}")
        if "tenant" in labels:
            labels["tenant"] = self.tenant_label(labels["tenant"])
        self._append(signal, labels, float(value), time.time() if at is None else at, version)

    def record_tenants(self, name: str, values: dict[str, float], *, at: float | None = None) -> None:
        """One point per tenant from a whole per-tenant map (a master beat): the "other" bucket
        gets the sum of its tenants for an additive signal, else the last of them."""
        signal = SIGNALS[name]
        at = time.time() if at is None else at
        merged: dict[str, float] = {}
        for tenant, value in values.items():
            label = self.tenant_label(tenant)
            if label == OTHER_TENANT and signal.additive:
                merged[label] = merged.get(label, 0.0) + float(value)
            else:
                merged[label] = float(value)
        for label, value in merged.items():
            self._append(signal, {"tenant": label}, value, at, -1)

    def _append(self, signal: Signal, labels: dict[str, str], value: float, at: float, version: int) -> None:
        key: Key = (signal.name, tuple(sorted(labels.items())))
        with self._lock:
            s = self._series.get(key)
            if s is None:
                s = self._series[key] = _Series(signal, dict(labels), deque(maxlen=self.points))
                while len(self._series) > self.series_max:
                    self._series.popitem(last=False)
                    self.evicted += 1
            else:
                self._series.move_to_end(key)
            s.points.append((at, value, version))
            horizon = at - self.retain_s
            while s.points and s.points[0][0] < horizon:
                s.points.popleft()

    def forget(self, **labels: str) -> int:
        """Drop every series whose labels include ``labels`` (a role instance long gone)."""
        want = set(labels.items())
        with self._lock:
            keys = [k for k, s in self._series.items() if want <= set(s.labels.items())]
            for k in keys:
                del self._series[k]
        return len(keys)

    def drop_tenant(self, tenant: str) -> int:
        """A deleted tenant: its series go and its label's place under the cap is free again."""
        if self._tenants.pop(tenant, 0) is None:
            return self.forget(tenant=tenant)
        return 0

    def __len__(self) -> int:
        return len(self._series)

    def latest(self) -> list[tuple[Signal, dict[str, str], float, float, int]]:
        """(signal, labels, value, at, version) of each series' newest point."""
        with self._lock:
            return [(s.signal, dict(s.labels), s.points[-1][1], s.points[-1][0], s.points[-1][2])
                    for s in self._series.values() if s.points]

    def snapshot(self, history: int = 0, family: str = "") -> list[SeriesSnapshot]:
        """Each series (of ``family``, or all) with its newest ``history + 1`` points."""
        out = []
        with self._lock:
            for s in self._series.values():
                if not s.points or (family and s.signal.family != family):
                    continue
                pts = list(s.points)[-(history + 1):]
                out.append(SeriesSnapshot(signal=s.signal.name, family=s.signal.family, labels=dict(s.labels),
                                          at=[p[0] for p in pts], values=[p[1] for p in pts],
                                          versions=[p[2] for p in pts]))
        return out
