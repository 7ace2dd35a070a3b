"""Priority that routes (issue 29 item 3), as pure logic: weights, the floor share, the order."""

from __future__ import annotations

import pytest

from master.fairshare import FairShare, clamp_priority, floor_share, simulate, weight
from protocol.policy import PRIORITY_MAX, PRIORITY_MIN


def test_weights_rise_with_priority_and_stay_bounded():
    assert weight(0) == 1.0 and weight(10) == pytest.approx(4.0) and weight(-10) == pytest.approx(0.25)
    ws = [weight(p) for p in range(PRIORITY_MIN, PRIORITY_MAX + 1)]
    assert ws == sorted(ws) and len(set(ws)) == len(ws)
    assert weight(10_000) == weight(PRIORITY_MAX) and weight(-10_000) == weight(PRIORITY_MIN)
    assert clamp_priority(10, ceiling=2) == 2 and clamp_priority(-50, ceiling=2) == PRIORITY_MIN


@pytest.mark.parametrize("high,low", [(10, 0), (10, -10), (5, 0), (3, 3)])
def test_backlogged_tenants_get_their_floor_share_and_the_higher_goes_first(high, low):
    got = simulate(FairShare(), {"hi": high, "lo": low}, 340)
    share = got.count("lo") / len(got)
    floor = floor_share(low, [high])
    assert share >= floor - 1 / len(got)  # within one grant of the floor
    assert got[0] == "hi" or high == low
    # never starved: the low tenant's longest wait is bounded by the weight ratio
    gaps = "".join("l" if t == "lo" else "h" for t in got).split("l")
    assert max(len(g) for g in gaps) <= int(weight(high) / weight(low)) + 1


def test_a_newcomer_enters_at_the_clock_without_credit():
    fair = FairShare()
    simulate(fair, {"a": 0}, 100)  # a ran alone for a while
    got = simulate(fair, {"a": 0, "b": 0}, 20)
    # b, just in, does not get 100 grants in a row for the time it was away: it alternates
    assert got.count("b") in (10, 11) and "bbb" not in "".join(got)


def test_three_tiers_share_in_weight_order():
    got = simulate(FairShare(), {"gold": 10, "std": 0, "bulk": -10}, 5 * 53)
    counts = {t: got.count(t) for t in ("gold", "std", "bulk")}
    assert counts["gold"] > counts["std"] > counts["bulk"] > 0
    assert counts["bulk"] / len(got) >= floor_share(-10, [10, 0]) - 1 / len(got)


def test_leaving_between_jobs_keeps_the_debt_so_the_low_tenant_is_not_starved():
    """A high tenant whose line empties after every grant (an RL tenant: one job at a time)
    comes back behind a low tenant that waited, not level with it."""
    fair = FairShare()
    got = []
    for _ in range(40):
        for t in ("hi", "lo"):
            fair.enter(t)
        t = min(("hi", "lo"), key=lambda t: fair.key(t, {"hi": 10, "lo": 0}[t]))
        fair.charge(t, {"hi": 10, "lo": 0}[t])
        got.append(t)
        fair.leave(t)  # it has nothing queued until its next job
    assert got[0] == "hi" and got.count("hi") == 32 and got.count("lo") == 8
    assert len(fair.passes) <= 2


def test_the_gate_gives_a_freed_turn_to_the_best_ranked_waiter_not_the_fastest_retry():
    from master.fairshare import GateLine

    line = GateLine()
    # the gate is full: both wait (the low tenant asked first)
    assert line.ask("lo/w", "lo", 0, free=0, now=0.0) == 0
    assert line.ask("hi/w", "hi", 10, free=0, now=0.1) == 0  # same pass, higher priority: first
    # a turn frees; the low tenant retries first: the turn is held for the high one
    assert line.ask("lo/w", "lo", 0, free=1, now=0.2) == 1
    assert line.ask("hi/w", "hi", 10, free=1, now=0.3) == 0 and "hi/w" not in line.waiting
    # round after round both wait while the gate is full, then one turn frees and the low
    # tenant always retries first: the high one gets ~4 turns in 5, the low one the rest
    got = []
    for i in range(25):
        line.ask("lo/w", "lo", 0, free=0, now=1.0 + i)
        line.ask("hi/w", "hi", 10, free=0, now=1.0 + i)
        for key, t, p in (("lo/w", "lo", 0), ("hi/w", "hi", 10)):
            if line.ask(key, t, p, free=1, now=1.5 + i) < 1:
                got.append(t)
                break
        line.settle(set())  # its rollout ends before the next round
    assert len(got) == 25 and got.count("hi") == 20 and got.count("lo") == 5  # slowed, not starved
    # a waiter gone quiet past the TTL no longer holds a turn
    line.ask("gone/w", "gone", 10, free=0, now=100.0)
    assert line.ask("lo/w", "lo", 0, free=1, now=100.0 + line.policy.gate_waiter_ttl_s + 1) == 0


def test_the_gate_line_is_bounded_and_skips_tenants_at_their_quota():
    from dataclasses import replace

    from master.fairshare import GateLine
    from protocol.policy import FAIR_SHARE

    line = GateLine(policy=replace(FAIR_SHARE, gate_max_waiters=3))
    for i in range(10):
        line.ask(f"t{i}/w", f"t{i}", 0, free=0, now=0.0)
    assert len(line.waiting) == 3
    line2 = GateLine()
    line2.ask("hi/w2", "hi", 10, free=0, now=0.0)  # hi waits with a second workload...
    # ... but holds its quota's worth already: it cannot take the turn, so lo gets it
    assert line2.ask("lo/w", "lo", 0, free=1, now=0.1, blocked={"hi"}) == 0


def test_the_line_counts_who_is_still_asking():
    from master.fairshare import GateLine

    line = GateLine()
    ttl = line.policy.gate_waiter_ttl_s
    assert line.ask("a/j1", "a", 0, free=0, now=100.0) == 0
    assert line.ask("a/j2", "a", 0, free=0, now=100.0) == 1
    assert line.ask("b/j1", "b", 5, free=0, now=100.0 + ttl / 2) == 0  # b's priority ranks it first
    assert line.waiting_by_tenant(100.0 + ttl / 2) == {"a": 2, "b": 1}
    # a's rollouts stopped asking: past the ttl they are not waiting any more, b's still are
    assert line.waiting_by_tenant(100.0 + ttl + 0.01) == {"b": 1}
