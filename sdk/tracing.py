"""Tracing helpers for user-level code (the SDK and workflows/): the OpenTelemetry *API* only,
so a workflow gets spans in the platform's traces without importing a role's module. The
pieces the roles share (`TRACER_NAME`, `link_to`, `new_root`) live one floor down in
transport/trace_api.py and are re-exported here; the roles' tracer provider, sampling and
exporters live in actors/tracing.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from transport.trace_api import TRACER_NAME, link_to, new_root

__all__ = ["TRACER_NAME", "current_context", "detached", "link_to", "new_root", "tracer"]


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

