"""structlog JSON logs, one object per line, carrying role, instance and (per request) tenant.

`configure_logging(role, instance)` binds the process-wide fields; request handlers bind
``tenant`` (and the trace id) with `bound_request` so every line they log carries it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import structlog


def configure_logging(role: str, instance: str, level: str = "INFO") -> structlog.BoundLogger:
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level.upper(), logging.INFO),
                        format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(role=role, instance=instance)
    return structlog.get_logger()


@contextmanager
def bound_request(**fields: Any) -> Iterator[None]:
    """Bind per-request fields (tenant, op, trace_id) for the duration of a handler."""
    fields = {k: v for k, v in fields.items() if v is not None}
    tokens = structlog.contextvars.bind_contextvars(**fields)
    try:
        yield
    finally:
        structlog.contextvars.reset_contextvars(**tokens)
