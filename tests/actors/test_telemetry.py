"""Bounded telemetry (actors/tracing.py): parent-based ratio sampling, errors / slow spans /
timeline spans always kept, span files rotated by size. In-process: spans and files only."""

from __future__ import annotations

import json
import time

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Status, StatusCode

from actors.tracing import JsonlSpanExporter, KeepingSpanProcessor, extract, make_sampler


def _setup(tmp_path, ratio, slow_ms=50.0, max_bytes=1 << 30, backups=3):
    exporter = JsonlSpanExporter(tmp_path / "t.jsonl", max_bytes=max_bytes, backups=backups)
    provider = TracerProvider(resource=Resource.create({"service.name": "t"}), sampler=make_sampler(ratio))
    provider.add_span_processor(KeepingSpanProcessor(exporter, slow_ms, schedule_delay_millis=50))
    return provider, provider.get_tracer("t"), exporter


def _names(provider, exporter):
    provider.force_flush()
    return [json.loads(line)["name"] for line in exporter.path.read_text().splitlines() if line]


def test_ratio_zero_keeps_only_errors_slow_and_timeline_spans(tmp_path):
    provider, tracer, exporter = _setup(tmp_path, ratio=0.0)
    for _ in range(50):
        with tracer.start_as_current_span("client.predict"):
            with tracer.start_as_current_span("child.fast"):
                pass
    with tracer.start_as_current_span("fails") as span:
        span.set_status(Status(StatusCode.ERROR, "boom"))
    with tracer.start_as_current_span("slow"):
        time.sleep(0.08)
    with tracer.start_as_current_span("trainer.round"):
        pass
    names = _names(provider, exporter)
    provider.shutdown()
    assert sorted(names) == ["fails", "slow", "trainer.round"]


def test_ratio_keeps_that_share_of_whole_traces(tmp_path):
    provider, tracer, exporter = _setup(tmp_path, ratio=0.25, slow_ms=1e9)  # no slow keeps here
    for _ in range(800):
        with tracer.start_as_current_span("root"):
            with tracer.start_as_current_span("child"):
                pass
    names = _names(provider, exporter)
    provider.shutdown()
    roots, children = names.count("root"), names.count("child")
    assert 120 < roots < 280, roots  # 200 expected; binomial sd ~12
    assert roots == children  # a child follows its parent's decision: whole traces, never halves


def test_remote_parent_decision_is_followed(tmp_path):
    provider, tracer, exporter = _setup(tmp_path, ratio=0.0)
    tid = "4bf92f3577b34da6a3ce929d0e0e4736"
    sampled = extract({"traceparent": f"00-{tid}-00f067aa0ba902b7-01"})
    unsampled = extract({"traceparent": f"00-{tid}-00f067aa0ba902b8-00"})
    with tracer.start_as_current_span("server.sampled", context=sampled):
        pass
    with tracer.start_as_current_span("server.unsampled", context=unsampled):
        pass
    # A malformed context is a new root (here unsampled at ratio 0), never an error.
    with tracer.start_as_current_span("server.bad", context=extract({"traceparent": "garbage"})):
        pass
    names = _names(provider, exporter)
    provider.shutdown()
    assert names == ["server.sampled"]


def test_span_files_rotate_by_size(tmp_path):
    provider, tracer, exporter = _setup(tmp_path, ratio=1.0, max_bytes=4096, backups=2)
    for burst in range(20):  # one export per burst: each may rotate
        for i in range(10):
            with tracer.start_as_current_span(f"s{burst}-{i}"):
                pass
        provider.force_flush()
    provider.shutdown()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["t.1.jsonl", "t.2.jsonl", "t.jsonl"], files  # all still *.jsonl for readers
    assert exporter.rotations >= 3  # more rotations than backups: the oldest were deleted
    for name in files:
        size = (tmp_path / name).stat().st_size
        assert size < 4096 + 16 * 1024, (name, size)  # one export batch past the bound at most
        for line in (tmp_path / name).read_text().splitlines():
            json.loads(line)  # every kept line whole


def test_timeline_spans_are_the_reports():
    from actors.tracing import KEEP_SPAN_NAMES
    from sdk.report import TIMELINE_SPANS

    assert KEEP_SPAN_NAMES == set(TIMELINE_SPANS)
