"""The tracing pieces on the OpenTelemetry *API* alone that the roles and the SDK share: the
tracer's name, links, and spans that start a new trace.

Here, below the SDK, so actors/tracing.py (the roles' provider, sampling, exporters) uses them
without importing the SDK, and sdk/tracing.py (what workflows/ import) re-exports them without
pulling in a role's module or the OpenTelemetry SDK."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

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
