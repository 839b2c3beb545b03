"""The tier check of tests/conftest.py: a test with no tier, or two, stops collection; and
the order it hands tests on in: files with a slow test first."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TIERS, slow_files_first, tier_problems

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[2]


class FakeItem:
    def __init__(self, nodeid: str, *marks: str):
        self.nodeid, self.marks = nodeid, set(marks)

    def get_closest_marker(self, name):
        return name if name in self.marks else None


def test_each_test_needs_exactly_one_tier():
    items = [FakeItem("a", "pure"), FakeItem("b", "slow"), FakeItem("c", "torch", "cpu_dist"),
             FakeItem("d", "gpu", "slow")]
    assert tier_problems(items) == ["b: no tier", "c: tiers torch, cpu_dist"]
    assert TIERS == ("pure", "torch", "cpu_dist", "slurm", "ray", "vllm", "gpu")


def test_files_with_a_slow_test_come_first_whole_and_in_order():
    items = [FakeItem("a.py::x", "pure"), FakeItem("b.py::y", "cpu_dist", "slow"),
             FakeItem("b.py::y2", "pure"), FakeItem("a.py::z", "pure"),
             FakeItem("c.py::w", "cpu_dist"), FakeItem("d.py::v[1]", "pure"),
             FakeItem("d.py::v[2]", "cpu_dist", "slow")]
    assert [i.nodeid for i in slow_files_first(items)] == [
        "b.py::y", "b.py::y2", "d.py::v[1]", "d.py::v[2]", "a.py::x", "a.py::z", "c.py::w"]


def test_make_test_hands_files_out_in_the_hooks_order():
    """The multi-process tiers go to their workers file by file in the collection's order
    (the slow files first), not reordered by xdist by their number of tests."""
    text = (REPO / "Makefile").read_text()
    line = next(ln for ln in text.splitlines() if '-m "cpu_dist or ray"' in ln)
    assert "--dist loadfile" in line and "--no-loadscope-reorder" in line


def test_an_unmarked_test_file_stops_collection(tmp_path):
    """The real hook, on a throwaway test folder that uses this conftest."""
    folder = REPO / "tests" / f"_tmp_unmarked_{tmp_path.name}"
    folder.mkdir()
    try:
        (folder / "test_x.py").write_text("def test_nothing_marked():\n    assert 1 + 1 == 2\n")
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                            "-p", "no:cacheprovider", str(folder)],
                           capture_output=True, text=True, cwd=REPO, timeout=120)
    finally:
        shutil.rmtree(folder)
    assert r.returncode != 0
    assert "test_nothing_marked: no tier" in r.stdout + r.stderr


def test_make_test_runs_every_tier_but_gpu_once():
    """`make test` splits the suite into several pytest runs (Makefile): together they
    select each tier but gpu, and no tier twice."""
    import re

    text = (REPO / "Makefile").read_text()
    recipe = lambda target: re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, re.M).group(1)  # noqa: E731
    exprs = re.findall(r'-m "?([a-z_ ]+?)"? (?:-n|\$|\|)', recipe("test") + recipe("test-vllm"))
    tiers = [word for e in exprs for word in e.split() if word != "or"]
    assert sorted(tiers) == sorted(t for t in TIERS if t != "gpu")
