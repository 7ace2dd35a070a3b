"""One OpenTelemetry tracer per process: provider, sampling, exporters, and the roles' spans.

`setup_tracing` exports spans over OTLP/HTTP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set;
otherwise to ``<data_dir>/traces/<service>-<instance>.jsonl`` (one span per line, the OTLP
JSON shape of `ReadableSpan.to_json`), so traces exist without a collector.

`inject` puts ``traceparent`` / ``tracestate`` into a headers dict on every publish and
request; `extract` rebuilds the remote context on receive, so one trace spans processes (both
in transport/trace_api.py, re-exported here).

Bounded (docs/observability.md): traces are sampled parent-based, a root span by its trace id
(``NEXUS_TRACE_SAMPLE_RATIO``), a child as its parent was, so every process keeps or skips the
same traces; a span of an unsampled trace is still recorded and kept when it ends in an error,
lasts ``NEXUS_TRACE_SLOW_MS`` or more, or is a timeline span (`KEEP_SPAN_NAMES`). Span files
rotate past ``NEXUS_TRACE_FILE_MAX_MB`` (``x.1.jsonl`` ... ``x.N.jsonl``, ``NEXUS_TRACE_FILE_BACKUPS``).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
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
from opentelemetry.trace import SpanKind, Status, StatusCode

from protocol.settings import TelemetrySettings
# The API-only pieces (context in headers, hop attributes) live on the transport floor, where
# the bus uses them; the roles' modules keep importing them from here.
from transport.trace_api import (  # noqa: F401  (the roles' names for them)
    CONTEXT_PROBLEMS,
    TRACER_NAME,
    carrier,
    carrier_of,
    extract,
    hop_name,
    inject,
    link_to,
    messaging,
    new_root,
    nexus_attrs,
    reply_link,
    trace_id_hex,
)

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


# -- hop and stage spans (docs/observability.md lists every name) -----------------------------

# The stages of one predict, children of its `inferencer.predict` span, in order.
PREDICT_STAGES = ("predict.queue_wait", "predict.batch_wait", "predict.canonicalise", "predict.forward",
                  "predict.head", "predict.reply")
# The stages of one training job, children of its `trainer.job` span, in order.
JOB_STAGES = ("job.queue_wait", "job.lease", "job.canonicalise", "job.step", "job.commit", "job.export",
              "job.announce", "job.sync")


def now_ns() -> int:
    return time.time_ns()


def record_span(tracer: trace.Tracer, name: str, parent: Any, start_ns: int, end_ns: int,
                attributes: dict[str, Any] | None = None, kind: SpanKind = SpanKind.INTERNAL,
                links: Sequence[trace.Link] = ()) -> None:
    """A finished span over ``[start_ns, end_ns]`` (stamped earlier, made now: off the hot
    path). ``parent``: a span or a context."""
    ctx = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
    span = tracer.start_span(name, context=ctx, kind=kind, attributes=attributes, links=links,
                             start_time=start_ns)
    span.end(end_time=max(end_ns, start_ns))


def is_sampled(span: trace.Span) -> bool:
    return span.get_span_context().trace_flags.sampled


def consumer_span(tracer: trace.Tracer, name: str, subject: str, headers: dict[str, Any] | None,
                  attributes: dict[str, Any] | None = None) -> Any:
    """A CONSUMER span for a message received on ``subject``, child of the context in its
    headers (a new root when that is missing or malformed); use as a context manager."""
    from protocol.subjects import subject_template

    return tracer.start_as_current_span(
        name, context=extract(headers, where=f"{name} {subject_template(subject)}"), kind=SpanKind.CONSUMER,
        attributes={**messaging(subject, "process"), **(attributes or {})})


class JobSpans:
    """A trainer's spans of its leased jobs: one `trainer.job` (CONSUMER) per job, child of
    the context the master stored with the job's first micro-batch (`JobRecord.trace`), with
    the `JOB_STAGES` as children. `open` at the lease point (it records queue wait and lease
    from the record), `stage` / `steps` around the work, `close` when the round ends."""

    def __init__(self, tracer: trace.Tracer, names: Any) -> None:
        self.tracer, self.names = tracer, names
        self.spans: dict[str, trace.Span] = {}

    def open(self, jobs: Sequence[Any], lease_s: float) -> list[trace.Link]:
        """Job spans for a round's jobs; returns links to them (for the round's span)."""
        now = now_ns()
        links = []
        for job in jobs:
            parent = extract(getattr(job, "trace", None) or {}, where="trainer.job")
            span = self.tracer.start_span("trainer.job", context=parent, kind=SpanKind.CONSUMER, attributes={
                **messaging(self.names.tq_job(job.tenant, job.job), "process"), **nexus_attrs(job),
                "nexus.task": job.task, "nexus.items": job.items, "nexus.lease_epoch": job.lease_epoch})
            self.spans[job.job] = span
            # The master's clock: ready, and leased (its expiry minus the lease asked for).
            leased = int((job.lease_expires_at - lease_s) * 1e9) if job.lease_expires_at else now
            leased = min(leased, now)
            if job.ready_at:
                record_span(self.tracer, "job.queue_wait", span, min(int(job.ready_at * 1e9), leased), leased)
            record_span(self.tracer, "job.lease", span, leased, now)
            links.append(trace.Link(span.get_span_context()))
        return links

    @contextlib.contextmanager
    def stage(self, job: Any, name: str) -> Iterator[None]:
        """A stage span of ``job`` made current: hops inside it (job updates, the announcement)
        are its children, so the weight load on an inferencer joins the job's trace."""
        span = self.spans.get(job.job)
        if span is None:
            yield
            return
        with self.tracer.start_as_current_span(name, context=trace.set_span_in_context(span),
                                               attributes=nexus_attrs(job)):
            yield

    @contextlib.contextmanager
    def steps(self, jobs: Sequence[Any], step: int) -> Iterator[None]:
        """One grouped train step over ``jobs``: a `job.step` span in each job's trace."""
        start = now_ns()
        try:
            yield
        finally:
            end = now_ns()
            for job in jobs:
                span = self.spans.get(job.job)
                if span is not None:
                    record_span(self.tracer, "job.step", span, start, end,
                                {"nexus.step": step, "nexus.group_jobs": len(jobs), **nexus_attrs(job)})

    def close(self, jobs: Sequence[Any]) -> None:
        for job in jobs:
            span = self.spans.pop(job.job, None)
            if span is None:
                continue
            span.set_attribute("nexus.job_state", str(job.state))
            if job.state == "failed":
                span.set_status(Status(StatusCode.ERROR, str(getattr(job, "reason", "") or "failed")))
            span.end()
