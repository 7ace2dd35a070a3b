"""Per-episode and aggregated feature statistics in lerobot's layout (meta/stats.json and the
stats/<key>/<stat> columns of meta/episodes).

Numeric features get per-dimension stats; cameras get per-channel stats of uint8/255 with
shape (3, 1, 1), as lerobot stores them. Aggregation weights means, variances and quantiles
by frame count, as lerobot's `aggregate_stats` does.
"""

from __future__ import annotations

import numpy as np

QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}


def feature_stats(values: np.ndarray, is_image: bool) -> dict[str, np.ndarray]:
    """values: (T, ...) numeric, or (T, H, W, 3) uint8 for a camera."""
    if is_image:
        x = values.reshape(-1, values.shape[-1]).astype(np.float64) / 255.0  # (T*H*W, C)
        keep = (-1, 1, 1)
    else:
        x = values.reshape(len(values), -1).astype(np.float64)
        keep = values.shape[1:] or (1,)
    # Key order as lerobot writes them: min, max, mean, std, count, q01..q99.
    stats = {
        "min": x.min(axis=0),
        "max": x.max(axis=0),
        "mean": x.mean(axis=0),
        "std": x.std(axis=0),
    }
    out = {k: v.reshape(keep) for k, v in stats.items()}
    if not is_image and np.issubdtype(values.dtype, np.integer):
        out["min"] = out["min"].astype(np.int64)
        out["max"] = out["max"].astype(np.int64)
    out["count"] = np.array([len(values)], np.int64)
    out.update({name: np.quantile(x, q, axis=0).reshape(keep) for name, q in QUANTILES.items()})
    return out


def aggregate(per_episode: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    counts = np.array([s["count"][0] for s in per_episode], np.float64)
    w = counts / counts.sum()

    def wsum(name: str) -> np.ndarray:
        return sum(wi * s[name] for wi, s in zip(w, per_episode))

    mean = wsum("mean")
    # Pooled variance: within-episode variance plus spread of the episode means.
    var = sum(wi * (s["std"] ** 2 + (s["mean"] - mean) ** 2) for wi, s in zip(w, per_episode))
    out = {
        "min": np.min(np.stack([s["min"] for s in per_episode]), axis=0),
        "max": np.max(np.stack([s["max"] for s in per_episode]), axis=0),
        "mean": mean,
        "std": np.sqrt(var),
        "count": np.array([int(counts.sum())], np.int64),
    }
    out.update({name: wsum(name) for name in QUANTILES})
    return out
