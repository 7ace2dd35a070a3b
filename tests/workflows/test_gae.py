"""GAE as the RL workflow computes it, against a direct evaluation of its definition."""

from __future__ import annotations

import numpy as np
import pytest

from workflows.gae import gae


def reference(rewards, values, dones, last_value, gamma, lam):
    T = len(rewards)
    deltas = []
    for t in range(T):
        nxt = last_value if t == T - 1 else values[t + 1]
        deltas.append(rewards[t] + gamma * nxt * (0.0 if dones[t] else 1.0) - values[t])
    adv = []
    for t in range(T):
        total, coef = 0.0, 1.0
        for k in range(t, T):
            total += coef * deltas[k]
            if dones[k]:
                break
            coef *= gamma * lam
        adv.append(total)
    return np.array(adv, np.float32)


def test_gae_matches_its_definition():
    rng = np.random.default_rng(0)
    for _ in range(20):
        T = int(rng.integers(1, 30))
        r, v = rng.standard_normal(T).astype(np.float32), rng.standard_normal(T).astype(np.float32)
        d = rng.random(T) < 0.1
        last = float(rng.standard_normal())
        adv, ret = gae(r, v, d, last, 0.97, 0.9)
        np.testing.assert_allclose(adv, reference(r, v, d, last, 0.97, 0.9), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ret, adv + v, rtol=1e-6)


def test_terminal_step_does_not_bootstrap():
    adv, ret = gae(np.array([0.0, 1.0], np.float32), np.array([0.5, 0.5], np.float32),
                   np.array([False, True]), last_value=100.0, gamma=1.0, lam=1.0)
    assert ret[-1] == 1.0 and ret[0] == 1.0  # the 100 after the terminal step is ignored


def test_value_warmup_zeroes_advantages_until_its_episodes_are_done():
    """`algorithm.value_warmup_episodes`: updates that end within the first N episodes queue
    zero advantages (PPO's policy term has no gradient; the value head still learns the GAE
    returns); later ones are normalised as usual."""
    from protocol.recipe_configs import RLConfig
    from workflows.rl import rollout_rows

    def seg(rewards, values):
        return [{"reward": r, "value": v, "terminated": i == len(rewards) - 1, "step": i}
                for i, (r, v) in enumerate(zip(rewards, values))]

    segments = [seg([0.0, 0.0, 1.0], [0.1, 0.2, 0.3]), seg([0.0, 1.0], [0.5, 0.4])]
    cfg = RLConfig(value_warmup_episodes=4)
    warm = rollout_rows(segments, cfg, episodes_done=4)
    after = rollout_rows(segments, cfg, episodes_done=6)
    assert [r["adv"] for r in warm] == [0.0] * 5
    assert [r["ret"] for r in warm] == [r["ret"] for r in after]  # the value head's targets are kept
    advs = np.array([r["adv"] for r in after])
    assert abs(advs.mean()) < 1e-6 and abs(advs.std() - 1) < 1e-3  # normalised, not zeros
    assert rollout_rows(segments, RLConfig(), episodes_done=1)[0]["adv"] != 0.0  # default: no warm-up


def test_group_advantages_compare_episodes_of_one_reset_seed():
    """`algorithm.advantage: group_success`: an episode's outcome against its group's; a group
    all alike (or a lone member left by a dropped episode) scores 0."""
    from workflows.rl import group_advantages

    adv = group_advantages([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0], [0, 0, 1, 1, 2, 2, 2, 3])
    assert adv[0] == pytest.approx(1.0, abs=1e-5) and adv[1] == pytest.approx(-1.0, abs=1e-5)
    assert adv[2:4] == [0.0, 0.0]  # both succeeded: nothing to rank
    g2 = np.array(adv[4:7])
    assert abs(g2.mean()) < 1e-6 and g2[1] > 0 > g2[0] and g2[0] == g2[2]
    assert adv[7] == 0.0  # alone in its group


def test_rollout_rows_under_group_success_score_every_step_of_an_episode_alike():
    from protocol.recipe_configs import RLConfig
    from workflows.rl import rollout_rows

    def seg(rewards, values):
        return [{"reward": r, "value": v, "terminated": i == len(rewards) - 1, "step": i}
                for i, (r, v) in enumerate(zip(rewards, values))]

    segments = [seg([0.0, 0.0, 1.0], [0.1, 0.2, 0.3]), seg([0.0, 0.2], [0.5, 0.4])]
    cfg = RLConfig(advantage="group_success", group_size=2, episodes_per_update=2)
    rows = rollout_rows(segments, cfg, episodes_done=2, outcomes=[1.0, 0.0], groups=[0, 0])
    assert [float(r["adv"]) for r in rows] == pytest.approx([1.0, 1.0, 1.0, -1.0, -1.0], abs=1e-5)
    plain = rollout_rows(segments, RLConfig(), episodes_done=2)
    assert [r["ret"] for r in rows] == [r["ret"] for r in plain]  # the value head's targets: GAE's
    with pytest.raises(ValueError, match="outcome and group"):
        rollout_rows(segments, cfg, episodes_done=2)


def test_group_success_config_is_checked_naming_the_field():
    from pydantic import ValidationError

    from protocol.recipe_configs import RLConfig

    cases = [({"advantage": "group_success"}, "group_size"),
             ({"advantage": "group_success", "group_size": 3}, "episodes_per_update"),
             ({"advantage": "group_success", "group_size": 2, "steps_per_update": 64}, "steps_per_update"),
             ({"group_size": 4}, "group_size"),  # read only by group_success: refused, not ignored
             ({"advantage": "grpo"}, "advantage")]
    for fields, named in cases:
        with pytest.raises(ValidationError) as err:
            RLConfig(**fields)
        assert err.value.errors()[0]["loc"][0] == named, (fields, err.value)
    assert RLConfig(advantage="group_success", group_size=4).episodes_per_update == 16
