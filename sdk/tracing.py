"""Tracing helpers for user-level code (the SDK and workflows/): the OpenTelemetry *API* only,
so a workflow gets spans in the platform's traces without importing a role's module. The
roles' tracer provider, sampling and exporters live in actors/tracing.py, which re-uses these."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

TRACER_NAME = "vla-nexus"


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def current_context() -> Any:
    return otel_context.get_current()


@contextlib.contextmanager
def detached() -> Iterator[None]:
    """Run the block with no current span: its spans start traces of their own (a task that
    asyncio spawned inside a request would otherwise inherit the request's context)."""
    token = otel_context.attach(otel_context.Context())
    try:
        yield
    finally:
        otel_context.detach(token)


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
