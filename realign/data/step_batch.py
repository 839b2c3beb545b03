"""The batch of one training step, as every worker builds it: the sampler's
``step``-th draw of ``n`` examples, collated by the dataset's kind. A pure function of
(dataset, step), so a resumed run and the planner's timing of it
(:mod:`realign.run.host_work`) build exactly what an uninterrupted run does."""
from __future__ import annotations

from typing import Sequence

from realign.data.collate import collate_preferences, collate_prompts, collate_sft
from realign.data.datasets import Dataset, PromptExample
from realign.data.sampler import PromptSampler


def prompts_record(examples: Sequence[PromptExample], pad: int) -> dict:
    """Prompts collated, with their texts and reference answers (for rule rewards)."""
    rec = collate_prompts(examples, pad)
    rec["answers"] = [e.answer for e in examples]
    rec["texts"] = [e.prompt if isinstance(e.prompt, str) else str(e.prompt) for e in examples]
    return rec


def step_batch(dataset: Dataset, n: int, step: int, pad: int) -> dict:
    """The ``step``-th batch of ``n`` examples (shuffled and seeded as the dataset's
    config says)."""
    c = dataset.config
    sampler = PromptSampler(len(dataset), n, seed=c.seed, shuffle=c.shuffle)
    sampler.consumed = step * n
    examples = dataset.take(sampler.next_batch())
    if c.kind == "prompts":
        return prompts_record(examples, pad)
    if c.kind == "preferences":
        return collate_preferences(examples, pad)
    return collate_sft(examples, pad)
