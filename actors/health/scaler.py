"""The scaler's decisions: from the roles' signals to one instance more or fewer, within bounds.

    s, rates = Scaler(SCALER, bounds), RateWindow(SCALER.rate_s)
    sig = signals_from_beats(beats, rates.look(now, beats))   # newest beat per instance, an older one
    for d in s.decide(now, counts={"trainer": 1, ...}, signals=sig):
        ...  # ScaleDecision(role, from_count, to_count, reason, signals)

Pure (no I/O, the clock is an argument) so its policy is tested on made-up signal histories;
the health manager runs it (`actors/health/health.py`, NEXUS_SCALER) on the heartbeats it already
watches and sends each decision to the supervisor as a `ScaleRequest`.

Each role's regime comes from several signals (thresholds: `protocol.policy.ScalerPolicy`;
docs/scaling.md, "The scaler"):

* env: rollouts holding the master's gate per worker at the up line AND (rollouts waiting for
  a turn, priority-weighted, OR a slow simulator step) -> up; nothing waiting and few holders
  per worker -> down.
* trainer: ready jobs per trainer (priority-weighted) high AND the trainers busy -> up (a
  backlog on an idle trainer is not a capacity problem); trainers idle and no job queued -> down.
* inferencer: per pool (each inferencer serves one base; its beat names the pool): the pool's
  worst queue wait high OR predicts queued per instance of the pool high -> one more of that
  pool; both low -> one fewer of it, never its last (a pool without an instance has no beat to
  show its pressure again). Bounds hold for the role's total; window and cooldown are per
  (role, pool), so a starved pool is helped while the others are left alone.
  ``sig = pool_signals_from_beats(beats, before)``; ``decide(now, counts, signals, pools=sig)``.
  Without ``pools`` (no beat names one) the role-wide rule on the worst instance applies.

Hysteresis (a regime must hold for ``window_s``) and cooldown are the policy's, per role (and
per pool for inferencers). Never below a
bound's min or above its max; never a trainer fewer while jobs are queued (the supervisor
refuses trainer=0 then too). Every decision's reason names the signals that drove it; its
``signals`` carry every input.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from protocol.messages import Heartbeat, ScaleDecision
from protocol.policy import FAIR_SHARE, PRIORITY_MAX, PRIORITY_MIN, ScalerPolicy
from protocol.scaling import SCALABLE, Bounds

Regime = Literal["up", "down", "hold"]


def priority_weight(priority: float) -> float:
    """How much a waiting rollout or ready job of a tenant at ``priority`` weighs: its fair-share
    weight (`FAIR_SHARE`, as routing uses it) above the default, 1 at or below it (a low-priority
    tenant's backlog still counts in full: it is slowed, never starved)."""
    p = max(PRIORITY_MIN, min(PRIORITY_MAX, priority))
    return max(1.0, FAIR_SHARE.base ** (p / FAIR_SHARE.step))


def _delta(hb: Heartbeat, old: Heartbeat | None, name: str) -> float | None:
    """``name``'s growth from ``old`` to ``hb`` (two beats of one process), or None when there
    is no earlier beat of that process to take it from."""
    if (old is None or old.pid != hb.pid or old.started_at != hb.started_at or hb.seq <= old.seq
            or name not in hb.gauges or name not in old.gauges):
        return None
    return max(0.0, hb.gauges[name] - old.gauges[name])


def signals_from_beats(beats: Iterable[Heartbeat],
                       before: Mapping[tuple[str, str], Heartbeat] | None = None) -> dict[str, float]:
    """The scaler's inputs from the newest heartbeat of each live instance. ``before``: an older
    beat per (role, instance), for the rates between the two (the health manager passes a
    `RateWindow`'s, about ``rate_s`` older): trainer busy fraction, mean env step latency, inferencer
    queue wait. Without one a rate is 0 (nothing measured yet)."""
    before = before or {}
    out = {"queued_jobs": 0.0, "ready_jobs": 0.0, "ready_jobs_weighted": 0.0, "jobs_in_flight": 0.0,
           "active_rollouts": 0.0, "waiting_rollouts": 0.0, "waiting_rollouts_weighted": 0.0,
           "queued_predicts": 0.0, "infer_wait_s": 0.0, "env_step_s": 0.0, "trainer_busy": 0.0}
    busy_s = wall_s = step_s = steps = 0.0
    for hb in beats:
        old = before.get((hb.role, hb.instance))
        if hb.role == "master":
            tg = hb.tenant_gauges
            prio = tg.get("priority", {})
            for name, key in (("queue_depth", "queued_jobs"), ("jobs_in_flight", "jobs_in_flight"),
                              ("active_rollouts", "active_rollouts")):
                out[key] += sum(tg.get(name, {}).values())
            for name in ("ready_jobs", "waiting_rollouts"):
                for tenant, n in tg.get(name, {}).items():
                    out[name] += n
                    out[f"{name}_weighted"] += n * priority_weight(prio.get(tenant, 0.0))
        elif hb.role == "inferencer":
            out["queued_predicts"] += hb.gauges.get("queued", 0.0)
            served, waited = _delta(hb, old, "served"), _delta(hb, old, "batch_wait_s")
            if served and waited is not None:  # the worst instance: a starved pool shows
                out["infer_wait_s"] = max(out["infer_wait_s"], waited / served)
        elif hb.role == "trainer":
            busy = _delta(hb, old, "busy_s")
            if busy is not None and old is not None and hb.sent_at > old.sent_at:
                busy_s += min(busy, hb.sent_at - old.sent_at)
                wall_s += hb.sent_at - old.sent_at
        elif hb.role == "env":
            n, s = _delta(hb, old, "steps"), _delta(hb, old, "step_s")
            if n and s is not None:
                steps, step_s = steps + n, step_s + s
    out["trainer_busy"] = busy_s / wall_s if wall_s > 0 else 0.0
    out["env_step_s"] = step_s / steps if steps > 0 else 0.0
    return out


def pool_signals_from_beats(beats: Iterable[Heartbeat],
                            before: Mapping[tuple[str, str], Heartbeat] | None = None) -> dict[str, dict[str, float]]:
    """Per inference pool (the ``pool`` its inferencers' beats name): ``inferencers`` (live
    instances), ``queued_predicts`` (their sum) and ``infer_wait_s`` (the pool's worst instance's
    mean queue wait between ``before``'s beat and the newest, as `signals_from_beats`). Beats
    naming no pool (older senders) are left out."""
    before = before or {}
    out: dict[str, dict[str, float]] = {}
    for hb in beats:
        if hb.role != "inferencer" or not hb.pool:
            continue
        p = out.setdefault(hb.pool, {"inferencers": 0.0, "queued_predicts": 0.0, "infer_wait_s": 0.0})
        p["inferencers"] += 1
        p["queued_predicts"] += hb.gauges.get("queued", 0.0)
        old = before.get((hb.role, hb.instance))
        served, waited = _delta(hb, old, "served"), _delta(hb, old, "batch_wait_s")
        if served and waited is not None:
            p["infer_wait_s"] = max(p["infer_wait_s"], waited / served)
    return out


@dataclass
class RateWindow:
    """The earlier beat each instance's rates are taken from: the newest one seen at least
    ``span_s`` before this look (or the oldest seen, early on). Bounded: per live instance, the
    beats of the last ``span_s`` plus one (one per look at most)."""

    span_s: float
    seen: dict[tuple[str, str], deque] = field(default_factory=dict)  # (role, instance) -> (at, beat)

    def look(self, now: float, beats: Iterable[Heartbeat]) -> dict[tuple[str, str], Heartbeat]:
        before: dict[tuple[str, str], Heartbeat] = {}
        live = set()
        for hb in beats:
            key = (hb.role, hb.instance)
            live.add(key)
            h = self.seen.setdefault(key, deque())
            if not h or h[-1][1].seq != hb.seq:
                h.append((now, hb))
            while len(h) > 1 and now - h[1][0] >= self.span_s:
                h.popleft()
            if h[0][1] is not hb:
                before[key] = h[0][1]
        for key in set(self.seen) - live:  # gone: forgotten
            del self.seen[key]
        return before


def _env(p: ScalerPolicy, n: int, sig: dict[str, float]) -> tuple[Regime, str]:
    holders = sig.get("active_rollouts", 0.0) / max(n, 1)
    waiting, step = sig.get("waiting_rollouts_weighted", 0.0), sig.get("env_step_s", 0.0)
    held = f"active_rollouts per env {holders:.2f}"
    if holders >= p.env_holders_up:
        why = []
        if waiting >= p.env_waiting_up:
            why.append(f"waiting_rollouts_weighted {waiting:.2f} at or above {p.env_waiting_up:g}")
        if step >= p.env_step_s_up:
            why.append(f"env_step_s {step:.3f} at or above {p.env_step_s_up:g}")
        if why:
            return "up", f"{held} at or above {p.env_holders_up:g} and " + " and ".join(why)
    if sig.get("waiting_rollouts", 0.0) == 0 and holders <= p.env_holders_down:
        return "down", f"{held} at or below {p.env_holders_down:g} and no rollout waiting"
    return "hold", ""


def _trainer(p: ScalerPolicy, n: int, sig: dict[str, float]) -> tuple[Regime, str]:
    ready, busy = sig.get("ready_jobs_weighted", 0.0) / max(n, 1), sig.get("trainer_busy", 0.0)
    if ready >= p.trainer_ready_up and busy >= p.trainer_busy_up:
        return "up", (f"ready_jobs_weighted per trainer {ready:.2f} at or above {p.trainer_ready_up:g} and "
                      f"trainer_busy {busy:.2f} at or above {p.trainer_busy_up:g}")
    if busy <= p.trainer_busy_down and sig.get("queued_jobs", 0.0) == 0:
        return "down", f"trainer_busy {busy:.2f} at or below {p.trainer_busy_down:g} and no job queued"
    return "hold", ""


def _inferencer(p: ScalerPolicy, n: int, sig: dict[str, float]) -> tuple[Regime, str]:
    queued, wait = sig.get("queued_predicts", 0.0) / max(n, 1), sig.get("infer_wait_s", 0.0)
    why = []
    if wait >= p.infer_wait_s_up:
        why.append(f"infer_wait_s {wait:.3f} at or above {p.infer_wait_s_up:g}")
    if queued >= p.infer_queued_up:
        why.append(f"queued_predicts per inferencer {queued:.2f} at or above {p.infer_queued_up:g}")
    if why:
        return "up", " and ".join(why)
    if wait <= p.infer_wait_s_down and queued <= p.infer_queued_down:
        return "down", (f"infer_wait_s {wait:.3f} at or below {p.infer_wait_s_down:g} and queued_predicts "
                        f"per inferencer {queued:.2f} at or below {p.infer_queued_down:g}")
    return "hold", ""


RULES = {"env": _env, "trainer": _trainer, "inferencer": _inferencer}


@dataclass
class _RoleState:
    regime: Regime = "hold"
    since: float = 0.0
    last_decision: float = float("-inf")


@dataclass
class Scaler:
    policy: ScalerPolicy
    bounds: dict[str, Bounds]
    # (role, pool) -> its regime and last decision; pool "" for a role-wide rule.
    state: dict[tuple[str, str], _RoleState] = field(default_factory=dict)

    def decide(self, now: float, counts: dict[str, int], signals: dict[str, float],
               pools: Mapping[str, Mapping[str, float]] | None = None) -> list[ScaleDecision]:
        """One decision per role (per inferencer pool, with ``pools``) at most: +1 (-1) once its
        rule has said up (down) for ``window_s``; none within ``cooldown_s`` of the last; the
        role's total never past a bound."""
        out: list[ScaleDecision] = []
        for role in SCALABLE:
            if role not in counts or role not in self.bounds:
                continue
            if role == "inferencer" and pools:
                out += self._decide_pools(now, counts[role], signals, pools)
                continue
            n, b = counts[role], self.bounds[role]
            regime, why = RULES[role](self.policy, n, signals)
            if (regime == "up" and n >= b.max) or (regime == "down" and n <= b.min):
                regime = "hold"
            held = self._held(now, (role, ""), regime)
            if held is None:
                continue
            to = n + 1 if regime == "up" else n - 1
            reason = (f"{why} for {held:.0f} s (window {self.policy.window_s:g} s); "
                      f"bounds {b.min}..{b.max}")
            out.append(ScaleDecision(role=role, from_count=n, to_count=to, reason=reason,
                                     signals={**signals, f"{role}_count": float(n)}, at=time.time()))
        return out

    def _held(self, now: float, key: tuple[str, str], regime: Regime) -> float | None:
        """Hysteresis and cooldown of ``key``: how long ``regime`` has held when it is due to act
        now (and the act recorded), else None."""
        st = self.state.setdefault(key, _RoleState(since=now))
        if regime != st.regime:
            st.regime, st.since = regime, now
        if regime == "hold" or now - st.since < self.policy.window_s:
            return None
        if now - st.last_decision < self.policy.cooldown_s:
            return None
        held = now - st.since
        st.last_decision, st.since = now, now
        return held

    def _decide_pools(self, now: float, total: int, signals: dict[str, float],
                      pools: Mapping[str, Mapping[str, float]]) -> list[ScaleDecision]:
        """The inferencer rule on each pool's own signals; the total stays within the role's
        bounds (a decision made here counts for the next pool), a pool keeps its last instance."""
        role, b, out = "inferencer", self.bounds["inferencer"], []
        for key in [k for k in self.state if k[0] == role and k[1] and k[1] not in pools]:
            del self.state[key]  # a pool gone: forgotten (bounded by the live pools)
        for pool in sorted(pools):
            sig = dict(pools[pool])
            n = int(sig.get("inferencers", 0))
            regime, why = _inferencer(self.policy, n, sig)
            if (regime == "up" and total >= b.max) or (regime == "down" and (total <= b.min or n <= 1)):
                regime = "hold"
            held = self._held(now, (role, pool), regime)
            if held is None:
                continue
            to = total + 1 if regime == "up" else total - 1
            why = why.replace("per inferencer", "per inferencer of the pool")
            reason = (f"pool {pool} ({n} of {total}): {why} for {held:.0f} s (window {self.policy.window_s:g} s); "
                      f"bounds {b.min}..{b.max}")
            # The pool's own queue and wait replace the role-wide ones: they drove it.
            out.append(ScaleDecision(role=role, from_count=total, to_count=to, reason=reason, pool=pool,
                                     signals={**signals, "queued_predicts": sig.get("queued_predicts", 0.0),
                                              "infer_wait_s": sig.get("infer_wait_s", 0.0),
                                              f"{role}_count": float(total), "pool_count": float(n)},
                                     at=time.time()))
            total = to
        return out
