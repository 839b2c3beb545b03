"""A generate call as multi-turn episodes (``rollout.env`` / ``rollout.tools``): the
loop of :mod:`realign.agents.rollout` driven by the call's engine, realign's own or
vLLM, one generate per turn and episode group."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from realign.agents.config import MultiTurn
from realign.agents.interface import Environment, Episode
from realign.agents.rollout import EpisodeLoop, TurnGenerator, episode_records
from realign.agents.tool_calls import CALL_CLOSE
from realign.runtime.settings import SamplingParams

if TYPE_CHECKING:
    from realign.runtime.engines.generate import Generation

#: ``engine(prompts, params) -> Generation`` (GenerateEngine or VLLMEngine, bound)
Engine = Callable[[list[list[int]], SamplingParams], "Generation"]


def stop_ids(tokenizer, eos_id: int | None) -> tuple[int, ...]:
    """The end token, and ``</tool_call>`` where the tokenizer has it as one token (a
    turn that calls a tool ends there)."""
    out = [eos_id] if eos_id is not None else []
    close = tokenizer.get_vocab().get(CALL_CLOSE)
    if close is not None:
        out.append(int(close))
    return tuple(out)


def turn_generator(engine: Engine, params: SamplingParams, dp: int) -> TurnGenerator:
    """The rollout's per-turn generate over ``engine``: the rows padded to a multiple
    of ``dp`` (copies of the first, dropped again), the sampling seed a function of the
    call's seed and the turn call's index (so no two calls share noise)."""
    def generate(contexts: list[list[int]], max_new: int, call: int):
        rows = contexts + [contexts[0]] * (-len(contexts) % dp)
        p = params.model_copy(update={"max_new_tokens": max_new,
                                      "seed": (params.seed * 1_000_003 + call) % (1 << 62)})
        gen = engine(rows, p)
        out = []
        for i in range(len(contexts)):
            n = int(gen.lengths[i])
            out.append((gen.tokens[i, :n].tolist(), gen.logprobs[i, :n].tolist()))
        return out
    return generate


def generate_episodes(cfg: MultiTurn, make_env: Callable[[], Environment], tokenizer,
                      prompts: list[list[int]], prompts_rec: dict, engine: Engine,
                      params: SamplingParams, dp: int, budget: int, max_context: int,
                      pad_id: int, prefix: str) -> tuple[dict, dict, dict[str, float]]:
    """(seqs record, logprobs record, metrics) of one generate call's episodes; a
    prompt's ``len(prompts) / len(prompt texts)`` samples are consecutive rows."""
    k = len(prompts) // len(prompts_rec["texts"])
    episodes = [Episode(prompt=prompts_rec["texts"][i // k],
                        answer=prompts_rec["answers"][i // k], index=i,
                        prompt_ids=tuple(p)) for i, p in enumerate(prompts)]
    loop = EpisodeLoop(cfg, make_env,
                   encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
                   decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                   budget=budget, max_context=max_context)
    states = loop.run(prompts, episodes, turn_generator(engine, params, dp))
    seqs, logprobs = episode_records(states, pad_id)
    metrics = loop.metrics(states, prefix)
    model_tokens = seqs["action_mask"].sum()
    metrics[prefix + "model_tokens"] = float(model_tokens)
    return seqs, logprobs, metrics


def response_lengths(seqs: dict) -> torch.Tensor:
    """Tokens after the prompt of each episode (model turns and observations)."""
    return seqs["lengths"] - seqs["prompt_lengths"]
