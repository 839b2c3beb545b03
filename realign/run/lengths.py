"""The length distributions a plan prices: of the responses (a previous run's record,
``plan.lengths_from``) and of the prompts (the training data's, ``data.train``).

``algorithm.gen_len`` and ``algorithm.prompt_len`` are caps; the runtime pads a batch
only to its longest row, so a plan prices the lengths the rows have
(:mod:`planner.graph.padding`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.errors import PlanError
from planner.graph.algorithms import algorithm_spec
from planner.graph.lengths import GenLengths
from planner.specs.model_spec import model_presets
from realign.config.experiment import ExperimentConfig


def data_prompt_lengths(cfg: ExperimentConfig) -> GenLengths | None:
    """The training prompts' token lengths (``data.train`` tokenized with the actor's
    tokenizer, as the run reads it), each at most ``algorithm.prompt_len``, as a
    histogram. None (every prompt priced at ``prompt_len``) when the algorithm
    generates nothing, there is no prompt data, the actor is a preset (no tokenizer
    here), or the data file is not on this machine (a plan made away from the data).

    A file that is there but cannot be read is the :class:`UserError` the run would
    raise."""
    data = cfg.data
    if (data is None or data.train.kind != "prompts" or cfg.models.actor is None
            or cfg.models.actor in model_presets()
            or not algorithm_spec(cfg.algorithm.name).generates):
        return None
    if not Path(data.train.path).is_file():
        return None
    from realign.data.datasets import load_dataset
    from realign.data.tokenizer import model_tokenizer

    tok = model_tokenizer(cfg.models.actor, field="models.actor")
    cap = cfg.algorithm.prompt_len
    counts: dict[int, float] = {}
    for e in load_dataset(data.train, tok, field="data.train").examples:
        n = min(max(len(e.prompt_ids), 1), cap)
        counts[n] = counts.get(n, 0.0) + 1.0
    return GenLengths(max_len=cap, histogram=tuple(sorted(counts.items())))


#: the setting that names a previous run's record
LENGTHS_FROM = "plan.lengths_from"


def recorded_rows(cfg: ExperimentConfig) -> tuple[Path, list[tuple[int, dict[str, Any]]]] | None:
    """The metrics rows of the run ``plan.lengths_from`` names (a run folder or its
    metrics.jsonl): (the file, each row that is a JSON object with its line number).
    None when unset; a :class:`PlanError` naming the setting when there is no such file
    or a line is not JSON."""
    if not cfg.plan.lengths_from:
        return None
    p = Path(cfg.plan.lengths_from)
    f = p / "metrics.jsonl" if p.is_dir() else p
    if not f.is_file():
        raise PlanError(f"no metrics.jsonl at {str(f)!r} (give a run folder or its "
                        "metrics.jsonl)", field=LENGTHS_FROM)
    rows = []
    for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise PlanError(f"{f} line {n} is not JSON", field=LENGTHS_FROM) from None
        if isinstance(row, dict):
            rows.append((n, row))
    return f, rows


def recorded_lengths(cfg: ExperimentConfig) -> GenLengths | None:
    """The response-length distribution ``plan.lengths_from`` names: a previous run's
    metrics.jsonl. Its steps' ``response_len_hist`` (every sampled response's length)
    pooled into a histogram, lengths past this experiment's ``gen_len`` counted at
    the cap; from a run that recorded only ``response_len`` (the step's mean), the mean
    of those means. None when unset."""
    recorded = recorded_rows(cfg)
    if recorded is None:
        return None
    f, rows = recorded
    gen_len = cfg.algorithm.gen_len
    means: list[float] = []
    counts: dict[int, float] = {}
    for n, row in rows:
        v = row.get("response_len")
        if isinstance(v, (int, float)) and v > 0:
            means.append(float(v))
        for length, count in _histogram_pairs(row.get("response_len_hist"), f, n):
            at = min(max(length, 1), gen_len)
            counts[at] = counts.get(at, 0.0) + count
    if counts:
        return GenLengths(max_len=gen_len, histogram=tuple(sorted(counts.items())))
    if not means:
        raise PlanError(f"{f} records no response_len (a run with a generate call writes "
                        "one per step)", field=LENGTHS_FROM)
    return GenLengths(max_len=gen_len, mean=min(float(gen_len), sum(means) / len(means)))


def _histogram_pairs(value: Any, f: Path, line: int) -> list[tuple[int, float]]:
    """A metrics row's ``response_len_hist`` as (length, count) pairs ([] when absent)."""
    if value is None:
        return []
    ok = isinstance(value, list) and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) for x in p)
        and p[1] >= 0 for p in value)
    if not ok:
        raise PlanError(f"{f} line {line}: response_len_hist must be [[length, count], ...] "
                        "of whole numbers", field=LENGTHS_FROM)
    return [(int(a), float(c)) for a, c in value]


def recorded_turns(cfg: ExperimentConfig) -> dict[str, float]:
    """What a previous multi-turn run (``plan.lengths_from``) measured of its episodes,
    averaged over its steps: ``turns`` (model turns per episode), ``obs_tokens`` (tokens
    per observation: the masked share of the response tokens over the observations,
    one fewer than the turns) and ``env_s`` (environment seconds per step call).
    Empty when unset or when the run recorded no ``rollout.turns``; a missing file or a
    line that is not JSON: :func:`recorded_rows`' :class:`PlanError`."""
    recorded = recorded_rows(cfg) if cfg.rollout.multi_turn else None
    if recorded is None:
        return {}
    turns, obs, env = [], [], []
    for _, row in recorded[1]:
        t = row.get("rollout.turns")
        if not isinstance(t, (int, float)) or t <= 0:
            continue
        turns.append(float(t))
        share, length = row.get("rollout.masked_share"), row.get("response_len")
        if isinstance(share, (int, float)) and isinstance(length, (int, float)) and t > 1:
            obs.append(share * length / (t - 1))
        per_call = row.get("rollout.env_s_per_call")
        if isinstance(per_call, (int, float)):
            env.append(float(per_call))
    out: dict[str, float] = {}
    for key, xs in (("turns", turns), ("obs_tokens", obs), ("env_s", env)):
        if xs:
            out[key] = sum(xs) / len(xs)
    return out


def recorded_drop_frac(cfg: ExperimentConfig) -> float | None:
    """The share of constant groups a previous DAPO run (``plan.lengths_from``) dropped
    over all its steps (``actor.dropped_group_frac``, each step weighed by the groups
    it generated: ``actor.round_prompts`` where it sampled in rounds), which prices
    DAPO's sampling rounds (:func:`planner.graph.sampling_rounds.sized_rounds`). None
    when unset or when the run recorded no drop rate (then the configured
    ``algorithm.dropped_group_frac`` prices them). A streamed run (``rollout.mode:
    streaming``) of DAPO (its rows carry ``actor.shortfall_frac``) recorded its drops at
    the buffer: ``stream.dropped_constant`` of the groups it finished (those and the
    ones it trained, ``stream.staleness_hist.*``). A missing file or a line that is not
    JSON: :func:`recorded_rows`' :class:`PlanError`."""
    recorded = recorded_rows(cfg)
    if recorded is None:
        return None
    f, rows = recorded
    dropped = generated = 0.0
    for n, row in rows:
        constant = row.get("stream.dropped_constant")
        if isinstance(constant, (int, float)) and constant >= 0 and "actor.shortfall_frac" in row:
            trained = sum(v for k, v in row.items() if k.startswith("stream.staleness_hist.")
                          and isinstance(v, (int, float)))
            dropped += constant
            generated += constant + trained
            continue
        share = row.get("actor.dropped_group_frac")
        if not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            continue
        sizes = row.get("actor.round_prompts")
        if sizes is not None and not (isinstance(sizes, list) and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in sizes)):
            raise PlanError(f"{f} line {n}: actor.round_prompts must be a list of "
                            f"whole numbers of prompts, 0 or more (per sampling round), not "
                            f"{json.dumps(sizes)}", field=LENGTHS_FROM)
        weight = float(sum(sizes)) if sizes else 1.0
        dropped += share * weight
        generated += weight
    return dropped / generated if generated else None
