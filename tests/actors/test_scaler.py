"""The scaler's policy on made-up signal histories (actors/health/scaler.py is pure: the clock is an
argument): each role's rule from several signals (env: holders per worker with waiting rollouts
or slow steps; trainer: ready backlog on busy trainers; inferencer: queue wait or depth),
priority weighting, hysteresis in value and time, cooldown, no flapping, bounds, no trainer
fewer while jobs queue; and its inputs (with their rates) read from real `Heartbeat` messages."""

from __future__ import annotations

from actors.health.scaler import RateWindow, Scaler, pool_signals_from_beats, priority_weight, signals_from_beats
from protocol.messages import Heartbeat
from protocol.policy import ScalerPolicy
from protocol.scaling import parse_bounds

POLICY = ScalerPolicy(every_s=5, window_s=30, cooldown_s=60)


def _run(scaler: Scaler, counts: dict[str, int], signals_at, until: float, step: float = 5.0, start: float = 0.0):
    """Decide every ``step`` s from ``start`` up to ``until``, applying each decision; the decisions made."""
    made = []
    t = start
    while t <= until:
        for d in scaler.decide(t, counts, signals_at(t)):
            made.append((t, d))
            counts[d.role] = d.to_count
        t += step
    return made


BUSY = {"ready_jobs": 20.0, "ready_jobs_weighted": 20.0, "queued_jobs": 20.0, "trainer_busy": 0.9}


def test_a_ready_backlog_on_busy_trainers_adds_one_after_the_window_then_waits_the_cooldown():
    s = Scaler(POLICY, parse_bounds("trainer=1:3"))
    counts = {"trainer": 1}
    made = _run(s, counts, lambda t: BUSY, until=200)
    times = [t for t, _ in made]
    assert times[0] == 30 and times[1] - times[0] >= 60, times  # window, then cooldown
    assert [d.to_count for _, d in made] == [2, 3]  # and never past the max bound
    d = made[0][1]
    assert d.role == "trainer" and d.from_count == 1
    assert ("ready_jobs_weighted per trainer 20.00 at or above 4 and trainer_busy 0.90 at or above 0.6"
            in d.reason), d.reason
    assert d.signals["ready_jobs_weighted"] == 20.0 and d.signals["trainer_busy"] == 0.9
    assert d.signals["trainer_count"] == 1.0
    assert counts["trainer"] == 3


def test_a_backlog_on_an_idle_trainer_is_not_a_capacity_problem():
    s = Scaler(POLICY, parse_bounds("trainer=1:3"))
    counts = {"trainer": 1}
    # 20 jobs ready but the trainer steps 30% of the time (held up elsewhere): no trainer more,
    # and none fewer either (jobs are queued).
    assert _run(s, counts, lambda t: {**BUSY, "trainer_busy": 0.3}, until=300) == []
    # Reserved / filling jobs (queued, none ready) on a busy trainer wait for rollouts, not it.
    s2 = Scaler(POLICY, parse_bounds("trainer=1:3"))
    assert _run(s2, counts, lambda t: {"queued_jobs": 20.0, "ready_jobs": 0.0, "trainer_busy": 0.9}, until=300) == []
    assert counts == {"trainer": 1}


def test_a_spike_shorter_than_the_window_changes_nothing_and_the_band_holds():
    s = Scaler(POLICY, parse_bounds("trainer=1:4,env=1:4,inferencer=1:4"))
    counts = {"trainer": 2, "env": 2, "inferencer": 2}

    def sig(t):  # 25 s of pressure on every role, then inside each band (between down and up)
        if t < 25:
            return {**BUSY, "active_rollouts": 8.0, "waiting_rollouts": 5.0, "waiting_rollouts_weighted": 5.0,
                    "queued_predicts": 40.0, "infer_wait_s": 1.0}
        return {"ready_jobs": 4.0, "ready_jobs_weighted": 4.0, "queued_jobs": 4.0, "trainer_busy": 0.5,
                "active_rollouts": 2.0, "queued_predicts": 4.0, "infer_wait_s": 0.1}

    made = _run(s, counts, sig, until=600)
    assert made == [] and counts == {"trainer": 2, "env": 2, "inferencer": 2}


def test_pressure_flickering_across_a_threshold_never_moves_a_count():
    """No flapping: a signal that crosses its up threshold every other look (a noisy queue)
    resets the window each time, and so never scales; a sustained one still does, once."""
    s = Scaler(POLICY, parse_bounds("inferencer=1:4"))
    counts = {"inferencer": 2}

    def flicker(t):
        return {"infer_wait_s": 0.5 if int(t / 5) % 2 else 0.1, "queued_predicts": 4.0}

    assert _run(s, counts, flicker, until=600) == [] and counts == {"inferencer": 2}
    made = _run(s, counts, lambda t: {"infer_wait_s": 0.5, "queued_predicts": 0.0}, until=655, start=605)
    assert [(d.role, d.to_count) for _, d in made] == [("inferencer", 3)]
    # Straight after it the pressure is gone (both low): the role waits out the cooldown and the
    # window before it goes down again, never at once.
    later = _run(s, counts, lambda t: {"infer_wait_s": 0.0, "queued_predicts": 0.0}, until=800, start=660)
    assert later and later[0][0] - made[0][0] >= POLICY.cooldown_s and later[0][1].to_count == 2, later
    assert "infer_wait_s 0.000 at or below 0.05 and queued_predicts per inferencer 0.00 at or below 1" in \
        later[0][1].reason


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


def test_rollouts_waiting_add_an_env_worker_when_the_workers_hold_their_line():
    s = Scaler(POLICY, parse_bounds("env=1:4"))
    counts = {"env": 1}
    # The gate's 3 turns held on one worker, 2 rollouts waiting for a turn: one worker more; with
    # two workers 1.5 holders each, below the line: the gate's cap binds, not the workers, so
    # the line goes on waiting and no third worker comes.
    sig = {"active_rollouts": 3.0, "waiting_rollouts": 2.0, "waiting_rollouts_weighted": 2.0}
    made = _run(s, counts, lambda t: sig, until=300)
    assert [(t, d.to_count) for t, d in made] == [(30, 2)] and counts == {"env": 2}
    d = made[0][1]
    assert ("active_rollouts per env 3.00 at or above 2 and waiting_rollouts_weighted 2.00 at or above 2"
            in d.reason), d.reason
    assert d.signals["waiting_rollouts"] == 2.0 and d.signals["env_count"] == 1.0
    # Loaded workers with nothing waiting and quick steps: enough workers, nothing moves.
    s2, c2 = Scaler(POLICY, parse_bounds("env=1:4")), {"env": 1}
    assert _run(s2, c2, lambda t: {"active_rollouts": 3.0, "env_step_s": 0.01}, until=300) == []


def test_slow_simulator_steps_add_an_env_worker_and_idle_workers_go():
    s = Scaler(POLICY, parse_bounds("env=1:4"))
    counts = {"env": 2}
    made = _run(s, counts, lambda t: {"active_rollouts": 4.0, "env_step_s": 0.4}, until=30)
    assert [d.to_count for _, d in made] == [3]
    assert "env_step_s 0.400 at or above 0.25" in made[0][1].reason, made[0][1].reason
    # The same slow steps on few holders per worker are not the workers' load: no more.
    assert _run(s, counts, lambda t: {"active_rollouts": 3.0, "env_step_s": 0.4}, until=300, start=35) == []
    # Then the load goes: down one per cooldown, but not while a rollout waits for a turn.
    assert _run(s, counts, lambda t: {"active_rollouts": 0.0, "waiting_rollouts": 1.0}, until=600, start=305) == []
    made = _run(s, counts, lambda t: {"active_rollouts": 0.0}, until=800, start=605)
    assert [d.to_count for _, d in made] == [2, 1] and "no rollout waiting" in made[0][1].reason


def test_inferencer_queue_wait_or_depth_adds_one_and_both_low_remove_one():
    s = Scaler(POLICY, parse_bounds("inferencer=1:3"))
    counts = {"inferencer": 1}
    made = _run(s, counts, lambda t: {"infer_wait_s": 0.4, "queued_predicts": 2.0}, until=30)
    assert [d.to_count for _, d in made] == [2] and "infer_wait_s 0.400 at or above 0.25" in made[0][1].reason
    made = _run(s, counts, lambda t: {"infer_wait_s": 0.01, "queued_predicts": 30.0}, until=200, start=35)
    assert [d.to_count for _, d in made] == [3]
    assert "queued_predicts per inferencer 15.00 at or above 8" in made[0][1].reason, made[0][1].reason
    # Wait low but still a queue above the down line: holds; both low: down.
    assert _run(s, counts, lambda t: {"infer_wait_s": 0.01, "queued_predicts": 6.0}, until=400, start=205) == []
    made = _run(s, counts, lambda t: {"infer_wait_s": 0.0, "queued_predicts": 0.0}, until=440, start=405)
    assert [d.to_count for _, d in made] == [2]


def _beat(role, instance="1", seq=1, sent_at=0.0, pid=1, **kw):
    return Heartbeat(role=role, instance=f"{role}-{instance}", pid=pid, host="h", started_at=0.0, seq=seq,
                     state="ready", in_flight=0, interval_s=1.0, sent_at=sent_at, **kw)


def test_priority_weighs_waiting_rollouts_and_ready_jobs():
    assert priority_weight(0) == 1 and priority_weight(-10) == 1  # the default and below: face value
    assert priority_weight(5) == 2 and priority_weight(10) == 4 and priority_weight(99) == 4  # clamped
    master = _beat("master", tenant_gauges={
        "priority": {"hi": 10.0, "lo": -10.0, "mid": 0.0},
        "ready_jobs": {"hi": 1.0, "lo": 2.0}, "waiting_rollouts": {"hi": 1.0, "mid": 1.0},
        "queue_depth": {"hi": 1.0, "lo": 2.0}, "active_rollouts": {"lo": 3.0}})
    sig = signals_from_beats([master])
    assert (sig["ready_jobs"], sig["ready_jobs_weighted"]) == (3.0, 6.0)  # 1 x 4 + 2 x 1
    assert (sig["waiting_rollouts"], sig["waiting_rollouts_weighted"]) == (2.0, 5.0)  # 1 x 4 + 1 x 1

    # One default-priority rollout waiting is below env_waiting_up (2); one at priority 10 is over it.
    def env_decisions(waiting_by_prio):
        tg = {"priority": {f"t{p}": float(p) for p in waiting_by_prio},
              "waiting_rollouts": {f"t{p}": 1.0 for p in waiting_by_prio}, "active_rollouts": {"x": 3.0}}
        s, counts = Scaler(POLICY, parse_bounds("env=1:4")), {"env": 1}
        return _run(s, counts, lambda t: signals_from_beats([_beat("master", tenant_gauges=tg)]), until=60)

    assert env_decisions([0]) == [] and env_decisions([-10]) == []
    made = env_decisions([10])
    assert [d.to_count for _, d in made] == [2] and "waiting_rollouts_weighted 4.00" in made[0][1].reason

    # Trainers: 2 ready jobs of a default tenant per trainer hold; the same of a priority-10 one add one.
    def trainer_decisions(prio):
        tg = {"priority": {"t": prio}, "ready_jobs": {"t": 2.0}, "queue_depth": {"t": 2.0}}
        s, counts = Scaler(POLICY, parse_bounds("trainer=1:4")), {"trainer": 1}
        return _run(s, counts, lambda t: {**signals_from_beats([_beat("master", tenant_gauges=tg)]),
                                          "trainer_busy": 0.9}, until=60)

    assert trainer_decisions(0.0) == [] and [d.to_count for _, d in trainer_decisions(10.0)] == [2]


def test_signals_are_read_from_the_master_and_worker_beats_with_rates_between_two_looks():
    beats = [
        _beat("master", tenant_gauges={"queue_depth": {"a": 3.0, "b": 2.0}, "ready_jobs": {"a": 2.0},
                                       "jobs_in_flight": {"a": 1.0}, "active_rollouts": {"a": 2.0, "other": 1.0},
                                       "waiting_rollouts": {"b": 1.0}}),
        _beat("inferencer", "1", seq=5, sent_at=10.0, gauges={"queued": 4.0, "served": 30.0, "batch_wait_s": 6.0}),
        _beat("inferencer", "2", seq=5, sent_at=10.0, gauges={"queued": 1.0, "served": 10.0, "batch_wait_s": 0.1}),
        _beat("trainer", "1", seq=5, sent_at=10.0, gauges={"queued": 99.0, "busy_s": 8.0}),  # not predicts
        _beat("trainer", "2", seq=5, sent_at=10.0, gauges={"busy_s": 3.0}),
        _beat("env", "1", seq=5, sent_at=10.0, gauges={"steps": 110.0, "step_s": 6.0}),
        _beat("env", "2", seq=5, sent_at=10.0, gauges={"steps": 30.0, "step_s": 2.0}),
    ]
    base = {"queued_jobs": 5.0, "ready_jobs": 2.0, "ready_jobs_weighted": 2.0, "jobs_in_flight": 1.0,
            "active_rollouts": 3.0, "waiting_rollouts": 1.0, "waiting_rollouts_weighted": 1.0,
            "queued_predicts": 5.0}
    # No earlier look: no rate yet.
    assert signals_from_beats(beats) == {**base, "infer_wait_s": 0.0, "env_step_s": 0.0, "trainer_busy": 0.0}
    before = {(b.role, b.instance): b for b in [
        _beat("inferencer", "1", seq=1, sent_at=5.0, gauges={"served": 10.0, "batch_wait_s": 1.0}),
        _beat("inferencer", "2", seq=1, sent_at=5.0, gauges={"served": 0.0, "batch_wait_s": 0.0}),
        _beat("trainer", "1", seq=1, sent_at=5.0, gauges={"busy_s": 4.0}),
        _beat("trainer", "2", seq=1, sent_at=5.0, gauges={"busy_s": 3.0}),
        _beat("env", "1", seq=1, sent_at=5.0, gauges={"steps": 10.0, "step_s": 1.0}),
        _beat("env", "2", seq=1, sent_at=5.0, pid=7, gauges={"steps": 0.0, "step_s": 0.0}),  # restarted since
    ]}
    sig = signals_from_beats(beats, before)
    assert sig["infer_wait_s"] == 0.25  # the worst: 5 s over 20 served (the other: 0.01)
    assert sig["trainer_busy"] == 0.4  # (4 + 0) busy s over 10 s of two trainers' wall time
    assert sig["env_step_s"] == 0.05  # 5 s over 100 steps; the restarted worker's totals are not a rate


def test_a_policy_whose_down_threshold_is_not_below_its_up_is_refused_naming_both():
    import pytest

    with pytest.raises(ValueError, match="trainer_busy_down=0.7 must be >= 0 and below trainer_busy_up=0.6"):
        ScalerPolicy(trainer_busy_down=0.7)


def test_rates_are_taken_over_the_rate_window_and_gone_instances_are_forgotten():
    w = RateWindow(span_s=15)
    beats = {t: _beat("trainer", seq=int(t), sent_at=t, gauges={"busy_s": 0.0 if t < 10 else t - 10})
             for t in range(0, 40, 5)}
    assert w.look(0, [beats[0]]) == {}  # nothing earlier yet
    assert w.look(5, [beats[5]])[("trainer", "trainer-1")].seq == 0  # the oldest seen, early on
    assert w.look(5, [beats[5]])[("trainer", "trainer-1")].seq == 0  # the same beat again: no new entry
    for t in (10, 15, 20):
        before = w.look(t, [beats[t]])
    assert before[("trainer", "trainer-1")].seq == 5  # the newest at least 15 s older than t=20
    # 10 busy s over the 15 s since the beat of t=5 (idle for the first 5 of them): one rate.
    assert signals_from_beats([beats[20]], before)["trainer_busy"] == 10 / 15
    assert len(w.seen[("trainer", "trainer-1")]) <= 4  # bounded: the span's beats plus one
    w.look(25, [])  # the instance is gone
    assert w.seen == {}


# -- inference pools: each inferencer serves one base; its beat names the pool ------------------
def test_a_starved_pool_gets_an_inferencer_of_its_own_and_the_default_pool_is_left_alone():
    """Pool "other" waits 0.4 s per predict on its one instance while the default pool's two are
    quiet but busy (inside their band): one inferencer more, of "other", after the window; then
    the cooldown of ("inferencer", "other"); the default pool never moves. A flicker on the
    default pool (every other look) never scales it either."""
    s = Scaler(POLICY, parse_bounds("inferencer=1:4"))
    pools = {"default": {"inferencers": 2.0, "queued_predicts": 4.0, "infer_wait_s": 0.1},
             "other": {"inferencers": 1.0, "queued_predicts": 1.0, "infer_wait_s": 0.4}}
    made = []
    for t in range(0, 205, 5):
        flick = {"infer_wait_s": 0.5 if (t // 5) % 2 else 0.1}
        look = {"default": {**pools["default"], **flick}, "other": pools["other"]}
        # The role-wide signals (the worst instance) say up too: the pools decide, not they.
        for d in s.decide(float(t), {"inferencer": 3 + len(made)}, {"infer_wait_s": 0.5, "queued_predicts": 5.0},
                          pools=look):
            made.append((t, d))
            pools["other"]["inferencers"] += 1  # the new instance joins the pool; its wait stays high
    assert [(t, d.pool, d.from_count, d.to_count) for t, d in made] == [(30, "other", 3, 4)], made
    d = made[0][1]
    assert d.role == "inferencer" and d.reason.startswith("pool other (1 of 3): infer_wait_s 0.400 at or above 0.25")
    assert d.signals["infer_wait_s"] == 0.4 and d.signals["pool_count"] == 1.0 and d.signals["inferencer_count"] == 3
    # After it the starved pool waits at the max bound (4 in all: no second decision above), and
    # the default pool never decided anything.
    assert s.state[("inferencer", "default")].last_decision == float("-inf")


def test_pools_share_the_total_bounds_and_a_pool_keeps_its_last_instance():
    s = Scaler(POLICY, parse_bounds("inferencer=1:3"))
    starved = {"inferencers": 1.0, "queued_predicts": 20.0, "infer_wait_s": 0.0}
    # Two starved pools, room for one more in all: one decision (the first pool by name), not two.
    made = [d for t in range(0, 35, 5) for d in s.decide(float(t), {"inferencer": 2}, {}, pools={"a": starved, "b": starved})]
    assert [(d.pool, d.to_count) for d in made] == [("a", 3)], made
    assert "queued_predicts per inferencer of the pool 20.00 at or above 8" in made[0].reason, made[0].reason
    # Idle pools go down one per cooldown, but never below one instance each (a pool with no
    # instance has no beat left to show its pressure), nor the total below its min.
    s = Scaler(POLICY, parse_bounds("inferencer=1:8"))
    pools = {"a": {"inferencers": 3.0}, "b": {"inferencers": 1.0}}
    made = []
    for t in range(0, 600, 5):
        for d in s.decide(float(t), {"inferencer": int(sum(p["inferencers"] for p in pools.values()))}, {}, pools=pools):
            made.append((t, d))
            pools[d.pool]["inferencers"] += d.to_count - d.from_count
    assert [(d.pool, d.from_count, d.to_count) for _, d in made] == [("a", 4, 3), ("a", 3, 2)], made
    assert made[1][0] - made[0][0] >= POLICY.cooldown_s
    assert pools == {"a": {"inferencers": 1.0}, "b": {"inferencers": 1.0}}
    # A pool that is gone is forgotten (the state stays bounded by the live pools).
    s.decide(600.0, {"inferencer": 1}, {}, pools={"a": {"inferencers": 1.0}})
    assert ("inferencer", "b") not in s.state


def test_pool_signals_are_read_from_the_inferencers_beats():
    beats = [
        _beat("inferencer", "1", seq=5, sent_at=10.0, pool="p1", gauges={"queued": 4.0, "served": 30.0, "batch_wait_s": 6.0}),
        _beat("inferencer", "2", seq=5, sent_at=10.0, pool="p1", gauges={"queued": 1.0, "served": 10.0, "batch_wait_s": 0.1}),
        _beat("inferencer", "3", seq=5, sent_at=10.0, pool="p2", gauges={"queued": 7.0, "served": 5.0, "batch_wait_s": 1.0}),
        _beat("inferencer", "4", seq=5, sent_at=10.0, gauges={"queued": 9.0}),  # an older sender: no pool
        _beat("trainer", "1", seq=5, sent_at=10.0, pool="p1", gauges={"queued": 99.0}),  # not an inferencer
    ]
    before = {(b.role, b.instance): b for b in [
        _beat("inferencer", "1", seq=1, sent_at=5.0, gauges={"served": 10.0, "batch_wait_s": 1.0}),
        _beat("inferencer", "2", seq=1, sent_at=5.0, gauges={"served": 0.0, "batch_wait_s": 0.0}),
        _beat("inferencer", "3", seq=1, sent_at=5.0, gauges={"served": 1.0, "batch_wait_s": 0.2}),
    ]}
    assert pool_signals_from_beats(beats, before) == {
        "p1": {"inferencers": 2.0, "queued_predicts": 5.0, "infer_wait_s": 0.25},  # the worst: 5 s over 20
        "p2": {"inferencers": 1.0, "queued_predicts": 7.0, "infer_wait_s": 0.2},
    }
    assert pool_signals_from_beats(beats)["p2"]["infer_wait_s"] == 0.0  # no earlier look: no rate yet
