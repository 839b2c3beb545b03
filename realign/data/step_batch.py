"""The batch of one training step, as every worker builds it: the sampler's
``step``-th draw of ``n`` examples, collated by the dataset's kind. A pure function of
(dataset, step), so a resumed run and the planner's timing of it
(:mod:`realign.run.host_work`) build exactly what an uninterrupted run does."""
from __future__ import annotations

from typing import Any, Sequence, cast

from realign.data.collate import collate_preferences, collate_prompts, collate_sft
from realign.data.datasets import Dataset, PreferenceExample, PromptExample, SFTExample
from realign.data.sampler import PromptSampler


def prompts_record(examples: Sequence[PromptExample], pad: int) -> dict[str, Any]:
    """Prompts collated, with their texts and reference answers (for rule rewards)."""
    rec: dict[str, Any] = collate_prompts(examples, pad)
    rec["answers"] = [e.answer for e in examples]
    rec["texts"] = [e.prompt if isinstance(e.prompt, str) else str(e.prompt) for e in examples]
    return rec


def step_batch(dataset: Dataset, n: int, step: int, pad: int) -> dict[str, Any]:
    """The ``step``-th batch of ``n`` examples (shuffled and seeded as the dataset's
    config says)."""
    c = dataset.config
    sampler = PromptSampler(len(dataset), n, seed=c.seed, shuffle=c.shuffle)
    sampler.consumed = step * n
    examples = dataset.take(sampler.next_batch())
    # the casts: a dataset holds examples of its config's kind only (load_dataset builds them)
    if c.kind == "prompts":
        return prompts_record(cast(list[PromptExample], examples), pad)
    if c.kind == "preferences":
        return collate_preferences(cast(list[PreferenceExample], examples), pad)
    return collate_sft(cast(list[SFTExample], examples), pad)
