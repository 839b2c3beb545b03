"""The run report's streaming section from a metrics file (no run): the staleness
histogram summed over steps, the run's totals, a chart per group of ``stream.*``
metrics, and no section for a run that did not stream."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from realign.report.page import _jsonl
from realign.report.stream import stream_section, summary

pytestmark = pytest.mark.pure

#: three steps of a streamed run as metrics.jsonl records them (k = 2)
ROWS = [
    {"step": 0, "loss": 0.1, "stream.staleness_hist.0": 4.0, "stream.staleness_mean": 0.0,
     "stream.staleness_max": 0.0, "stream.dropped_stale": 0.0, "stream.buffer_depth": 2.0,
     "stream.generator_idle_iters": 0.0, "stream.trainer_idle_iters": 30.0,
     "stream.generator_copy_iters": 2.0, "stream.generator_wait_s": 0.5,
     "stream.trainer_wait_s": 1.5},
    {"step": 1, "loss": 0.2, "stream.staleness_hist.0": 1.0, "stream.staleness_hist.1": 3.0,
     "stream.staleness_mean": 0.75, "stream.staleness_max": 1.0, "stream.dropped_stale": 1.0,
     "stream.buffer_depth": 4.0, "stream.generator_idle_iters": 5.0,
     "stream.trainer_idle_iters": 0.0, "stream.generator_copy_iters": 2.0,
     "stream.generator_wait_s": 0.25, "stream.trainer_wait_s": 0.0},
    {"step": 2, "loss": 0.3, "stream.staleness_hist.1": 2.0, "stream.staleness_hist.2": 2.0,
     "stream.staleness_mean": 1.5, "stream.staleness_max": 2.0, "stream.dropped_stale": 2.0,
     "stream.buffer_depth": 6.0, "stream.generator_idle_iters": 9.0,
     "stream.trainer_idle_iters": 0.0, "stream.generator_copy_iters": 2.0,
     "stream.generator_wait_s": 0.25, "stream.trainer_wait_s": 0.5},
]


@pytest.fixture
def rows(tmp_path: Path) -> list[dict]:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + '{"step": 3, "lo')
    return _jsonl(path)                  # as the report reads it (a cut last line skipped)


def test_the_summary_counts_every_trained_group_and_every_dropped_one(rows):
    s = summary(rows)
    assert s["groups_trained"] == 12.0
    assert s["staleness_mean"] == pytest.approx((0 * 5 + 1 * 5 + 2 * 2) / 12)
    assert s["staleness_max"] == 2.0 and s["dropped_stale"] == 3.0
    assert s["buffer_depth_mean"] == 4.0
    assert s["generator_wait_s"] == 1.0 and s["trainer_wait_s"] == 2.0


def test_a_streamed_run_gets_a_section_with_its_histogram_and_curves(rows):
    html = "\n".join(stream_section(rows))
    assert "<h2>Streaming</h2>" in html
    for fid in ("stream-hist", "stream-staleness", "stream-buffer", "stream-idle",
                "stream-wait"):
        assert f'id="{fid}"' in html
    hist = html.split('id="stream-hist"')[1].split("</figure>")[0]
    # one bar per staleness, its value the groups summed over the steps
    assert re.findall(r"<title>trained: ([\d.]+) groups</title>", hist) == ["5", "5", "2"]
    table = html.split('id="stream-summary"')[1].split("</table>")[0]
    assert "<td>dropped_stale</td><td>3</td>" in table


def test_a_run_that_did_not_stream_gets_no_section():
    assert stream_section([{k: v for k, v in r.items() if not k.startswith("stream.")}
                           for r in ROWS]) == []
