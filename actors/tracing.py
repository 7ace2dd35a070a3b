"""One OpenTelemetry tracer per process, and W3C trace context in NATS headers.

`setup_tracing` exports spans over OTLP/HTTP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set;
otherwise to ``<data_dir>/traces/<service>-<instance>.jsonl`` (one span per line, the OTLP
JSON shape of `ReadableSpan.to_json`), so traces exist without a collector.

`inject` puts ``traceparent`` / ``tracestate`` into a headers dict on every publish and
request; `extract` rebuilds the remote context on receive, so one trace spans processes.

Bounded (docs/observability.md): traces are sampled parent-based, a root span by its trace id
(``NEXUS_TRACE_SAMPLE_RATIO``), a child as its parent was, so every process keeps or skips the
same traces; a span of an unsampled trace is still recorded and kept when it ends in an error,
lasts ``NEXUS_TRACE_SLOW_MS`` or more, or is a timeline span (`KEEP_SPAN_NAMES`). Span files
rotate past ``NEXUS_TRACE_FILE_MAX_MB`` (``x.1.jsonl`` ... ``x.N.jsonl``, ``NEXUS_TRACE_FILE_BACKUPS``).
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
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import StatusCode

from protocol.settings import TelemetrySettings

TRACER_NAME = "vla-nexus"
# The busy timelines sdk/report.py draws (its TIMELINE_SPANS; a test checks they agree): one
# span per trainer round / inferencer forward, a few a second, kept in every trace so the
# utilisation it reports never depends on the sampling ratio.
KEEP_SPAN_NAMES = frozenset({"trainer.round", "inferencer.forward"})


class _RecordOnly(Sampler):
    """Record but do not sample: the span exists (so an error or a slow end can still keep it)
    and its context says "not sampled" to every child, local or remote."""

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None) -> SamplingResult:
        return SamplingResult(Decision.RECORD_ONLY, attributes, None)

    def get_description(self) -> str:
        return "RecordOnly"


class _RatioOrRecord(TraceIdRatioBased):
    """A root span: sampled when its trace id falls under the ratio, else recorded only."""

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None) -> SamplingResult:
        hit = trace_id & self.TRACE_ID_LIMIT < self.bound
        return SamplingResult(Decision.RECORD_AND_SAMPLE if hit else Decision.RECORD_ONLY, attributes, None)


def make_sampler(ratio: float) -> Sampler:
    """Parent-based: a root by its trace id, a child as its parent (remote or local) was."""
    return ParentBased(_RatioOrRecord(ratio), remote_parent_not_sampled=_RecordOnly(),
                       local_parent_not_sampled=_RecordOnly())


def keep_unsampled(span: ReadableSpan, slow_ms: float) -> bool:
    """An unsampled span still worth keeping: an error, a slow one, or a timeline span."""
    if span.status.status_code == StatusCode.ERROR or span.name in KEEP_SPAN_NAMES:
        return True
    if span.start_time is not None and span.end_time is not None:
        return (span.end_time - span.start_time) / 1e6 >= slow_ms
    return False


class KeepingSpanProcessor(BatchSpanProcessor):
    """`BatchSpanProcessor` that also exports the unsampled spans `keep_unsampled` names."""

    def __init__(self, exporter: SpanExporter, slow_ms: float, **kwargs: Any) -> None:
        super().__init__(exporter, **kwargs)
        self.slow_ms = slow_ms

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            super().on_end(span)
        elif keep_unsampled(span, self.slow_ms):
            # The parent class drops unsampled spans before queueing; queue this one directly.
            self._batch_processor.emit(span)


class JsonlSpanExporter(SpanExporter):
    """Append finished spans as JSON lines; safe to read while the process runs.

    Past ``max_bytes`` the file is rotated: ``x.jsonl`` -> ``x.1.jsonl`` -> ... ->
    ``x.<backups>.jsonl`` (the oldest is deleted); with no backups it starts again empty. The
    rotated names still end in ``.jsonl``, so readers of ``traces/*.jsonl`` see them."""

    def __init__(self, path: Path, max_bytes: int = 64 << 20, backups: int = 3) -> None:
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in shutdown
        self.rotations = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(json.loads(s.to_json()), separators=(",", ":")) for s in spans]
        with self._lock:
            if self._fh.closed:
                return SpanExportResult.FAILURE
            self._fh.write("\n".join(lines) + "\n")
            self._fh.flush()
            if self._fh.tell() >= self.max_bytes:
                self._rotate()
        return SpanExportResult.SUCCESS

    def rotated(self, i: int) -> Path:
        return self.path.with_name(f"{self.path.stem}.{i}{self.path.suffix}")

    def _rotate(self) -> None:
        self._fh.close()
        if self.backups > 0:
            for i in range(self.backups - 1, 0, -1):
                if self.rotated(i).exists():
                    self.rotated(i).replace(self.rotated(i + 1))
            self.path.replace(self.rotated(1))
        self._fh = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed in shutdown
        self.rotations += 1

    def shutdown(self) -> None:
        with self._lock:
            self._fh.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


_provider: TracerProvider | None = None


def telemetry_settings() -> TelemetrySettings:
    """The NEXUS_TRACE_* variables `setup_tracing` applies."""
    return TelemetrySettings.from_env()


def setup_tracing(service: str, instance: str, data_dir: Path | None) -> trace.Tracer:
    """Install this process's tracer provider (once) and return a tracer."""
    global _provider
    if _provider is None:
        resource = Resource.create(
            {"service.name": f"nexus-{service}", "service.instance.id": instance}
        )
        cfg = telemetry_settings()
        provider = TracerProvider(resource=resource, sampler=make_sampler(cfg.sample_ratio))
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter: SpanExporter = OTLPSpanExporter()
        else:
            base = Path(data_dir) if data_dir is not None else Path(".nexus")
            exporter = JsonlSpanExporter(base / "traces" / f"{service}-{instance}.jsonl",
                                         max_bytes=int(cfg.file_max_mb * (1 << 20)), backups=cfg.file_backups)
        # Short delay so a trace is on disk within a second of the span ending.
        provider.add_span_processor(KeepingSpanProcessor(exporter, cfg.slow_ms, schedule_delay_millis=500))
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
