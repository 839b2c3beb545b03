"""Examples -> right-padded int64 tensors, in the engines' batch format (``tokens``
[b, s], ``lengths`` [b], see :mod:`realign.runtime.engines.base`).

* prompts (for generation): ``tokens`` = the prompts, ``lengths`` their lengths;
* preferences: two rows per pair, interleaved — row ``2i`` is pair ``i``'s prompt +
  chosen response, row ``2i+1`` its prompt + rejected response — with
  ``prompt_lengths`` (the loss covers positions ``prompt_lengths <= t < lengths``);
* SFT: prompt + response rows with ``prompt_lengths`` and ``assistant_mask`` [b, s]
  (1 on the tokens of a conversation's earlier assistant turns, inside the prompt).
"""
from __future__ import annotations

from typing import Sequence

import torch

from realign.data.datasets import PreferenceExample, PromptExample, SFTExample

Batch = dict[str, torch.Tensor]


def contiguous_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """Rows ``[start, stop)`` of ``parts`` contiguous ranges over ``n`` rows, as equal as
    can be and never empty: ``(10, 4)`` -> [(0, 3), (3, 6), (6, 8), (8, 10)]; the waves
    of a generate call and the environment groups of a multi-turn rollout."""
    parts = max(1, min(parts, n))
    q, r = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + q + (1 if i < r else 0)
        out.append((start, stop))
        start = stop
    return out


def pad_right(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [b, max_len] int64 filled with pad_id after each row, lengths [b])``,
    built in one tensor construction (a per-row copy costs a tensor op per row)."""
    if not rows:
        raise ValueError("pad_right needs at least one row")
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    longest = int(lengths.max())
    tokens = torch.tensor([list(r) + [pad_id] * (longest - len(r)) for r in rows],
                          dtype=torch.long)
    return tokens, lengths


def collate_prompts(examples: Sequence[PromptExample], pad_id: int) -> Batch:
    tokens, lengths = pad_right([e.prompt_ids for e in examples], pad_id)
    return {"tokens": tokens, "lengths": lengths}


def collate_preferences(examples: Sequence[PreferenceExample], pad_id: int) -> Batch:
    rows, prompt_lengths = [], []
    for e in examples:
        rows += [e.prompt_ids + e.chosen_ids, e.prompt_ids + e.rejected_ids]
        prompt_lengths += [len(e.prompt_ids)] * 2
    tokens, lengths = pad_right(rows, pad_id)
    return {"tokens": tokens, "lengths": lengths,
            "prompt_lengths": torch.tensor(prompt_lengths, dtype=torch.long)}


def collate_sft(examples: Sequence[SFTExample], pad_id: int) -> Batch:
    tokens, lengths = pad_right([e.prompt_ids + e.response_ids for e in examples], pad_id)
    assistant = torch.zeros(tokens.shape, dtype=torch.long)      # int64, as every key
    for i, e in enumerate(examples):
        for a, b in e.assistant_spans:
            assistant[i, a:b] = 1
    return {"tokens": tokens, "lengths": lengths,
            "prompt_lengths": torch.tensor([len(e.prompt_ids) for e in examples],
                                           dtype=torch.long),
            "assistant_mask": assistant}


def response_mask(batch: Batch) -> torch.Tensor:
    """[b, s] bool: True at response positions ``prompt_lengths <= t < lengths``."""
    t = torch.arange(batch["tokens"].shape[1])
    return (t >= batch["prompt_lengths"][:, None]) & (t < batch["lengths"][:, None])
