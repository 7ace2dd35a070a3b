"""Generalised advantage estimation, as the RL workflow computes it (numpy, no I/O)."""

from __future__ import annotations

import numpy as np


def gae(rewards_T: np.ndarray, values_T: np.ndarray, dones_T: np.ndarray, last_value: float,
        gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over one trajectory segment.

    ``dones_T[t]`` is True where the episode *terminated* after step t (no bootstrap); a
    truncated segment end bootstraps from ``last_value``. Returns (advantages_T, returns_T).
    """
    T = len(rewards_T)
    adv = np.zeros(T, np.float32)
    last = 0.0
    for t in reversed(range(T)):
        next_value = last_value if t == T - 1 else values_T[t + 1]
        nonterminal = 0.0 if dones_T[t] else 1.0
        delta = rewards_T[t] + gamma * next_value * nonterminal - values_T[t]
        last = delta + gamma * lam * nonterminal * last
        adv[t] = last
    return adv, (adv + values_T).astype(np.float32)
