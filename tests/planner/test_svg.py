"""The SVG helpers every drawing shares: time labels at a span's scale or their own,
a record's numbers read as finite floats, a legend that wraps where its row count says,
and a head that makes a well-formed picture."""
from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest

from planner.svg import PALETTE, finite, head, legend, legend_rows, seconds

pytestmark = pytest.mark.pure


def test_seconds_at_a_span_scale_read_alike_along_an_axis():
    assert [seconds(t, 1.5) for t in (0.0, 0.75, 1.5)] == ["0ms", "750ms", "1500ms"]
    assert [seconds(t, 12.0) for t in (0.0, 0.75, 12.0)] == ["0.0s", "0.8s", "12.0s"]


def test_seconds_on_their_own_scale_keep_three_digits():
    assert [seconds(t) for t in (None, 0, 3.5e-4, 0.0125, 1.5, 1234.4)] == \
        ["n/a", "0", "350us", "12.5ms", "1.5s", "1234s"]
    assert seconds(None, 2.0) == "n/a"


def test_finite_reads_numbers_and_refuses_the_rest():
    assert finite(3) == 3.0 and isinstance(finite(3), float) and finite(-0.5) == -0.5
    for v in (None, True, "1", float("nan"), math.inf, [1.0]):
        assert finite(v) is None


def test_legend_wraps_at_the_right_edge_as_its_row_count_says():
    texts = ["a" * 10, "b" * 10, "c" * 10, "d"]          # 100 px per long key, 37 the short
    out: list[str] = []
    below = legend(out, [(t, PALETTE[k]) for k, t in enumerate(texts)], 10, 50, 230)
    rects = [ET.fromstring(s) for s in out if s.startswith("<rect")]
    places = [(float(r.get("x")), float(r.get("y")) + 9) for r in rects]
    assert places == [(10, 50), (110, 50), (10, 66), (110, 66)]
    assert [r.get("fill") for r in rects] == list(PALETTE[:4])
    assert legend_rows(texts, 10, 230) == 2 and below == 50 + 2 * 16
    assert legend_rows([], 10, 230) == 1                 # an empty legend keeps its row
    assert legend_rows(["x" * 200], 10, 230) == 1       # a key wider than the row stays


def test_head_and_a_legend_make_a_well_formed_picture():
    out = head(300.4, 120, font_size=12)
    legend(out, [("<b>&", "#000")], 5, 20, 300)          # texts are escaped
    root = ET.fromstring("\n".join([*out, "</svg>"]))
    assert root.get("width") == "300" and root.get("height") == "120"
    assert root.get("font-size") == "12"
    assert [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")] == ["<b>&"]
