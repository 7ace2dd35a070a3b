"""`busy` / quota / draining answers are back-pressure, not errors (issue 26): a role's span for
one has no ERROR status, and `nexus trace` counts them apart from error spans, including spans
written before this change (ERROR status with a back-pressure code)."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from sdk.trace_view import parse_span, summary


def _spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("master.reserve") as s:  # today's shape of a busy answer
        s.set_attribute("nexus.error_code", "busy")
        s.set_attribute("nexus.back_pressure", True)
    with tracer.start_as_current_span("master.reserve") as s:  # an older span: ERROR + busy
        s.set_status(Status(StatusCode.ERROR, "2 rl jobs in flight"))
        s.set_attribute("nexus.error_code", "quota_exceeded")
    with tracer.start_as_current_span("master.lease") as s:  # a real failure
        s.set_status(Status(StatusCode.ERROR, "boom"))
        s.set_attribute("nexus.error_code", "internal")
    with tracer.start_as_current_span("master.job"):
        pass
    return [parse_span(sp.to_json(indent=None)) for sp in exporter.get_finished_spans()]


def test_back_pressure_is_counted_apart_from_errors():
    spans = _spans()
    info = summary(spans)
    assert (info["errors"], info["back_pressure"], info["spans"]) == (1, 2, 4)
    assert [s.back_pressure for s in spans] == [True, True, False, False]
