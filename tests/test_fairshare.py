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
