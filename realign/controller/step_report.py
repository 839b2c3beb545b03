"""A step's row of metrics and its timeline events, merged from every worker's report
(:meth:`realign.worker.runner.StepRunner.run`). Pure."""
from __future__ import annotations


def _last_spans(reports: list[dict]) -> tuple[dict[int, float], dict[int, float]]:
    """Per op index: its last rank's start and its last rank's end (every rank reports
    its own ``spans``; before its peers arrive a rank only waits for them)."""
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    for rep in reports:
        for i, t0, t1 in rep.get("spans", []):
            starts[i] = max(starts.get(i, t0), t0)
            ends[i] = max(ends.get(i, t1), t1)
    return starts, ends


def op_events(reports: list[dict]) -> list[list]:
    """The step's ops as ``[label, kind, start, end, gpus]``: named by their lead rank,
    timed from their last rank's start to their last rank's end."""
    starts, ends = _last_spans(reports)
    out = []
    for rep in reports:
        for i, label, kind, gpus, _metric in rep.get("ops", []):
            out.append([label, kind, starts[i], max(ends[i], starts[i]), gpus])
    return sorted(out, key=lambda e: e[2])


def op_times(reports: list[dict]) -> dict[str, float]:
    """``time.<mfc>`` and ``time.realloc.<mfc>``: each timed op's last rank's end minus
    its last rank's start."""
    starts, ends = _last_spans(reports)
    return {metric: max(0.0, ends[i] - starts[i]) for rep in reports
            for i, _label, _kind, _gpus, metric in rep.get("ops", []) if metric}


def merge_metrics(step: int, reports: list[dict], wall_s: float) -> dict:
    """One row per step from every worker's report: the union of what the ops' lead
    ranks reported (``metrics``), each timed op's duration (:func:`op_times`), the bytes
    each reallocation's ranks received summed (``realloc_bytes.<mfc>``, and
    ``realloc_bytes`` in all), and the mean of each ``dp_parts`` metric over the
    workers that reported it (one per data-parallel rank, equal shares of the batch)."""
    row: dict = {"step": step, "step_time_s": wall_s}
    row.update(op_times(reports))
    received: dict[str, float] = {}
    shares: dict[str, list[float]] = {}
    for rep in reports:
        for k, v in rep["metrics"].items():
            if k.startswith("realloc_bytes.") and ".r" in k:
                name = k.rsplit(".r", 1)[0]
                received[name] = received.get(name, 0.0) + v
            else:
                row[k] = v
        for k, v in rep["dp_parts"].items():
            shares.setdefault(k, []).append(v)
    row.update({k: sum(v) / len(v) for k, v in shares.items()})
    if received:
        row.update(received)
        row["realloc_bytes"] = sum(received.values())
    if "gen_tokens" in row and wall_s > 0:
        row["tokens_per_s"] = row["gen_tokens"] / wall_s
    return row
