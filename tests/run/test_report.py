"""The run report: a self-contained page from a short run (a reallocating plan with an
evaluation), its pictures rendered by a real headless Chromium (each screenshot shows
a picture, not a blank), and its charts' numbers."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run.conftest import experiment

REPO = Path(__file__).resolve().parents[2]
REALIGN = [sys.executable, "-m", "realign.cli.main"]

MANUAL_REALLOC = {
    "actor.generate": {"mesh": {"first_gpu": 0, "n_gpus": 2}, "layout": {"tp": 1, "dp": 2}},
    "actor.train": {"mesh": {"first_gpu": 0, "n_gpus": 2}, "layout": {"tp": 2}},
    "actor.eval_greedy": {"mesh": {"first_gpu": 0, "n_gpus": 2}, "layout": {"tp": 1, "dp": 2}},
    "actor.eval_sample": {"mesh": {"first_gpu": 0, "n_gpus": 2}, "layout": {"tp": 1, "dp": 2}},
}
EVAL = {"data": {"path": "tiny/math_eval.jsonl", "kind": "prompts", "max_prompt_len": 8},
        "interval": 2, "samples": 2}
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]


@pytest.fixture(scope="module")
def chromium() -> str:
    script = REPO / "tests" / "browser" / "install_chromium.sh"
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    path = shutil.which("chromium")
    if r.returncode != 0 or path is None:
        pytest.skip(f"no Chromium for the browser test: {r.stderr.strip()[-300:]}")
    return path


@pytest.fixture(scope="module")
def report(tiny_assets, tmp_path_factory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("report")
    exp = experiment(tiny_assets, "tiny-grpo-cpu", tmp, run__steps=5, eval=EVAL,
                     plan__manual=MANUAL_REALLOC)
    rd = tmp / "run"
    r = subprocess.run([*REALIGN, "run", str(exp), "--run-dir", str(rd)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([*REALIGN, "report", str(rd)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return rd, (rd / "report.html").read_text()


def figures(page: str) -> dict[str, str]:
    return dict(re.findall(r'<figure id="([^"]+)">(<svg.*?</svg>)', page, flags=re.S))


@pytest.mark.cpu_dist
def test_the_page_holds_every_picture_and_fetches_nothing(report):
    _rd, page = report
    assert set(figures(page)) == {"curve-reward", "curve-eval", "curve-loss", "mfc-times",
                                  "timeline-measured", "timeline-planned", "realloc"}
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", page)
    assert "<script" not in page
    # the numbers behind the pictures: every MFC measured, the reallocation moved bytes
    assert "actor.eval_sample" in page and "actor -&gt; actor.generate" in page
    # the first estimate a user sees says what priced it (no profile here: the preset)
    assert "Estimates priced with the cpu device preset, not a measurement" in page


@pytest.mark.cpu_dist
def test_every_picture_renders_in_a_real_browser(report, chromium, tmp_path):
    from PIL import Image

    _rd, page = report
    for fid, svg in figures(page).items():
        w, h = (int(v) for v in re.search(r'width="(\d+)" height="(\d+)"', svg).groups())
        html = tmp_path / f"{fid}.html"
        html.write_text(f"<!DOCTYPE html><html><body style='margin:0'>{svg}</body></html>")
        shot = tmp_path / f"{fid}.png"
        r = subprocess.run([chromium, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                            f"--screenshot={shot}", f"--window-size={w},{h}", html.as_uri()],
                           capture_output=True, text=True, timeout=120)
        assert shot.is_file(), r.stderr[-2000:]
        img = Image.open(shot).convert("RGB")
        colors = img.getcolors(maxcolors=1 << 20)
        inked = sum(n for n, c in colors if c != (255, 255, 255))
        assert inked > 0.01 * img.width * img.height, (fid, inked)   # not a blank page
        assert len(colors) > 8, (fid, len(colors))                    # lines, bars, text


@pytest.mark.pure
def test_charts_draw_their_numbers():
    from realign.report.charts import bar_chart, line_chart

    svg = line_chart("r", {"a": [(0, 1.0), (1, 2.0), (2, float("nan")), (3, 4.0)],
                           "b": [(0, 0.5)]})
    points = re.search(r'<polyline points="([^"]+)"', svg).group(1).split()
    assert len(points) == 3                        # the NaN is left out
    ys = [float(p.split(",")[1]) for p in points]
    assert ys[0] > ys[1] > ys[2]                   # higher values are drawn higher
    assert "no values recorded" in line_chart("empty", {"a": []})
    bars = bar_chart("t", ["x", "y"], {"est": [1.0, 2.0], "got": [2.0, 4.0]}, "s")
    widths = [float(w) for w in re.findall(r'width="([\d.]+)" height="10" fill="#\w+"><title>',
                                           bars)]
    assert widths == sorted(widths) and widths[-1] == pytest.approx(2 * widths[1])
