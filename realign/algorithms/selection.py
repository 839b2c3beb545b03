"""Choosing the rows a train call trains on from the groups it was given: the best of
each group (rejection sampling), the best and the worst (online DPO), and the groups
whose samples disagree (DAPO's dynamic sampling).

A group is ``group_size`` consecutive rows sampled from one prompt (the generate
call's order). Selection happens in ``prepare``, inside the train call, so the rows
the call trains are exactly as many as its graph's train call says and the planner
prices (:mod:`planner.graph.algorithms`); what cannot be chosen without changing
that count (a prompt whose best answer is not good enough, a tie, a step short of
informative groups) keeps its rows with a loss weight of 0 instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from realign.algorithms.common import Batch, group_view

#: a batch key (bool per row) set by a stream whose buffer already dropped the constant
#: groups (DAPO's dynamic sampling at the buffer, ``rollout.mode: streaming``): the
#: batch holds exactly the groups to train
KEPT_INFORMATIVE = "kept_informative"


def select_rows(batch: Batch, index: torch.Tensor) -> Batch:
    """Every per-row tensor of ``batch`` (first dimension = its row count) at the rows
    ``index``, in that order; other values unchanged."""
    rows = batch["tokens"].shape[0]
    return {k: (v[index] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows
                else v) for k, v in batch.items()}


def constant_groups(rewards: torch.Tensor, group_size: int, what: str) -> torch.Tensor:
    """bool [groups]: every sample of the group got the same reward (so group-relative
    advantages are all 0 and the group teaches nothing).

    Example: rewards 1, 1, 0, 1 | 0, 0, 0, 0 in groups of 4 -> [False, True]."""
    g = group_view(rewards.float(), group_size, what)
    return (g == g[:, :1]).all(dim=1)


def best_in_groups(rewards: torch.Tensor, group_size: int, what: str) -> torch.Tensor:
    """The row index of each group's highest reward (the first of equals), [groups].

    Example: rewards 0.2, 0.9, 0.9 | 0.5, 0.1, 0.3 in groups of 3 -> [1, 3]."""
    g = group_view(rewards.float(), group_size, what)
    first = torch.arange(g.shape[0]) * group_size
    return first + g.argmax(dim=1)


def best_and_worst(rewards: torch.Tensor, group_size: int, what: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each group's highest reward: the first of equals, row of its lowest: the
    last of equals), [groups] each, so a group of equal rewards still gives two
    different rows (a tie).

    Example: rewards 1, 0, 1, 0 | 0.5, 0.5, 0.5, 0.5 in groups of 4 -> ([0, 4], [3, 7])."""
    g = group_view(rewards.float(), group_size, what)
    first = torch.arange(g.shape[0]) * group_size
    last_min = group_size - 1 - g.flip(1).argmin(dim=1)
    return first + g.argmax(dim=1), first + last_min


@dataclass(frozen=True)
class KeptGroups:
    """DAPO's dynamic sampling of one step: the rows to train and what it cost."""

    rows: torch.Tensor          #: row indices to train, whole groups in order [wanted * G]
    filler: torch.Tensor        #: bool per trained row: a constant group filling a shortfall
    dropped: int                #: generated groups with a constant reward
    shortfall: int              #: groups wanted but not informative (filled, weight 0)
    surplus: int                #: informative groups generated beyond those wanted


def keep_informative(rewards: torch.Tensor, group_size: int, wanted: int, what: str
                     ) -> KeptGroups:
    """Dynamic sampling (DAPO, Yu et al. 2025, section 3.2) on a step that generated for
    more groups than it trains: the first ``wanted`` groups whose rewards are not all
    equal, in the order generated; when fewer were generated, the constant groups that
    come first fill the rest (the caller gives them a loss weight of 0), so the train
    call always trains ``wanted`` groups.

    Example: groups (by reward) [1 1 1], [0 1 0], [0 0 0], [1 0 0], wanted 2 -> rows of
    groups 1 and 3, 2 dropped, no shortfall, no surplus; wanted 3 -> groups 1, 3 and 0
    (the filler), shortfall 1."""
    const = constant_groups(rewards, group_size, what)
    n_groups = const.shape[0]
    assert wanted <= n_groups, (wanted, n_groups)
    informative = torch.nonzero(~const).flatten()
    constant = torch.nonzero(const).flatten()
    chosen = informative[:wanted]
    fill = constant[:wanted - chosen.shape[0]]
    groups = torch.cat([chosen, fill])
    rows = (groups.unsqueeze(1) * group_size + torch.arange(group_size)).flatten()
    filler = torch.cat([torch.zeros(chosen.shape[0], dtype=torch.bool),
                        torch.ones(fill.shape[0], dtype=torch.bool)]).repeat_interleave(group_size)
    return KeptGroups(rows=rows, filler=filler, dropped=int(const.sum()),
                      shortfall=int(fill.shape[0]),
                      surplus=max(0, int(informative.shape[0]) - wanted))
