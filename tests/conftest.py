"""Every test carries exactly one tier (pyproject.toml's markers), so that ``-m pure``,
``-m torch``, ``-m cpu_dist``, ... together select the whole suite: collection stops,
naming the tests, when one carries none or several."""
from __future__ import annotations

import pytest

#: the tiers, cheapest first (``slow`` is not a tier: it says how long, not what runs)
TIERS = ("pure", "torch", "cpu_dist", "slurm", "ray", "vllm", "gpu")


def tier_problems(items) -> list[str]:
    """``nodeid: what is wrong`` for each test without exactly one tier marker."""
    out = []
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t) is not None]
        if len(tiers) != 1:
            out.append(f"{item.nodeid}: {'no tier' if not tiers else 'tiers ' + ', '.join(tiers)}")
    return out


def slow_files_first(items) -> list:
    """The tests of files holding a ``slow`` test first, each file's tests together and
    in their order; the rest after, in collection order. ``make test`` hands files to
    its two workers in this order (``--dist loadfile --no-loadscope-reorder``), so a long
    file starts early and no worker waits alone at the end on one.

    Example: a.py::x, b.py::y (slow), a.py::z -> b.py::y, a.py::x, a.py::z."""
    def file_of(item) -> str:
        return item.nodeid.split("::", 1)[0]
    slow = {file_of(i) for i in items if i.get_closest_marker("slow") is not None}
    return sorted(items, key=lambda i: file_of(i) not in slow)


def pytest_collection_modifyitems(config, items):
    bad = tier_problems(items)
    if bad:
        raise pytest.UsageError(
            f"{len(bad)} test(s) need exactly one tier marker of {', '.join(TIERS)} "
            "(pytestmark = pytest.mark.<tier> in the file, or a decorator):\n  "
            + "\n  ".join(bad))
    items[:] = slow_files_first(items)
