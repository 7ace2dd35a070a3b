"""One exception root and the stable error codes carried by every error reply.

An error crosses the wire as an `ErrorReply` message (see `protocol.messages`) holding
``code``, ``message`` and ``details``. Clients turn it back into the matching exception
with `error_from_reply`, so a caller catches the same class in-process and across
processes. Codes are part of the wire contract: add new ones, never rename.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    MALFORMED = "malformed"  # body is not valid msgpack / not an envelope
    UNKNOWN_KIND = "unknown_kind"  # envelope names a message kind we do not know
    UNSUPPORTED_VERSION = "unsupported_version"  # schema version we cannot read
    MISSING_FIELD = "missing_field"
    UNKNOWN_FIELD = "unknown_field"
    INVALID_FIELD = "invalid_field"  # present but wrong type or value
    UNKNOWN_OP = "unknown_op"  # no handler for this subject
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"  # no responder, role draining or dead
    DRAINING = "draining"
    BUSY = "busy"  # back-pressure: a cap is reached; details.retry_after_s says when to retry
    FAILED_PRECONDITION = "failed_precondition"  # valid request, wrong state (job not ready, ...)
    # A tenant's quota is reached (details.quota, details.limit; details.retry_after_s). A
    # kind of busy: a caller that waits out back-pressure waits this out too.
    QUOTA_EXCEEDED = "quota_exceeded"
    # The deployment's capacity is reached (details.limit, details.value, details.setting):
    # not back-pressure to wait out, a refusal until the operator raises the setting.
    CAPACITY_EXCEEDED = "capacity_exceeded"
    INTERNAL = "internal"
    PERMISSION_DENIED = "permission_denied"  # the caller's account may not do this op on this tenant
    UNAUTHENTICATED = "unauthenticated"  # the broker refused the credentials (wrong, revoked, none)


# Back-pressure, not failure: a cap or quota reached, or a role draining. The caller waits and
# retries; traces and logs count these apart from errors (an RL run answers hundreds of `busy`
# reserves by design, and `nexus trace` once reported them as "73 error spans").
BACK_PRESSURE_CODES = frozenset({ErrorCode.BUSY.value, ErrorCode.QUOTA_EXCEEDED.value, ErrorCode.DRAINING.value})


class NexusError(Exception):
    """Root of every error vla-nexus raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = dict(details or {})

    def __str__(self) -> str:
        return f"[{self.code.value}] {self.message}"


class ProtocolError(NexusError, ValueError):
    """The bytes or the envelope could not be decoded."""

    code = ErrorCode.MALFORMED


class UnknownKind(ProtocolError):
    code = ErrorCode.UNKNOWN_KIND


class UnsupportedVersion(ProtocolError):
    code = ErrorCode.UNSUPPORTED_VERSION


class FieldError(ProtocolError):
    """A message field is wrong; ``field`` is its dotted path."""

    code = ErrorCode.INVALID_FIELD

    def __init__(self, field: str, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{field}: {message}", details={"field": field, **(details or {})})
        self.field = field


class MissingField(FieldError):
    code = ErrorCode.MISSING_FIELD


class UnknownField(FieldError):
    code = ErrorCode.UNKNOWN_FIELD


class InvalidField(FieldError):
    code = ErrorCode.INVALID_FIELD


class UnknownOp(NexusError, LookupError):
    code = ErrorCode.UNKNOWN_OP


class NotFound(NexusError, LookupError):
    code = ErrorCode.NOT_FOUND


class Conflict(NexusError):
    code = ErrorCode.CONFLICT


class PayloadTooLarge(NexusError, ValueError):
    code = ErrorCode.PAYLOAD_TOO_LARGE


class RequestTimeout(NexusError, TimeoutError):
    code = ErrorCode.TIMEOUT


class Unavailable(NexusError, ConnectionError):
    code = ErrorCode.UNAVAILABLE


class Draining(Unavailable):
    code = ErrorCode.DRAINING


class Busy(NexusError):
    code = ErrorCode.BUSY


class FailedPrecondition(NexusError):
    code = ErrorCode.FAILED_PRECONDITION


class QuotaExceeded(Busy):
    """A tenant's quota (`protocol.messages.TenantQuotas`) is reached. A subclass of `Busy`:
    every caller that waits out back-pressure (a workflow's reserve, the rollout gate, the
    SDK's predict failover) waits this out the same way instead of failing its workload.

        raise QuotaExceeded.of("max_inflight_jobs", 8, "tenant acme has 8 jobs in flight", 0.5)
    """

    code = ErrorCode.QUOTA_EXCEEDED

    @classmethod
    def of(cls, quota: str, limit: float, message: str, retry_after_s: float,
           **details: object) -> QuotaExceeded:
        return cls(f"quota {quota}={limit:g} exceeded: {message}",
                   details={"quota": quota, "limit": limit, "retry_after_s": retry_after_s, **details})

    @property
    def quota(self) -> str:
        return str(self.details.get("quota", ""))

    @property
    def limit(self) -> float:
        return float(self.details.get("limit", 0))


class CapacityExceeded(NexusError):
    """The deployment holds as much as it is configured to (tenants, active workloads, slot
    memory): a new tenant or workload is refused, nothing admitted before is touched. Not a
    `Busy`: a workflow must not wait it out; the operator raises the named setting.

        raise CapacityExceeded.of("max_tenants", 1000, "NEXUS_MAX_TENANTS", "1000 tenants are registered")
    """

    code = ErrorCode.CAPACITY_EXCEEDED

    @classmethod
    def of(cls, limit: str, value: float, setting: str, message: str, **details: object) -> CapacityExceeded:
        return cls(f"capacity {limit}={value:g} reached: {message}; raise {setting} to admit more",
                   details={"limit": limit, "value": value, "setting": setting, **details})

    @property
    def limit(self) -> str:
        return str(self.details.get("limit", ""))

    @property
    def setting(self) -> str:
        return str(self.details.get("setting", ""))


class InternalError(NexusError, RuntimeError):
    code = ErrorCode.INTERNAL


class PermissionDenied(NexusError, PermissionError):
    """details: ``op``, ``tenant`` (the one touched), ``caller`` (the caller's account)."""

    code = ErrorCode.PERMISSION_DENIED


class Unauthenticated(NexusError, PermissionError):
    code = ErrorCode.UNAUTHENTICATED


_BY_CODE: dict[ErrorCode, type[NexusError]] = {
    ErrorCode.MALFORMED: ProtocolError,
    ErrorCode.UNKNOWN_KIND: UnknownKind,
    ErrorCode.UNSUPPORTED_VERSION: UnsupportedVersion,
    ErrorCode.UNKNOWN_OP: UnknownOp,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.CONFLICT: Conflict,
    ErrorCode.PAYLOAD_TOO_LARGE: PayloadTooLarge,
    ErrorCode.TIMEOUT: RequestTimeout,
    ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.DRAINING: Draining,
    ErrorCode.BUSY: Busy,
    ErrorCode.FAILED_PRECONDITION: FailedPrecondition,
    ErrorCode.QUOTA_EXCEEDED: QuotaExceeded,
    ErrorCode.CAPACITY_EXCEEDED: CapacityExceeded,
    ErrorCode.INTERNAL: InternalError,
    ErrorCode.PERMISSION_DENIED: PermissionDenied,
    ErrorCode.UNAUTHENTICATED: Unauthenticated,
}
_FIELD_CODES: dict[ErrorCode, type[FieldError]] = {
    ErrorCode.MISSING_FIELD: MissingField,
    ErrorCode.UNKNOWN_FIELD: UnknownField,
    ErrorCode.INVALID_FIELD: InvalidField,
}


def error_from_code(code: str, message: str, details: dict[str, Any] | None = None) -> NexusError:
    """Rebuild the exception a remote role raised from its error reply."""
    try:
        ecode = ErrorCode(code)
    except ValueError:
        # A newer server may send codes we do not know yet: keep the text, do not crash.
        err = InternalError(f"{message} (unrecognised error code {code!r})", details=details)
        return err
    if ecode in _FIELD_CODES:
        details = dict(details or {})
        field = str(details.pop("field", "?"))
        prefix = f"{field}: "
        text = message[len(prefix):] if message.startswith(prefix) else message
        return _FIELD_CODES[ecode](field, text, details=details)
    return _BY_CODE[ecode](message, details=details)
