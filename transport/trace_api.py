"""The tracing pieces on the OpenTelemetry *API* alone that the roles and the SDK share: the
tracer's name, links, spans that start a new trace, and W3C trace context in NATS headers
(`inject` on every publish and request, `extract` on receive, so one trace spans processes).

Here, on the transport floor below both, so transport/bus.py propagates context on every hop,
actors/tracing.py (the roles' provider, sampling, exporters) builds on these, and
sdk/tracing.py (what workflows/ import) re-exports them without pulling in a role's module or
the OpenTelemetry SDK."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract as _extract
from opentelemetry.propagate import inject as _inject

TRACER_NAME = "vla-nexus"


def link_to(span_or_ctx: Any) -> trace.Link | None:
    """A link to a span (or the span of a context), None when it has no valid context."""
    span = span_or_ctx if isinstance(span_or_ctx, trace.Span) else trace.get_current_span(span_or_ctx)
    sc = span.get_span_context()
    return trace.Link(sc) if sc.is_valid else None


def new_root(tracer: trace.Tracer, name: str, attributes: dict[str, Any] | None = None,
             links: Sequence[Any] = ()) -> Any:
    """A span that starts a new trace whatever is current (an RL update, an evaluation
    episode), linked to where it came from; use as a context manager."""
    kept = [lk for lk in (link_to(x) for x in links) if lk is not None]
    return tracer.start_as_current_span(name, context=otel_context.Context(), attributes=attributes, links=kept)


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Return headers carrying the current span's W3C trace context."""
    headers = dict(headers or {})
    _inject(headers)
    return headers


def extract(headers: dict[str, Any] | None, where: str = "") -> otel_context.Context:
    """Context of the remote parent found in NATS headers (empty context if none).

    A malformed or missing context never fails the request: the span made from the empty
    context is a new root. Each kind of problem is logged once per ``where`` (a subject
    template: a bounded set), so a flood of bad headers cannot flood the log."""
    try:
        carrier = {str(k).lower(): str(v) for k, v in dict(headers or {}).items()}
        ctx = _extract(carrier)
    except Exception as exc:  # a carrier that is not a mapping of strings: a new root
        _problem("malformed", where, f"{type(exc).__name__}: {exc}")
        return otel_context.Context()
    if "traceparent" not in carrier:
        _problem("missing", where, "")
    elif not trace.get_current_span(ctx).get_span_context().is_valid:
        _problem("malformed", where, carrier["traceparent"][:80])
    return ctx


# (kind, where) pairs already logged, and how often each was seen (`context_problems`).
CONTEXT_PROBLEMS: dict[tuple[str, str], int] = {}
_PROBLEMS_MAX = 256  # distinct (kind, where) pairs remembered: where is a template, few exist


def _problem(kind: str, where: str, detail: str) -> None:
    key = (kind, where)
    seen = CONTEXT_PROBLEMS.get(key)
    if seen is None:
        if len(CONTEXT_PROBLEMS) >= _PROBLEMS_MAX:
            return
        import structlog

        # Malformed is a sender's bug: a warning. Missing is a plain client's way (no tracer).
        log = structlog.get_logger()
        (log.warning if kind == "malformed" else log.info)(
            f"{kind} trace context; the request starts a new trace (logged once)", where=where, traceparent=detail)
        CONTEXT_PROBLEMS[key] = 1
    else:
        CONTEXT_PROBLEMS[key] = seen + 1


def trace_id_hex() -> str | None:
    """Trace id of the current span, as 32 hex digits (for logs and replies)."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


# -- hop attributes and links (docs/observability.md lists every name) ------------------------

def messaging(subject: str, operation: str) -> dict[str, str]:
    """OTel messaging attributes of a hop on ``subject``, its destination templated
    (`protocol.subjects.subject_template`: no tenant id or job id in it)."""
    from protocol.subjects import subject_template

    return {"messaging.system": "nats", "messaging.destination.name": subject_template(subject),
            "messaging.operation.type": operation}


def hop_name(subject: str, operation: str) -> str:
    """``"<operation> <templated destination>"``: the OTel messaging span name."""
    from protocol.subjects import subject_template

    return f"{operation} {subject_template(subject)}"


def nexus_attrs(obj: Any) -> dict[str, str]:
    """``nexus.tenant`` / ``nexus.workload`` / ``nexus.job`` of a message that has them."""
    out = {}
    for field_name, key in (("tenant", "nexus.tenant"), ("workload", "nexus.workload"), ("job", "nexus.job")):
        value = getattr(obj, field_name, None)
        if isinstance(value, str) and value:
            out[key] = value
    return out


def reply_link(span: trace.Span, headers: dict[str, Any] | None) -> None:
    """Link a CLIENT span to the server span whose context came back in the reply's headers
    (a role's reply carries its server span; an echo of our own context is skipped)."""
    try:
        sc = trace.get_current_span(_extract(dict(headers or {}))).get_span_context()
    except Exception:  # a reply's bad headers never fail the call  # noqa: BLE001
        return
    if sc.is_valid and sc.span_id != span.get_span_context().span_id:
        span.add_link(sc, {"nexus.link": "reply"})


def carrier() -> dict[str, str]:
    """The current span's context as a W3C carrier (``traceparent`` / ``tracestate``)."""
    return inject({})


def carrier_of(span: trace.Span) -> dict[str, str] | None:
    """``span``'s context as a W3C carrier (None when it has no valid context)."""
    headers: dict[str, str] = {}
    _inject(headers, context=trace.set_span_in_context(span))
    return headers or None
