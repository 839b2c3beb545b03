"""Scoring generated sequences with a reward function, as a rule reward does on the
ranks that generated them: decode each response, call ``fn(prompt, response,
answer)``, check what it returns. The worker (:mod:`realign.worker.calls`) and the
planner's timing of it (:mod:`realign.run.host_work`) run this same code."""
from __future__ import annotations

import math
from typing import Callable

import torch

from realign.errors import NonFiniteError, UserError


def decoded_answers(tokenizer, seqs: dict, prompts: dict) -> list[tuple[str, str, object]]:
    """(prompt text, decoded response, reference answer) of every sequence (a
    multi-turn episode's response is its last model turn, from ``answer_start``); a
    prompt's ``k`` responses are consecutive rows (``seqs``: tokens, prompt_lengths, lengths;
    ``prompts``: texts, answers)."""
    k = len(seqs["tokens"]) // len(prompts["answers"])
    # a multi-turn episode's answer is its last model turn (realign.agents.rollout)
    starts = seqs["answer_start"] if "answer_start" in seqs else seqs["prompt_lengths"]
    rows = zip(seqs["tokens"].tolist(), starts.tolist(), seqs["lengths"].tolist())
    texts = tokenizer.batch_decode([t[p:n] for t, p, n in rows], skip_special_tokens=True)
    return [(prompts["texts"][i // k], text, prompts["answers"][i // k])
            for i, text in enumerate(texts)]


def scores(fn: Callable, answers: list[tuple[str, str, object]], step: int,
           what: str) -> torch.Tensor:
    """``fn`` on every answer, as float32 (errors name the step and the ``what`` row)."""
    return torch.tensor([reward_value(fn(p, text, a), f"step {step}, {what} {i} "
                                                      f"(prompt {p!r})")
                         for i, (p, text, a) in enumerate(answers)], dtype=torch.float32)


def reward_value(value, where: str) -> float:
    """A reward function's return value as a float: a real number (a bool counts as 0
    or 1), finite; anything else stops the run naming ``reward.fn``, the value and
    ``where`` it came from."""
    if isinstance(value, (str, bytes)) or value is None:
        raise UserError(f"returned {value!r} ({type(value).__name__}) at {where}; a reward "
                        "function returns a number", field="reward.fn")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UserError(f"returned {value!r} ({type(value).__name__}) at {where}; a reward "
                        "function returns a number", field="reward.fn") from None
    if not math.isfinite(number):
        raise NonFiniteError(f"returned {value!r} at {where}; the run stops before it trains "
                             "on a non-finite reward", field="reward.fn")
    return number
