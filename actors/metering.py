"""Metered device time: a role's busy time, split over the tenants whose work it did.

Shared by the trainer and the inferencer (a helper below both roles). Each grouped step or
forward is timed by its role (wall time around the device work, ending in a device
synchronize on CUDA) and charged here::

    meter = Meter()
    busy_s = ...                                         # the role's measured forward
    meter.charge("infer", busy_s, {("acme", "w1"): 3, ("bolt", ""): 1}, requests={...})
    report = meter.take_report("inferencer", "inferencer-1")   # one batch of deltas
    ...  # sent to the master (`flush`); on its acknowledgement:
    meter.acked(report)

The rule (docs/usage.md): a measured busy interval of ``busy_s`` that worked ``r_i`` rows of
tenant i charges tenant i ``busy_s * w_i / sum(w)`` with ``w_i = r_i + overhead_rows``; the
last share is the remainder, so the charges of one interval add up to ``busy_s`` exactly.
Rows, because within one grouped forward every row has the same compatibility key (same image
size, same prompt length), so the shared base forward, which is most of the cost, costs the
same per row. ``overhead_rows`` (default 0: plain rows) is a fitted fixed cost of each tenant
in an interval, in row-equivalents: its head's launches cost about the same whatever its rows
(measured by bench/metering_split.py; docs/usage.md has the figures).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any, Literal

from protocol import ops
from protocol.errors import NexusError, PayloadTooLarge
from protocol.messages import UsageCounters, UsageEntry, UsageReport
from protocol.policy import UsageFlush
from protocol.wire import encode

Kind = Literal["train", "infer"]
Key = tuple[str, str]  # (tenant, workload)


def split_by_rows(busy_s: float, rows: list[int], overhead_rows: float = 0.0) -> list[float]:
    """``busy_s`` split in proportion to ``rows`` (each plus ``overhead_rows``); the shares add
    up to ``busy_s`` exactly (the last is the remainder). Rows must be >= 0 with a positive sum."""
    if sum(rows) <= 0 or any(r < 0 for r in rows) or overhead_rows < 0:
        raise ValueError(f"rows {rows}, overhead_rows {overhead_rows}: need rows >= 0 with a positive sum "
                         "and overhead_rows >= 0")
    weights = [r + overhead_rows for r in rows]
    total = sum(weights)
    shares = [busy_s * w / total for w in weights[:-1]]
    shares.append(busy_s - sum(shares))
    return shares


class Meter:
    """Usage deltas of one role instance since its last acknowledged report. Thread-safe: the
    forwards run on worker threads, the flush on the event loop."""

    def __init__(self, overhead_rows: dict[str, float] | None = None) -> None:
        # kind -> a tenant's fixed cost per interval in row-equivalents (0: plain rows)
        self.overhead_rows = {"train": 0.0, "infer": 0.0, **(overhead_rows or {})}
        self._lock = threading.Lock()
        self.boot = uuid.uuid4().hex[:12]
        self._deltas: dict[Key, UsageCounters] = {}
        self._pending: UsageReport | None = None  # sent, not yet acknowledged
        self._seq = 0
        self.busy_s: dict[str, float] = {"train": 0.0, "infer": 0.0}
        self.intervals = 0
        self.reported_s = 0.0  # device-seconds the master acknowledged
        self.reports_acked = 0
        self.splits = 0  # reports that held only part of the deltas (the rest went in the next)

    def charge(self, kind: Kind, busy_s: float, rows: dict[Key, int],
               requests: dict[Key, int] | None = None) -> None:
        """One measured busy interval of ``kind``; ``rows`` the rows each (tenant, workload)
        had in it. The interval counts toward the role's busy time in any case."""
        keys = [k for k, r in rows.items() if r > 0]
        with self._lock:
            self.busy_s[kind] += busy_s
            self.intervals += 1
            if not keys:
                return  # nothing of anyone's was worked (every caller gave up): no one pays
            for key, share in zip(keys, split_by_rows(busy_s, [rows[k] for k in keys], self.overhead_rows[kind])):
                c = self._deltas.setdefault(key, UsageCounters())
                if kind == "train":
                    c.train_device_s += share
                    c.train_rows += rows[key]
                    c.train_steps += 1
                else:
                    c.infer_device_s += share
                    c.infer_rows += rows[key]
            for key, n in (requests or {}).items():
                self._deltas.setdefault(key, UsageCounters()).requests += n

    def add_bytes(self, tenant: str, workload: str, n: int) -> None:
        with self._lock:
            self._deltas.setdefault((tenant, workload), UsageCounters()).stored_bytes += n

    def take_report(self, role: str, instance: str, max_bytes: int = 0) -> UsageReport | None:
        """The report to send now: the unacknowledged one again (unchanged, same seq: the
        master may have applied it and lost the reply), else the deltas so far, else None.
        ``max_bytes`` > 0: the report holds only as many entries as fit in it encoded; the
        rest stay for the next report (sent right after this one is acknowledged)."""
        with self._lock:
            if self._pending is not None:
                return self._pending
            if not self._deltas:
                return None
            self._seq += 1
            entries = [UsageEntry(tenant=t, workload=w, usage=c) for (t, w), c in sorted(self._deltas.items())]
            report = UsageReport(role=role, instance=instance, seq=self._seq, entries=entries,
                                 busy_s=sum(self.busy_s.values()), boot=self.boot)
            if max_bytes > 0:
                while len(report.entries) > 1 and len(encode(report)) > max_bytes:
                    report.entries = report.entries[:len(report.entries) // 2]
                self.splits += int(len(report.entries) < len(entries))
            for e in report.entries:
                del self._deltas[(e.tenant, e.workload)]
            self._pending = report
            return self._pending

    def has_work(self) -> bool:
        """A report is pending or deltas wait."""
        with self._lock:
            return self._pending is not None or bool(self._deltas)

    def more(self) -> bool:
        """Deltas wait beyond the pending report (a split one): flush again now."""
        with self._lock:
            return self._pending is None and bool(self._deltas)

    def drop_pending(self) -> UsageReport | None:
        """Give the unacknowledged report up (the master refuses it for good, it is never
        going to fit); the caller logs what was lost."""
        with self._lock:
            report, self._pending = self._pending, None
            return report

    def acked(self, report: UsageReport) -> None:
        with self._lock:
            if self._pending is report:
                self._pending = None
                self.reported_s += sum(e.usage.train_device_s + e.usage.infer_device_s for e in report.entries)
                self.reports_acked += 1

    def forget(self, tenant: str) -> None:
        """A deleted tenant's unsent deltas go (its usage records stay at the master)."""
        with self._lock:
            self._deltas = {k: v for k, v in self._deltas.items() if k[0] != tenant}

    def info(self) -> dict[str, Any]:
        """For the role's info reply: what it measured, and how much of it the master has."""
        with self._lock:
            charged = sum(c.train_device_s + c.infer_device_s for c in self._deltas.values())
            pending = self._pending
            return {"busy_s": dict(self.busy_s), "intervals": self.intervals,
                    "reported_s": self.reported_s, "reports_acked": self.reports_acked,
                    "unsent_s": charged, "unsent_entries": len(self._deltas),
                    "pending_seq": pending.seq if pending else 0, "splits": self.splits}


async def flush(bus: Any, names: Any, meter: Meter, role: str, instance: str, timeout_s: float,
                log: Any, max_payload_fraction: float = UsageFlush.max_payload_fraction) -> bool:
    """Send one report to the master; True when there was nothing to send or it was taken.
    A report is at most ``max_payload_fraction`` of the server's max payload (split, never
    refused by NATS and resent forever)."""
    bound = int(bus.max_payload * max_payload_fraction)
    report = meter.take_report(role, instance, max_bytes=bound)
    if report is None:
        return True
    try:
        await bus.call(ops.MASTER_USAGE_REPORT, report, timeout_s=timeout_s)
    except PayloadTooLarge as exc:
        # One entry alone past the bound (names are at most 64 characters: not expected). It
        # would never fit: given up, loudly, so the rest of the metering goes on.
        meter.drop_pending()
        log.error("usage report dropped: larger than the max payload even alone", seq=report.seq,
                  entries=len(report.entries), bound_bytes=bound, error=exc.message)
        return False
    except NexusError as exc:
        # The master is away: the same report goes again next period (applied once there).
        log.warning("usage report not taken; will resend", seq=report.seq, error=exc.message)
        return False
    meter.acked(report)
    return True


async def flush_loop(role: Any, meter: Meter, policy: UsageFlush) -> None:
    """A role's critical loop: one report per ``policy.every_s`` (and the rest of a split one
    right after it)."""
    while True:
        await role.idle("usage-flush", policy.every_s)
        while await flush(role.bus, role.names, meter, role.name, role.instance, policy.timeout_s, role.log,
                          policy.max_payload_fraction) and meter.more():
            pass


async def final_flush(role: Any, meter: Meter, policy: UsageFlush) -> None:
    """At drain: what is still unsent goes now (the pending report, then the rest), bounded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + policy.final_timeout_s
    while loop.time() < deadline:
        if not meter.has_work():
            return
        left = max(0.1, min(policy.timeout_s, deadline - loop.time()))
        if not await flush(role.bus, role.names, meter, role.name, role.instance, left, role.log,
                           policy.max_payload_fraction):
            await asyncio.sleep(min(0.5, max(0.0, deadline - loop.time())))
    role.log.error("usage not reported before exit", **meter.info())
