"""The scaler's policy on made-up signal histories (actors/scaler.py is pure: the clock is an
argument): hysteresis in value and time, cooldown, bounds, no trainer fewer while jobs queue;
and its inputs read from real `Heartbeat` messages."""

from __future__ import annotations

from actors.scaler import Scaler, signals_from_beats
from protocol.messages import Heartbeat
from protocol.policy import ScalerPolicy
from protocol.scaling import parse_bounds

POLICY = ScalerPolicy(every_s=5, window_s=30, cooldown_s=60)


def _run(scaler: Scaler, counts: dict[str, int], signals_at, until: float, step: float = 5.0):
    """Decide every ``step`` s up to ``until``, applying each decision; the decisions made."""
    made = []
    t = 0.0
    while t <= until:
        for d in scaler.decide(t, counts, signals_at(t)):
            made.append((t, d))
            counts[d.role] = d.to_count
        t += step
    return made


def test_sustained_backlog_adds_a_trainer_after_the_window_then_waits_the_cooldown():
    s = Scaler(POLICY, parse_bounds("trainer=1:3"))
    counts = {"trainer": 1}
    made = _run(s, counts, lambda t: {"queued_jobs": 20.0}, until=200)
    times = [t for t, _ in made]
    assert times[0] == 30 and times[1] - times[0] >= 60, times  # window, then cooldown
    assert [d.to_count for _, d in made] == [2, 3]  # and never past the max bound
    d = made[0][1]
    assert d.role == "trainer" and d.from_count == 1 and "queued_jobs per trainer 20.00 at or above 4" in d.reason
    assert d.signals["queued_jobs"] == 20.0 and d.signals["queued_jobs_per_instance"] == 20.0
    assert counts["trainer"] == 3


def test_a_spike_shorter_than_the_window_changes_nothing_and_the_band_holds():
    s = Scaler(POLICY, parse_bounds("trainer=1:4,env=1:4"))
    counts = {"trainer": 2, "env": 2}
    # 25 s of a big backlog, then back into the band between down (0.5) and up (4) per trainer.
    made = _run(s, counts, lambda t: {"queued_jobs": 40.0 if t < 25 else 4.0, "active_rollouts": 2.0}, until=600)
    assert made == [] and counts == {"trainer": 2, "env": 2}


def test_idle_roles_shrink_to_their_min_one_step_per_cooldown_but_not_trainers_with_jobs_queued():
    s = Scaler(POLICY, parse_bounds("trainer=1:4,env=2:8,inferencer=1:4"))
    counts = {"trainer": 3, "env": 5, "inferencer": 2}
    made = _run(s, counts, lambda t: {"queued_jobs": 1.0, "active_rollouts": 0.0, "queued_predicts": 0.0}, until=400)
    assert counts == {"trainer": 3, "env": 2, "inferencer": 1}  # a queued job keeps every trainer
    env_times = [t for t, d in made if d.role == "env"]
    assert len(env_times) == 3 and all(b - a >= 60 for a, b in zip(env_times, env_times[1:]))
    s2 = Scaler(POLICY, parse_bounds("trainer=0:4"))
    c2 = {"trainer": 2}
    _run(s2, c2, lambda t: {"queued_jobs": 0.0}, until=400)
    assert c2 == {"trainer": 0}  # nothing queued: down to the min bound, 0


def test_signals_are_read_from_the_master_and_inferencer_beats():
    def beat(role, **kw):
        return Heartbeat(role=role, instance=f"{role}-1", pid=1, host="h", started_at=0.0, seq=1, state="ready",
                         in_flight=0, interval_s=1.0, sent_at=0.0, **kw)

    sig = signals_from_beats([
        beat("master", tenant_gauges={"queue_depth": {"a": 3.0, "b": 2.0}, "jobs_in_flight": {"a": 1.0},
                                      "active_rollouts": {"a": 2.0, "other": 1.0}}),
        beat("inferencer", gauges={"queued": 4.0}), beat("inferencer", gauges={"queued": 1.0}),
        beat("trainer", gauges={"queued": 99.0}),  # a trainer's gauges are not predicts
    ])
    assert sig == {"queued_jobs": 5.0, "jobs_in_flight": 1.0, "active_rollouts": 3.0, "queued_predicts": 5.0}
