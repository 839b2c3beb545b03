"""Packed micro-batches: the rows of a batch laid end to end in bins of a fixed number
of tokens (:mod:`planner.graph.packing` chooses the bins and documents how each call
kind packs), and the way back from a packed output to the padded layout [rows, seq]
every loss function and caller reads.

A :class:`Pack` holds what the packed forward needs (token ids, positions restarting
at 0 for each row, each token's row within its bin) and what unpacking needs (for
each row and column, the flat index of its token in the pack). The model never sees
the padded rows: the head's outputs at packed positions are gathered back into
[rows, seq] with zeros past each row's length, exactly as the padded forward leaves
them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from planner.graph.packing import (
    budget_for_bins,
    first_fit_decreasing,
    group_bins,
    round_block,
)

#: which attention kernel runs the pack (realign.runtime.engines.packed_attention)
Kernel = Literal["flex", "segments"]


@dataclass
class Pack:
    """``bins`` rows of ``width`` tokens each, built by :func:`make_pack`."""

    tokens: torch.Tensor        #: [bins, width] token ids, 0 past the bin's last row
    positions: torch.Tensor     #: [bins, width] position within the token's own row
    doc: torch.Tensor           #: [bins, width] the token's row within its bin; -1 past
    rows: torch.Tensor          #: [n] the batch rows packed here, in the order of ``index``
    lengths: torch.Tensor       #: [n] their lengths
    index: torch.Tensor         #: [n, seq] flat index into [bins * width] of (row, column)
    #: per bin, (start, length) of each row in it: the CPU kernel's segments
    segments: list[list[tuple[int, int]]]
    kernel: Kernel
    #: the kernel's own per-pack state (FlexAttention's block mask), made on first use
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)     # type: ignore[return-value]

    def padded_tokens(self) -> int:
        """Positions of the pack that hold no row's token."""
        return self.tokens.numel() - int(self.lengths.sum())

    def unpack(self, out: torch.Tensor, cols: int, shift: int = 0) -> torch.Tensor:
        """Per-position outputs of the pack [bins, width] -> [n, cols] in the padded
        layout: entry (i, c) is the output at column c of row ``rows[i]``, zero where
        ``c >= length - shift`` (``shift`` 1: next-token log-probs, whose last column of
        each row predicts nothing). Differentiable (a gather)."""
        flat = out.reshape(-1)
        idx = self.index[:, :cols]
        valid = torch.arange(cols, device=out.device) < (self.lengths - shift).unsqueeze(1)
        return flat[idx] * valid


def make_pack(tokens: torch.Tensor, lengths: torch.Tensor, bins: list[list[int]],
              width: int, kernel: Kernel) -> Pack:
    """Pack rows of right-padded ``tokens`` [n, s] with ``lengths`` [n]: bin j holds the
    rows ``bins[j]`` (indices into ``tokens``) in that order, within ``width`` tokens."""
    n_bins, s = len(bins), tokens.shape[1]
    dev = tokens.device
    lens = [int(x) for x in lengths.tolist()]
    order = [i for b in bins for i in b]
    packed = torch.zeros(n_bins, width, dtype=tokens.dtype, device=dev)
    positions = torch.zeros(n_bins, width, dtype=torch.long, device=dev)
    doc = torch.full((n_bins, width), -1, dtype=torch.long, device=dev)
    starts: list[int] = []
    segments: list[list[tuple[int, int]]] = []
    for j, b in enumerate(bins):
        at, segs = 0, []
        for k, i in enumerate(b):
            n = lens[i]
            packed[j, at:at + n] = tokens[i, :n]
            positions[j, at:at + n] = torch.arange(n, device=dev)
            doc[j, at:at + n] = k
            starts.append(j * width + at)
            segs.append((at, n))
            at += n
        assert at <= width, f"bin {j} holds {at} tokens, more than its {width}"
        segments.append(segs)
    cols = torch.arange(s, device=dev)
    rows = torch.tensor(order, dtype=torch.long, device=dev)
    row_lens = torch.tensor([lens[i] for i in order], dtype=torch.long, device=dev)
    start = torch.tensor(starts, dtype=torch.long, device=dev)
    # past a row's length the index points at its own first token (masked in unpack)
    index = start.unsqueeze(1) + torch.where(cols < row_lens.unsqueeze(1), cols, 0)
    return Pack(tokens=packed, positions=positions, doc=doc, rows=rows, lengths=row_lens,
                index=index, segments=segments, kernel=kernel)


def inference_packs(tokens: torch.Tensor, lengths: torch.Tensor, micro_batches: int,
                    kernel: Kernel, token_budget: int | None = None) -> list[Pack]:
    """The packs a scoring call runs on one data-parallel rank's rows, one bin per pack,
    every pack of one width (a static shape for the pipeline's stages, which all see the
    same rows and so pack them alike): :func:`inference_bins`."""
    lens = [int(x) for x in lengths.tolist()]
    bins, width = inference_bins(lens, micro_batches, token_budget)
    return [make_pack(tokens, lengths, [b], width, kernel) for b in bins]


def inference_bins(lens: list[int], micro_batches: int, token_budget: int | None
                   ) -> tuple[list[list[int]], int]:
    """(bins, width) of a scoring call on one data-parallel rank's rows of lengths
    ``lens``. With the plan's ``token_budget``: first-fit decreasing into bins of at
    most that many tokens, as many as it takes, all as wide as the fullest bin rounded
    up to a block. That width is at most the budget (a block multiple), so the memory
    the plan priced at the budget holds; and where the rows fill less than the budget
    (one bin, or bins that first-fit decreasing leaves short) the packs compute no
    padding beyond the fullest bin's rounding. Without a budget: at most
    ``micro_batches`` bins of the smallest block-rounded budget that fits
    (:func:`planner.graph.packing.budget_for_bins`), all of that width.

    Example: lengths [10, 3, 6, 1], budget 16 -> [[0, 2], [1, 3]] (16 and 4 tokens),
    width 16; budget 48 -> one bin of 20 tokens, width 32; two micro-batches and no
    budget -> the same two bins at the smallest budget that fits them, 16."""
    if token_budget is None:
        budget = budget_for_bins(lens, micro_batches)
        return first_fit_decreasing(lens, budget), budget
    bins = first_fit_decreasing(lens, token_budget)
    return bins, round_block(max(sum(lens[i] for i in b) for b in bins))


def train_packs(micro: list[dict[str, torch.Tensor]], kernel: Kernel) -> list[Pack]:
    """One pack per training micro-batch (the plan's equal rows, or a token budget's
    bin: :func:`planner.graph.packing.group_bins`), holding that micro-batch's rows in
    order, all of the width of the fullest micro-batch, block-rounded."""
    width = round_block(max(int(mb["lengths"].sum()) for mb in micro))
    return [make_pack(mb["tokens"], mb["lengths"], [list(range(len(mb["lengths"])))],
                      width, kernel) for mb in micro]


def call_padding(lengths: torch.Tensor, width: int, dp: int, micro_batches: int,
                 kind: Literal["inference", "train"], packing: bool,
                 token_budget: int | None = None, group_size: int = 1) -> int:
    """Positions holding no row's token that one scoring call (or one optimizer step of
    a training call) computes over all its data-parallel ranks, from the rows' lengths
    alone, packed as :func:`inference_packs` (with the plan's ``token_budget``, if any) /
    :func:`train_packs` pack them (a training call with a budget: in the bins of
    :func:`planner.graph.packing.group_bins`, whole groups of ``group_size`` rows) or
    padded to ``width``: the ``padded_tokens`` metrics.

    Example: lengths [4, 2, 3, 1], width 4, dp 1, one micro-batch: padded 16 - 10 = 6;
    packed into one bin of 16: 6 too (rows this short fill less than a block), while
    lengths [4] * 8 + [1] * 8 at width 4: padded 64 - 40 = 24, packed 48 - 40 = 8."""
    lens = [int(x) for x in lengths.tolist()]
    if not packing:
        return len(lens) * width - sum(lens)
    per = len(lens) // dp
    total = 0
    for d in range(dp):
        mine = lens[d * per:(d + 1) * per]
        if kind == "inference":
            bins, pack_width = inference_bins(mine, micro_batches, token_budget)
            total += pack_width * len(bins)
        elif token_budget is not None:
            bins = group_bins(mine, group_size, token_budget)
            total += len(bins) * round_block(max(sum(mine[i] for i in b) for b in bins))
        else:
            size = per // micro_batches
            total += micro_batches * round_block(max(
                sum(mine[i * size:(i + 1) * size]) for i in range(micro_batches)))
    return total - sum(lens)
