"""Heartbeat bookkeeping shared by the health manager and the monitor.

Ages are measured on the receiver's monotonic clock, never from the sender's wall-clock
``sent_at``, so clock skew between hosts cannot make a live role look dead.

A role is dead when its beats stop (hung or gone) *or* when a beat lists a critical loop as
stalled (the process is up but part of it stopped working): both are `role_down`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from protocol.messages import Heartbeat, RoleStatus

Liveness = Literal["alive", "dead", "stopped"]


@dataclass
class Entry:
    last: Heartbeat
    seen_mono: float
    seen_wall: float
    state: Liveness = "alive"
    changed_mono: float = 0.0


class LivenessTable:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.entries: dict[str, Entry] = {}

    @staticmethod
    def key(role: str, instance: str) -> str:
        return f"{role}.{instance}"

    def observe(self, hb: Heartbeat) -> tuple[Entry, Liveness | None]:
        """Record a beat; return the entry and its previous state if it changed."""
        now = time.monotonic()
        key = self.key(hb.role, hb.instance)
        entry = self.entries.get(key)
        new_state: Liveness = "stopped" if hb.state == "stopped" else "dead" if hb.stalled else "alive"
        if entry is None:
            entry = Entry(last=hb, seen_mono=now, seen_wall=time.time(), state=new_state, changed_mono=now)
            self.entries[key] = entry
            return entry, None
        previous = entry.state
        entry.last, entry.seen_mono, entry.seen_wall = hb, now, time.time()
        if previous != new_state:
            entry.state, entry.changed_mono = new_state, now
            return entry, previous
        return entry, None

    def expire(self) -> list[Entry]:
        """Mark alive entries silent for longer than the timeout dead; return them."""
        now = time.monotonic()
        died = []
        for entry in self.entries.values():
            if entry.state == "alive" and now - entry.seen_mono > self.timeout_s:
                entry.state, entry.changed_mono = "dead", now
                died.append(entry)
        return died

    @staticmethod
    def stall_reason(hb: Heartbeat) -> str:
        """Name each stalled loop with how long it has been quiet and its limit."""
        parts = [f"critical loop {name!r} quiet for {hb.loops.get(name, 0.0):.1f} s "
                 f"(limit {hb.loop_limits_s.get(name, 0.0):g} s)" for name in hb.stalled]
        return "; ".join(parts)

    def mark_dead(self, role: str, instance: str) -> None:
        entry = self.entries.get(self.key(role, instance))
        if entry is not None and entry.state == "alive":
            entry.state, entry.changed_mono = "dead", time.monotonic()

    def forget_older_than(self, retain_s: float) -> None:
        """Drop dead / stopped entries that changed state more than ``retain_s`` ago."""
        now = time.monotonic()
        for key in [k for k, e in self.entries.items() if e.state != "alive" and now - e.changed_mono > retain_s]:
            del self.entries[key]

    def statuses(self) -> list[RoleStatus]:
        now_mono, now_wall = time.monotonic(), time.time()
        out = []
        for entry in self.entries.values():
            hb = entry.last
            age = now_mono - entry.seen_mono
            end_wall = now_wall if entry.state == "alive" else entry.seen_wall
            out.append(
                RoleStatus(
                    role=hb.role,
                    instance=hb.instance,
                    pid=hb.pid,
                    host=hb.host,
                    state=entry.state,
                    role_state=hb.state,
                    started_at=hb.started_at,
                    uptime_s=max(0.0, end_wall - hb.started_at),
                    last_heartbeat_at=entry.seen_wall,
                    last_heartbeat_age_s=age,
                )
            )
        out.sort(key=lambda s: (s.role, s.started_at))
        return out
