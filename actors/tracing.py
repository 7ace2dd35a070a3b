"""One OpenTelemetry tracer per process, and W3C trace context in NATS headers.

`setup_tracing` exports spans over OTLP/HTTP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set;
otherwise to ``<data_dir>/traces/<service>-<instance>.jsonl`` (one span per line, the OTLP
JSON shape of `ReadableSpan.to_json`), so traces exist without a collector.

`inject` puts ``traceparent`` / ``tracestate`` into a headers dict on every publish and
request; `extract` rebuilds the remote context on receive, so one trace spans processes.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract as _extract
from opentelemetry.propagate import inject as _inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

TRACER_NAME = "vla-nexus"


class JsonlSpanExporter(SpanExporter):
    """Append finished spans as JSON lines; safe to read while the process runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in shutdown

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(json.loads(s.to_json()), separators=(",", ":")) for s in spans]
        with self._lock:
            if self._fh.closed:
                return SpanExportResult.FAILURE
            self._fh.write("\n".join(lines) + "\n")
            self._fh.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._fh.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


_provider: TracerProvider | None = None


def setup_tracing(service: str, instance: str, data_dir: Path | None) -> trace.Tracer:
    """Install this process's tracer provider (once) and return a tracer."""
    global _provider
    if _provider is None:
        resource = Resource.create(
            {"service.name": f"nexus-{service}", "service.instance.id": instance}
        )
        provider = TracerProvider(resource=resource)
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter: SpanExporter = OTLPSpanExporter()
        else:
            base = Path(data_dir) if data_dir is not None else Path(".nexus")
            exporter = JsonlSpanExporter(base / "traces" / f"{service}-{instance}.jsonl")
        # Short delay so a trace is on disk within a second of the span ending.
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        trace.set_tracer_provider(provider)
        _provider = provider
    return trace.get_tracer(TRACER_NAME)


def shutdown_tracing() -> None:
    """Flush and close the exporter; call once at process exit."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Return headers carrying the current span's W3C trace context."""
    headers = dict(headers or {})
    _inject(headers)
    return headers


def extract(headers: dict[str, Any] | None) -> otel_context.Context:
    """Context of the remote parent found in NATS headers (empty context if none)."""
    return _extract(dict(headers or {}))


def trace_id_hex() -> str | None:
    """Trace id of the current span, as 32 hex digits (for logs and replies)."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
