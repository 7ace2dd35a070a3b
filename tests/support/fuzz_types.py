"""What the fuzzing harness (tests/support/fuzzing.py) works with: its policy (timeouts,
concurrency, the ops it never sends), a target (one subject that takes requests), the names of
the live deployment a case may mention, a generated case and its judged outcome."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from protocol.errors import ErrorCode


# -- policy ------------------------------------------------------------------------------
# Generous: an op that touches KV or a simulator answers in milliseconds; a loaded 2-core
# CI box can stretch that by 100x. A reply later than this counts as "no reply".
REPLY_TIMEOUT_S = 20.0
# Requests in flight at once: enough to keep the roles busy, few enough that one slow op
# (the trainer's export under its compute lock) does not push the others past the timeout.
CONCURRENCY = 8
# How long the intake may take to answer all its specs after the last publish.
INTAKE_TIMEOUT_S = 30.0
MAX_RAW_BYTES = 2048

# Ops never sent. Each name says why, so the list stays short and honest.
EXCLUDED_OPS: dict[str, str] = {
    # `drain` on an instance (or its role subject) legitimately stops the role: it finishes
    # in flight work and exits 0. That is its contract, not a crash; fuzzing it would end the run.
    "drain": "stops the role by design",
}

MODES = ("raw", "envelope", "typed")
PROBLEMS = ("internal", "no_reply", "bad_reply")
ERROR_CODES = frozenset(c.value for c in ErrorCode)

INTAKE = "intake"
PREDICT = "predict"


@dataclass(frozen=True)
class Target:
    """One subject that takes requests, with what it accepts and may answer."""

    role: str
    op: str
    subject: str
    request: type | None  # None: the intake takes spec text (YAML / JSON), not an envelope
    replies: tuple[type, ...]
    kind: Literal["op", "instance", "predict", "intake"] = "op"

    @property
    def label(self) -> str:
        return f"{self.role}.{self.op}" + ("@instance" if self.kind == "instance" else "")


@dataclass
class Context:
    """Names that exist in the running deployment, mixed into generated strings."""

    tenant: str  # a live tenant (tiny base, LIBERO-like schema)
    schema: dict[str, Any]
    base: str
    jobs: list[str] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)
    env_ids: list[str] = field(default_factory=lambda: ["builtin/reach-v0"])
    roots: list[str] = field(default_factory=list)  # readable LeRobot datasets
    workloads: list[str] = field(default_factory=list)
    # Never created: ops whose valid request starts real work get this tenant (see typed_bodies).
    ghost_tenant: str = "fz-ghost"


@dataclass
class Case:
    target: Target
    mode: str
    payload: bytes
    shown: str  # the generated object, as Python, for a repro
    index: int = 0  # its place among its target's cases (the first ones are the warm-up)


@dataclass
class Outcome:
    case: Case
    answer: str  # a reply kind, an error code, or a problem name
    latency_s: float
    problem: str = ""  # "", "internal", "no_reply", "bad_reply"
    message: str = ""
