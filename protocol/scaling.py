"""How many instances of each role a deployment runs, and the bounds an operator sets on it.

    parse_counts("env=4,inferencer=2,trainer=1", "--roles")   # {"env": 4, ...}
    parse_bounds("env=1:8,trainer=0:4")                        # NEXUS_SCALE_BOUNDS, defaults merged
    check_count("trainer", 9, bounds, "count")                 # InvalidField naming the bound

Only the workers scale (`SCALABLE`): they join and leave elastically (an inferencer syncs its
weights before it registers ready and drains on leave; a trainer trains or hands back its
leases on drain; an env worker hands its workflows' workloads back). The master, health
manager and monitor run once: a second master needs leader election (planned).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import InvalidField
from protocol.subjects import ROLES

SCALABLE: tuple[str, ...] = ("env", "inferencer", "trainer")
# Each instance is an OS process on the supervisor's host: a typo like trainer=300 must not
# fork 300 processes. Past this a deployment spreads over hosts (compose, Kubernetes).
MAX_INSTANCES = 32
BOUNDS_SETTING = "NEXUS_SCALE_BOUNDS"


@dataclass(frozen=True)
class Bounds:
    min: int
    max: int

    def text(self) -> str:
        return f"{self.min}:{self.max}"


# One of each worker is what `nexus up` always started; an operator lowers a min to 0 to run
# without (an SFT-only deployment needs no env worker or inferencer).
DEFAULT_BOUNDS: dict[str, Bounds] = {"env": Bounds(1, 16), "inferencer": Bounds(1, 8), "trainer": Bounds(1, 8)}


def _pairs(text: str, setting: str, what: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        role, eq, value = part.partition("=")
        role = role.strip()
        if not eq or not value.strip():
            raise InvalidField(setting, f"{part!r} is not ROLE={what}; e.g. env=4,trainer=1")
        if role not in ROLES:
            raise InvalidField(setting, f"unknown role {role!r}; roles: {', '.join(ROLES)}")
        if role in seen:
            raise InvalidField(setting, f"role {role!r} named twice")
        seen.add(role)
        out.append((role, value.strip()))
    return out


def _int(value: str, setting: str, role: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise InvalidField(setting, f"{role}={value!r}: not a whole number") from None
    if not 0 <= n <= MAX_INSTANCES:
        raise InvalidField(setting, f"{role}={n}: allowed 0..{MAX_INSTANCES} instances (MAX_INSTANCES)")
    return n


def parse_counts(text: str, setting: str = "--roles") -> dict[str, int]:
    """``ROLE=N,...`` -> {role: N}. A role that runs once (master, health, monitor) may be named
    only with 1; the others get their bounds checked by `check_count`."""
    counts: dict[str, int] = {}
    for role, value in _pairs(text, setting, "N"):
        n = _int(value, setting, role)
        if role not in SCALABLE and n != 1:
            raise InvalidField(setting, f"{role}={n}: {role} runs exactly once; roles that scale: {', '.join(SCALABLE)}")
        counts[role] = n
    return counts


def parse_bounds(text: str, setting: str = BOUNDS_SETTING) -> dict[str, Bounds]:
    """``ROLE=MIN:MAX,...`` over `DEFAULT_BOUNDS` (a role not named keeps its default)."""
    bounds = dict(DEFAULT_BOUNDS)
    for role, value in _pairs(text, setting, "MIN:MAX"):
        if role not in SCALABLE:
            raise InvalidField(setting, f"{role}: runs exactly once, it has no bounds; roles that scale: {', '.join(SCALABLE)}")
        lo, colon, hi = value.partition(":")
        if not colon:
            raise InvalidField(setting, f"{role}={value!r} is not MIN:MAX; e.g. {role}=1:4")
        b = Bounds(_int(lo.strip(), setting, role), _int(hi.strip(), setting, role))
        if b.min > b.max:
            raise InvalidField(setting, f"{role}={b.text()}: min {b.min} is above max {b.max}")
        bounds[role] = b
    return bounds


def check_count(role: str, n: int, bounds: dict[str, Bounds], field: str = "count") -> None:
    """Refuse ``n`` instances of ``role`` past its bounds, naming the bound and its setting."""
    if role not in SCALABLE:
        raise InvalidField("role", f"{role!r} does not scale (runs exactly once or is unknown); roles that scale: "
                                   f"{', '.join(SCALABLE)}", details={"role": role})
    b = bounds.get(role, DEFAULT_BOUNDS[role])
    if n < b.min or n > b.max:
        side, limit = ("min", b.min) if n < b.min else ("max", b.max)
        raise InvalidField(field, f"{role}={n} is past its {side} bound {limit} ({BOUNDS_SETTING} {role}={b.text()}); "
                                  f"allowed {b.min}..{b.max}",
                           details={"role": role, "bound": side, "limit": limit, "setting": BOUNDS_SETTING})


def bounds_text(bounds: dict[str, Bounds]) -> str:
    return ",".join(f"{r}={bounds[r].text()}" for r in SCALABLE if r in bounds)
