"""Encode / decode throughput of typed wire messages (`protocol.wire`), one process, no bus.

    python -m bench.wire_codec                       # table on stdout
    python -m bench.wire_codec --json out.json       # and the rows as JSON
    python -m bench.wire_codec --min-time-s 2        # longer runs, steadier figures
    python -m bench.wire_codec --repeats 7           # best of 7 (a shared machine is noisy)

Four messages that stand for the traffic: a small request (a reserve), a job record (what the
jobs KV holds, with metrics), an inference request (two 224x224 RGB frames and a state) and a
training micro-batch (8 rows of two 224x224 frames, states, actions, RL extras). Each is encoded
and decoded repeatedly for at least --min-time-s, --repeats times; the table shows the best
rate (messages per second: other processes only ever slow a run down) and the encoded size. Decoding includes the strict checks (kind, version, every field's type).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from protocol.messages import JobRecord, PredictRequest, QueuePutRequest, ReserveRequest  # noqa: E402
from protocol.wire import decode, encode  # noqa: E402


def messages() -> dict[str, Any]:
    rng = np.random.default_rng(0)

    def frames(*shape: int) -> np.ndarray:
        return rng.integers(0, 255, size=shape, dtype=np.uint8)

    b, horizon, action_dim, state_dim = 8, 8, 7, 8
    return {
        "small request (tq.reserve)": ReserveRequest(tenant="acme", task="rl", priority=3, key="k-17",
                                                     workload="w-acme-1"),
        "job record (job.record)": JobRecord(
            tenant="acme", job="j-000123", task="rl", state="ready", created_at=1.7e9, updated_at=1.7e9 + 3,
            items=16, steps=16, samples=512, behaviour_version=41, ready_at=1.7e9 + 2, lease_owner="trainer-0",
            metrics={"loss": 0.31, "grad_norm": 1.2, "kl": 0.01, "entropy": 1.9}, key="w-acme-1:41",
            workload="w-acme-1", trace={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}),
        "inference request (2 x 224x224x3)": PredictRequest(
            tenant="acme", images={"agentview": frames(224, 224, 3), "wrist": frames(224, 224, 3)},
            state=rng.standard_normal(state_dim).astype(np.float32), instruction="pick up the red block",
            request_id="r-1", workload="w-acme-1"),
        "train batch (8 x 2 x 224x224x3)": QueuePutRequest(
            tenant="acme", job="j-000123", seq=5,
            images={"agentview": frames(b, 224, 224, 3), "wrist": frames(b, 224, 224, 3)},
            state=rng.standard_normal((b, state_dim)).astype(np.float32),
            instructions=["pick up the red block"] * b,
            actions=rng.standard_normal((b, horizon, action_dim)).astype(np.float32),
            old_log_prob=rng.standard_normal(b).astype(np.float32),
            advantages=rng.standard_normal(b).astype(np.float32),
            returns=rng.standard_normal(b).astype(np.float32), behaviour_version=41),
    }


def rate(fn: Callable[[], Any], min_time_s: float) -> float:
    """Calls per second of ``fn``: batches doubled until one batch takes ``min_time_s``."""
    fn()  # warm caches (decoders built per class on first use)
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= min_time_s:
            return n / dt
        n *= 2


def best_rate(fn: Callable[[], Any], min_time_s: float, repeats: int) -> float:
    return max(rate(fn, min_time_s) for _ in range(repeats))


def run(min_time_s: float, repeats: int = 1) -> list[dict[str, Any]]:
    rows = []
    for name, msg in messages().items():
        data = encode(msg)
        back = decode(data, type(msg))
        assert type(back) is type(msg)
        rows.append({"message": name, "bytes": len(data),
                     "encode_per_s": best_rate(lambda m=msg: encode(m), min_time_s, repeats),
                     "decode_per_s": best_rate(lambda d=data, t=type(msg): decode(d, t), min_time_s, repeats)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = [f"| {'message':36} | {'bytes':>9} | {'encode / s':>11} | {'decode / s':>11} |",
           f"|{'-' * 38}|{'-' * 10}:|{'-' * 12}:|{'-' * 12}:|"]
    for r in rows:
        out.append(f"| {r['message']:36} | {r['bytes']:9d} | {r['encode_per_s']:11,.0f} | {r['decode_per_s']:11,.0f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-time-s", type=float, default=0.5, help="seconds per measurement (at least)")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per figure; the best is shown")
    ap.add_argument("--json", default="", help="also write the rows to this JSON file")
    args = ap.parse_args()
    if args.min_time_s <= 0:
        ap.error(f"--min-time-s {args.min_time_s}: must be > 0")
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: must be >= 1")
    rows = run(args.min_time_s, args.repeats)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
