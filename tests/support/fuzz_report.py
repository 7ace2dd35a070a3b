"""The fuzzing harness's report (tests/support/fuzzing.py): outcomes counted per target, the
table the test and the benchmark print, the problems and how one is shown for a repro."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tests.support.fuzz_types import Outcome


@dataclass
class TargetStats:
    label: str
    cases: int = 0
    answers: Counter = field(default_factory=Counter)
    internal: int = 0
    no_reply: int = 0
    bad_reply: int = 0
    max_latency_s: float = 0.0


def summarize(outcomes: list[Outcome]) -> dict[str, TargetStats]:
    stats: dict[str, TargetStats] = {}
    for o in outcomes:
        s = stats.setdefault(o.case.target.label, TargetStats(o.case.target.label))
        s.cases += 1
        s.answers[o.answer] += 1
        if o.problem:
            setattr(s, o.problem, getattr(s, o.problem) + 1)
        s.max_latency_s = max(s.max_latency_s, o.latency_s)
    return dict(sorted(stats.items()))


def table(stats: dict[str, TargetStats]) -> str:
    rows = [f"{'TARGET':32} {'CASES':>6} {'INTERNAL':>8} {'NO REPLY':>8} {'MAX LAT s':>9}  ANSWERS"]
    for s in stats.values():
        answers = ", ".join(f"{k}:{v}" for k, v in s.answers.most_common())
        rows.append(f"{s.label:32} {s.cases:6d} {s.internal:8d} {s.no_reply + s.bad_reply:8d} "
                    f"{s.max_latency_s:9.3f}  {answers}")
    return "\n".join(rows)


def problems(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.problem]


def describe(o: Outcome) -> str:
    return (f"{o.case.target.label} [{o.problem}] mode={o.case.mode}: {o.message[:300]}\n"
            f"    input: {o.case.shown}\n    bytes: {o.case.payload[:120]!r}")
