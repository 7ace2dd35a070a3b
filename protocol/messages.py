"""Every message type on the bus. Each has a kind and a schema version (see `protocol.wire`).

Replies are either the op's result message or an `ErrorReply`; `ok_or_raise` turns the
latter into the matching `NexusError` on the client side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from protocol.errors import NexusError, error_from_code
from protocol.wire import message

RoleState = Literal["starting", "ready", "draining", "stopped"]


# -- generic -------------------------------------------------------------------------
@message("error", 1)
@dataclass
class ErrorReply:
    """The error envelope every role replies with when a request fails."""

    code: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_exception(cls, exc: NexusError) -> ErrorReply:
        return cls(code=exc.code.value, message=exc.message, details=_plain(exc.details))

    def to_exception(self) -> NexusError:
        return error_from_code(self.code, self.message, self.details)


def _plain(details: dict[str, Any]) -> dict[str, Any]:
    # Details must survive msgpack: keep scalars, stringify the rest.
    out: dict[str, Any] = {}
    for k, v in details.items():
        out[str(k)] = v if isinstance(v, str | int | float | bool | type(None)) else str(v)
    return out


def ok_or_raise(reply: Any) -> Any:
    if isinstance(reply, ErrorReply):
        raise reply.to_exception()
    return reply


@message("ok", 1)
@dataclass
class Ok:
    """Reply to a request that has no result beyond success."""

    detail: str = ""


# -- role runtime --------------------------------------------------------------------
@message("info.request", 1)
@dataclass
class InfoRequest:
    pass


@message("role.info", 1)
@dataclass
class RoleInfo:
    role: str
    instance: str
    pid: int
    host: str
    started_at: float  # unix seconds
    state: RoleState
    version: str
    ops: list[str]
    in_flight: int
    extra: dict[str, Any] = field(default_factory=dict)


@message("drain.request", 1)
@dataclass
class DrainRequest:
    """Ask one instance to drain: finish in-flight work, deregister, exit."""

    reason: str = ""


@message("heartbeat", 1)
@dataclass
class Heartbeat:
    role: str
    instance: str
    pid: int
    host: str
    started_at: float
    sent_at: float
    seq: int
    state: RoleState
    in_flight: int
    interval_s: float


@message("service.record", 1)
@dataclass
class ServiceRecord:
    """What a role writes under ``<role>.<instance>`` in the services KV bucket."""

    role: str
    instance: str
    pid: int
    host: str
    started_at: float
    state: RoleState
    version: str
    updated_at: float


# -- health --------------------------------------------------------------------------
@message("health.event", 1)
@dataclass
class HealthEvent:
    """Published by the health manager on ``<prefix>.health.events.<role>.<instance>``."""

    event: Literal["role_down", "role_recovered", "role_stopped"]
    role: str
    instance: str
    pid: int
    host: str
    last_heartbeat_at: float
    detected_at: float
    reason: str


@message("health.report.request", 1)
@dataclass
class HealthReportRequest:
    pass


@message("health.report", 1)
@dataclass
class HealthReport:
    alive: list[str]  # "<role>.<instance>"
    dead: list[str]
    timeout_s: float


# -- monitor -------------------------------------------------------------------------
@message("metric", 1)
@dataclass
class Metric:
    """One sample on ``<prefix>.metrics.<signal>.<scope>``."""

    signal: str
    scope: str
    value: float
    at: float
    labels: dict[str, str] = field(default_factory=dict)


@message("status.request", 1)
@dataclass
class StatusRequest:
    include_dead: bool = True


@dataclass
class RoleStatus:
    role: str
    instance: str
    pid: int
    host: str
    state: Literal["alive", "dead", "stopped"]
    role_state: RoleState
    started_at: float
    uptime_s: float
    last_heartbeat_at: float
    last_heartbeat_age_s: float


@message("cluster.status", 1)
@dataclass
class ClusterStatus:
    roles: list[RoleStatus]
    metrics: dict[str, float]
    generated_at: float


# -- master --------------------------------------------------------------------------
@message("list.request", 1)
@dataclass
class ListRequest:
    pass


@message("list.reply", 1)
@dataclass
class ListReply:
    tenants: list[str]
    workloads: list[str]
