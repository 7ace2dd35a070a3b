"""`sdk.trace_png.write_png` (`nexus trace --png`): a Chrome trace-event JSON drawn as a timeline.

Synthetic spans (two processes, nested and overlapping) through the real `chrome_events`, then
the PNG read back: a valid image of the size the module draws, with bars on it."""

from __future__ import annotations

import json

import pytest

from sdk.trace_png import DPI, WIDTH_IN, _depths, write_png
from sdk.trace_view import Span, chrome_events

T = 1_700_000_000.0


def _span(name, sid, parent, start, end, service, instance="i-1"):
    return Span(name=name, trace_id="ab" * 16, span_id=sid * 16, parent_id=parent * 16 if parent else "",
                start=T + start, end=T + end, kind="INTERNAL", service=service, instance=instance)


SPANS = [
    _span("workflow.rl.update", "1", "", 0.0, 2.0, "nexus-env"),
    _span("workflow.episode", "2", "1", 0.1, 1.0, "nexus-env"),
    _span("workflow.episode", "3", "1", 0.2, 1.2, "nexus-env"),  # overlaps: a second lane
    _span("inferencer.predict", "4", "2", 0.3, 0.5, "nexus-inferencer"),
    _span("predict.forward", "5", "4", 0.35, 0.45, "nexus-inferencer"),
]


def test_png_is_a_valid_image_of_the_expected_size(tmp_path):
    import matplotlib.image

    chrome = chrome_events(SPANS)
    (tmp_path / "t.json").write_text(json.dumps(chrome))
    path = write_png(json.loads((tmp_path / "t.json").read_text()), tmp_path / "t.png", title="synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(path)
    assert img.shape[1] == int(WIDTH_IN * DPI) and 100 < img.shape[0] < 9 * DPI + 1, img.shape
    # Bars were drawn: some pixels are neither white nor black nor grey (the span colours).
    rgb = img[..., :3]
    coloured = (rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.2
    assert coloured.sum() > 500


def test_rows_follow_processes_lanes_and_nesting():
    bars = [e for e in chrome_events(SPANS)["traceEvents"] if e["ph"] == "X"]
    depth = _depths(bars)
    rows = {(e["pid"], e["tid"], depth[id(e)]) for e in bars}
    # env: lane 0 holds the update and its first episode one level down, lane 1 the overlapping
    # episode; inferencer: one lane, the forward one level under its predict.
    assert len({r[0] for r in rows}) == 2 and len(rows) == 5, rows
    assert {e["name"]: depth[id(e)] for e in bars if e["name"] != "workflow.episode"} == {
        "workflow.rl.update": 0, "inferencer.predict": 0, "predict.forward": 1}


def test_no_spans_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no complete"):
        write_png({"traceEvents": []}, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
