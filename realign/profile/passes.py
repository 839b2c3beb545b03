"""Several passes over the profile's probes, and what they say about the machine (pure).

Why passes: a shared machine's speed changes over seconds to minutes, and a probe timed
in one go lands in one phase (on a 2-vCPU virtual machine a fixed workload alternated
between two speeds about 1.8x apart every 10-30 s, and two one-pass profiles taken
minutes apart priced the same plan 27 % apart: benchmarks/profile/README.md). Fitted
to probes that each caught one phase, the engine fit explains one probe by a fast machine and the next by a
slow one, and trades its fixed costs against each other. Timed in several passes spread
over the profile, every probe samples the same mix of phases, and each probe's pooled
median is the machine's typical speed: what a benchmark's median over many steps
measures. The passes also show how much the machine's speed moved while it was measured
(:func:`pass_time_ratios`), which the table records and ``realign profile`` prints.
"""
from __future__ import annotations

import statistics

#: passes over the GEMM grid and the engine probes (``realign profile --passes``)
DEFAULT_PASSES = 3
#: ``realign profile`` warns when its slowest pass took this much longer than its
#: fastest (relative; the median over every engine probe)
SPEED_WARN = 0.15


def pooled_median(passes: list[list[float]]) -> float:
    """Median of one probe's samples over all its passes.

    Example: [[1.0, 1.1, 1.0], [2.0, 2.1, 2.0], [1.0, 0.9, 1.0]] -> 1.0 (a slow second pass
    moves it no more than one slow sample would)."""
    return statistics.median(x for p in passes for x in p)


def pass_time_ratios(probes: list[list[list[float]]]) -> list[float]:
    """Per pass, how long it took relative to the whole profile: the median over the
    probes of the pass's median over the probe's pooled median (1.0: typical; 1.5: the
    machine ran that pass 1.5x slower). ``probes[i][p]``: probe i's samples in pass p.

    Example: [[[1, 1], [2, 2], [1, 1]], [[3, 3], [6, 6], [3, 3]]] -> [1.0, 2.0, 1.0]."""
    if not probes:
        return []
    n = len(probes[0])
    return [statistics.median(statistics.median(pr[p]) / pooled_median(pr) for pr in probes)
            for p in range(n)]


def speed_moved(ratios: list[float]) -> float:
    """How much the slowest pass took longer than the fastest (relative).

    Example: [1.0, 1.3, 0.95] -> 0.368 (1.3 / 0.95 - 1)."""
    return max(ratios) / min(ratios) - 1.0 if ratios else 0.0


def cellwise(grids: list, reduce=statistics.median) -> tuple[tuple[float, ...], ...]:
    """Cell by cell ``reduce`` (the median; the workers' mean with ``statistics.fmean``)
    of several measurements of one grid.

    Example: [((1, 4),), ((3, 2),), ((2, 3),)] -> ((2, 3),)."""
    return tuple(tuple(float(reduce(g[i][j] for g in grids)) for j in range(len(grids[0][i])))
                 for i in range(len(grids[0])))
