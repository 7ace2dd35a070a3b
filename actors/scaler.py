"""The scaler's decisions: from the roles' signals to one instance more or fewer, within bounds.

    s = Scaler(SCALER, bounds)
    for d in s.decide(now, counts={"trainer": 1, ...}, signals=signals_from_beats(beats)):
        ...  # ScaleDecision(role, from_count, to_count, reason, signals)

Pure (no I/O, the clock is an argument) so its policy is tested on made-up signal histories;
the health manager runs it (`actors/health.py`, NEXUS_SCALER) on the heartbeats it already
watches and sends each decision to the supervisor as a `ScaleRequest`.

Pressure per role is a signal per live instance: trainer, training jobs queued (reserved,
filling, ready: the master's ``queue_depth`` summed over tenants); inferencer, predict requests
queued (``queued`` summed over inferencers); env, rollouts holding the master's gate
(``active_rollouts``: the monitor exports no count of rollouts *waiting* for a session yet).
Hysteresis and cooldown are `protocol.policy.ScalerPolicy`'s. Never below a bound's min or above
its max; never a trainer fewer while jobs are queued (the supervisor refuses trainer=0 then too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Literal

from protocol.messages import Heartbeat, ScaleDecision
from protocol.policy import ScalerPolicy
from protocol.scaling import SCALABLE, Bounds

Regime = Literal["up", "down", "hold"]
# The signal each role's pressure is read from (per instance).
PRESSURE = {"trainer": "queued_jobs", "inferencer": "queued_predicts", "env": "active_rollouts"}


def signals_from_beats(beats: Iterable[Heartbeat]) -> dict[str, float]:
    """The scaler's inputs from the newest heartbeat of each live instance: the master's per-tenant
    gauges summed, the inferencers' queued requests summed."""
    out = {"queued_jobs": 0.0, "jobs_in_flight": 0.0, "active_rollouts": 0.0, "queued_predicts": 0.0}
    for hb in beats:
        if hb.role == "master":
            for name, key in (("queue_depth", "queued_jobs"), ("jobs_in_flight", "jobs_in_flight"),
                              ("active_rollouts", "active_rollouts")):
                out[key] += sum(hb.tenant_gauges.get(name, {}).values())
        elif hb.role == "inferencer":
            out["queued_predicts"] += hb.gauges.get("queued", 0.0)
    return out


@dataclass
class _RoleState:
    regime: Regime = "hold"
    since: float = 0.0
    last_decision: float = float("-inf")


@dataclass
class Scaler:
    policy: ScalerPolicy
    bounds: dict[str, Bounds]
    state: dict[str, _RoleState] = field(default_factory=dict)

    def decide(self, now: float, counts: dict[str, int], signals: dict[str, float]) -> list[ScaleDecision]:
        """One decision per role at most: +1 after ``window_s`` at or above ``up`` per instance,
        -1 after ``window_s`` at or below ``down``; none within ``cooldown_s`` of the last."""
        up, down = dict(self.policy.up), dict(self.policy.down)
        out: list[ScaleDecision] = []
        for role in SCALABLE:
            if role not in counts or role not in self.bounds:
                continue
            n, b = counts[role], self.bounds[role]
            per = signals.get(PRESSURE[role], 0.0) / max(n, 1)
            if per >= up[role] and n < b.max:
                regime: Regime = "up"
            elif per <= down[role] and n > b.min and not (role == "trainer" and signals.get("queued_jobs", 0.0) > 0):
                regime = "down"
            else:
                regime = "hold"
            st = self.state.setdefault(role, _RoleState(since=now))
            if regime != st.regime:
                st.regime, st.since = regime, now
            if regime == "hold" or now - st.since < self.policy.window_s:
                continue
            if now - st.last_decision < self.policy.cooldown_s:
                continue
            to = n + 1 if regime == "up" else n - 1
            word = "at or above" if regime == "up" else "at or below"
            limit = up[role] if regime == "up" else down[role]
            reason = (f"{PRESSURE[role]} per {role} {per:.2f} {word} {limit:g} for {now - st.since:.0f} s "
                      f"(window {self.policy.window_s:g} s); bounds {b.min}..{b.max}")
            out.append(ScaleDecision(role=role, from_count=n, to_count=to, reason=reason,
                                     signals={**signals, f"{PRESSURE[role]}_per_instance": per},
                                     at=time.time()))
            st.last_decision, st.since = now, now
        return out
