"""DAPO's dynamic sampling loop on a worker (Yu et al. 2025, section 3.2; the planner's
side: :mod:`planner.graph.sampling_rounds`).

A step's rollout and its scoring (the program's :class:`~realign.run.program.RoundSpan`)
run as rounds: after each, the rank that holds the round's rewards tells every rank of
the world which groups are constant (one broadcast: a global synchronisation point),
and every rank keeps, of the rollout records it holds, the informative groups until
``prompts_per_step`` are kept, and constant groups as a reserve to fill a step that
stays short. While the batch is short and rounds are left, the span runs again on the
round's own prompts (:meth:`realign.worker.session.Session.round_prompts`; generation
seeds from the step and the round), so a resumed run repeats every round exactly.
After the last round every holder's records are the same ``prompts_per_step`` groups:
the kept informative groups in the order generated, then reserve groups (loss weight 0
in ``prepare``) where the batch stayed short.

The first round generates for the plan's ``prompts_generated``; a later round for
:func:`planner.graph.sampling_rounds.round_size` prompts: the groups still missing over
the share kept, at the drop rate measured so far (:class:`DropRate`: this step's rounds
and, decayed, earlier steps'; every rank counts alike from the broadcast flags, and the
checkpoint keeps the count, so a resume sizes every round alike), at most
``max_round_prompts``, in multiples of :func:`~realign.run.program.round_quantum` (a
cap below it is refused when the run is prepared). Sizing from the measured rate
matters because the rate is no constant of a task: it climbs as the policy settles (0
to 0.97 on the tiny task), and a round of the first round's size then keeps one or
two groups. A round of other size runs each call of the span with its micro-batches
(generation: waves) scaled to keep the plan's rows per micro-batch or fewer
(:func:`round_call`), so the plan's memory holds; its time grows with the rows.

Metrics (from the deciding rank): ``<role>.sampling_rounds``, ``<role>.batch_full``
(1 or 0), ``<role>.kept_groups`` and ``<role>.dropped_groups`` (per round, lists),
``<role>.dropped_group_frac`` (constant groups among all generated),
``<role>.surplus_groups`` (informative groups generated and not trained),
``<role>.generated_per_trained``, ``<role>.round_prompts`` (per round, a list) and
``<role>.dropped_frac_seen`` (the drop rate the step's last round was sized at: this
step's earlier rounds with the decayed history of earlier steps; a step of one round
sizes none, and reports the history's rate alone, the one a second round would have
started from: 0 on a run's first step).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator, cast

import torch
import torch.distributed as dist

from planner.graph.sampling_rounds import round_size
from realign.algorithms.selection import constant_groups
from realign.run.ops import Call, Op
from realign.run.program import RoundSpan
from realign.runtime.router_replay import ROUTED_EXPERTS
from realign.worker.records import Record

#: the metrics of a generate call that add up over rounds (the rest: the last round's)
SUMMED = ("gen_tokens", "decode_steps.")


def group_rows(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """Row indices of whole groups, in order. Example: groups [2, 0], size 2 -> [4, 5, 0, 1]."""
    return (groups.unsqueeze(1) * group_size + torch.arange(group_size)).flatten()


def take_rows(rec: Record, rows: torch.Tensor) -> Record:
    """``rec``'s per-row values (tensors and lists whose first dimension is its row
    count) at ``rows``; other values unchanged."""
    n = _row_count(rec)
    out: Record = {}
    for k, v in rec.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
            out[k] = v[rows]
        elif isinstance(v, list) and len(v) == n:
            out[k] = [v[i] for i in rows.tolist()]
        else:
            out[k] = v
    return out


def _row_count(rec: Record) -> int:
    return next(v.shape[0] for v in rec.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def concat_records(recs: list[Record], pad_id: int) -> Record:
    """One record of the rows of ``recs`` in order; per-token tensors of different widths
    (their second dimension) are right-padded to the widest (``tokens`` with ``pad_id``,
    the rollout's experts with -1, the rest with 0).

    Example: tokens [[5, 6]] and [[7, 8, 9]], pad 0 -> [[5, 6, 0], [7, 8, 9]]."""
    out: Record = {}
    for k, first in recs[0].items():
        vals = [r[k] for r in recs]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            tensors = cast(list[torch.Tensor], vals)    # a name holds one kind in every record
            width = max(v.shape[1] for v in tensors) if first.dim() > 1 else 0
            fill = pad_id if k == "tokens" else -1 if k == ROUTED_EXPERTS else 0
            out[k] = torch.cat([torch.nn.functional.pad(
                v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1]), value=fill)
                if v.dim() > 1 else v for v in tensors])
        elif isinstance(first, list):
            lists = cast(list[list[object]], vals)     # a name holds one kind in every record
            out[k] = [x for v in lists for x in v]
        else:
            out[k] = first
    return out


def choose_groups(constant: torch.Tensor, kept: int, reserved: int, wanted: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(informative groups to keep, constant groups to reserve) of one round, in order:
    informative ones until ``wanted`` are kept in all, constant ones until the reserve
    could fill what is still missing.

    Example: constant [F, T, F, T, T], 2 kept, 0 reserved, 3 wanted -> ([0], [])."""
    informative = torch.nonzero(~constant).flatten()[:max(0, wanted - kept)]
    missing = wanted - kept - informative.shape[0]
    const = torch.nonzero(constant).flatten()[:max(0, missing - reserved)]
    return informative, const


def merge_round_metrics(total: dict, new: dict) -> None:
    """A later round's call metrics into the step's: token and decode-step counts add
    up, length histograms merge, anything else is the last round's."""
    for k, v in new.items():
        if k in total and k.startswith(SUMMED):
            total[k] = total[k] + v
        elif k == "response_len_hist" and k in total:
            counts: dict[int, int] = {}
            for length, c in total[k] + v:
                counts[length] = counts.get(length, 0) + c
            total[k] = [[length, counts[length]] for length in sorted(counts)]
        else:
            total[k] = v


#: how much an earlier step's counts weigh in the drop rate, per step since (the rate
#: climbs as the policy settles, so recent steps say more)
HISTORY_DECAY = 0.5


@dataclass
class DropRate:
    """Constant groups among the groups generated, counted over earlier steps with each
    step's weight :data:`HISTORY_DECAY` times the next one's (saved in checkpoints)."""

    dropped: float = 0.0
    generated: float = 0.0

    def share(self, dropped: int, generated: int) -> float:
        """The drop rate with this step's ``dropped`` of ``generated`` groups so far.

        Example: earlier 6 of 10, this step 9 of 10 -> 15 / 20 = 0.75."""
        total = self.generated + generated
        return (self.dropped + dropped) / total if total > 0 else 0.0

    def after_step(self, dropped: int, generated: int) -> None:
        """Count a finished step's groups (the earlier ones weigh less)."""
        self.dropped = self.dropped * HISTORY_DECAY + dropped
        self.generated = self.generated * HISTORY_DECAY + generated


def round_call(op: Call, rows: int, dp: int) -> Call:
    """``op`` (a call of the round span) on a round of ``rows`` rows: its micro-batches
    (generation: waves) scaled so that none holds more rows per data-parallel rank than
    the plan's (``op.mfc.n_seqs`` in ``op.micro_batches``), and for a scoring call
    dividing the rank's rows; a packed call keeps its token budget (its bins bound its
    memory). ``rows`` is a multiple of ``dp``.

    Example: plan 120 rows in 1 micro-batch at dp 2, a round of 480 rows -> 4; a round
    of 40 rows -> 1; plan 120 rows in 3, a round of 20 rows at dp 2 -> 10 rows per
    rank, at least ceil(3 * 20 / 120) = 1 -> 1."""
    planned = op.mfc.n_seqs
    mfc = op.mfc.model_copy(update={"n_seqs": rows})
    if op.token_budget is not None:
        return replace(op, mfc=mfc)
    per_rank = rows // dp
    least = max(1, min(per_rank, -(-op.micro_batches * rows // planned)))
    if op.kind == "generate":
        return replace(op, mfc=mfc, micro_batches=least)
    mb = next(m for m in range(least, per_rank + 1) if per_rank % m == 0)
    return replace(op, mfc=mfc, micro_batches=mb)


class SamplingLoop:
    """One step's rounds on one rank: walks the step's ops, running the program's span
    again while the batch is short (:meth:`walk`)."""

    def __init__(self, span: RoundSpan, max_rounds: int, rank: int, pad_id: int,
                 round_prompts: Callable[[int, int], dict[str, Record]],
                 history: DropRate | None = None, cap_prompts: int = 0, quantum: int = 1,
                 dps: dict[str, int] | None = None):
        """``round_prompts(round, n)``: the records of a later round's ``n`` prompts;
        ``history``: the drop rate of earlier steps (updated when the step finishes);
        ``cap_prompts``: the most prompts of a later round (0: the first round's);
        ``quantum``: a round's prompts are a multiple of it (at most ``cap_prompts``:
        :func:`~realign.run.program.round_quantum`);
        ``dps``: each call's data-parallel size, by replica key."""
        self.span, self.max_rounds, self.rank, self.pad_id = span, max_rounds, rank, pad_id
        self.round_prompts = round_prompts
        self.history = history if history is not None else DropRate()
        self.cap = cap_prompts or span.groups_per_round
        self.quantum, self.dps = quantum, dps or {}
        self.round = 0
        self.sizes = [span.groups_per_round]        #: prompts of each round so far
        #: the rate the last round was sized at (before a second round: the history's)
        self.seen = self.history.share(0, 0)
        self.kept: dict[str, list[Record]] = {}
        self.reserve: dict[str, list[Record]] = {}
        self.n_kept = self.n_reserved = 0
        self.kept_groups: list[int] = []
        self.dropped_groups: list[int] = []
        self.surplus = 0

    def walk(self, ops: tuple[Op, ...], store: dict[str, Record], metrics: dict
             ) -> Iterator[tuple[int, Op]]:
        """(index, op) of the step in order; after the span's last op, the round closes
        (every rank: :meth:`close_round`) and the span runs again when the batch is
        short and rounds are left, on a round sized by :meth:`next_size` (its calls
        rescaled: :func:`round_call`). Indices of a later round's ops are shifted by the
        ops' count per round, so each op's time stays its own."""
        i = 0
        while i < len(ops):
            op = ops[i]
            n = self.sizes[-1]
            if (n != self.span.groups_per_round and isinstance(op, Call)
                    and self.span.start <= i < self.span.end):
                op = round_call(op, n * self.span.group_size, self.dps.get(op.replica, 1))
            yield i + self.round * len(ops), op
            i += 1
            if i == self.span.end:
                if self.close_round(store) or self.round + 1 == self.max_rounds:
                    self.finish(store, metrics)
                else:
                    self.round += 1
                    self.sizes.append(self.next_size())
                    store.update(self.round_prompts(self.round, self.sizes[-1]))
                    i = self.span.start

    def next_size(self) -> int:
        """The prompts of the next round: the missing groups at the drop rate measured
        so far (:func:`~planner.graph.sampling_rounds.round_size`)."""
        self.seen = self.history.share(sum(self.dropped_groups), sum(self.sizes))
        return round_size(self.span.groups_wanted - self.n_kept, self.seen, self.cap,
                          self.quantum)

    def close_round(self, store: dict[str, Record]) -> bool:
        """Which groups of the round are constant (broadcast from the rank holding its
        rewards); keep and reserve groups of the records this rank holds. True: the
        batch is full."""
        s = self.span
        flags = torch.zeros(self.sizes[-1], dtype=torch.uint8)
        if self.rank == s.decider:
            rewards = store[s.rewards_key][s.rewards_key]
            assert isinstance(rewards, torch.Tensor), "a rewards record holds a tensor"
            flags = constant_groups(rewards, s.group_size, "algorithm.samples_per_prompt"
                                    ).to(torch.uint8)
        dist.broadcast(flags, src=s.decider)
        constant = flags.bool()
        info, const = choose_groups(constant, self.n_kept, self.n_reserved, s.groups_wanted)
        for key in s.keys:
            if key in store:
                rec = store[key]
                self.kept.setdefault(key, []).append(take_rows(rec, group_rows(info, s.group_size)))
                self.reserve.setdefault(key, []).append(
                    take_rows(rec, group_rows(const, s.group_size)))
        informative = int((~constant).sum())
        self.n_kept += info.shape[0]
        self.n_reserved += const.shape[0]
        self.surplus += informative - info.shape[0]
        self.kept_groups.append(info.shape[0])
        self.dropped_groups.append(int(constant.sum()))
        return self.n_kept >= s.groups_wanted

    def finish(self, store: dict[str, Record], metrics: dict) -> None:
        """Every held rollout record: the kept groups, then reserve groups up to
        ``groups_wanted``; the step's sampling metrics on the deciding rank."""
        s = self.span
        fill = s.groups_wanted - self.n_kept
        for key in self.kept:
            parts = self.kept[key] + self.reserve[key]
            rec = concat_records(parts, self.pad_id)
            store[key] = take_rows(rec, torch.arange(s.groups_wanted * s.group_size))
        assert fill <= self.n_reserved, (fill, self.n_reserved)
        if self.rank == s.decider:
            rounds = self.round + 1
            generated = sum(self.sizes)
            p = f"{s.role}."
            metrics.update({
                p + "sampling_rounds": float(rounds),
                p + "batch_full": float(fill <= 0),
                p + "kept_groups": list(self.kept_groups),
                p + "dropped_groups": list(self.dropped_groups),
                p + "dropped_group_frac": sum(self.dropped_groups) / generated,
                p + "surplus_groups": float(self.surplus),
                p + "generated_per_trained": generated / s.groups_wanted,
                p + "round_prompts": list(self.sizes),
                p + "dropped_frac_seen": self.seen})
        self.history.after_step(sum(self.dropped_groups), sum(self.sizes))

    def tag(self, label: str, metric: str | None) -> tuple[str, str | None]:
        """An op's timeline label and time metric in this round (the first round's are
        the op's own)."""
        if self.round == 0:
            return label, metric
        r = self.round + 1
        return f"{label} (round {r})", (f"{metric}.round{r}" if metric else None)
