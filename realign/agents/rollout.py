"""The multi-turn rollout: generate a turn, let the environment answer, append its
observation, go on, up to ``max_turns`` and the response's token budget.

The loop drives any engine through one function (:data:`TurnGenerator`): realign's own
engine and vLLM both serve it (:func:`realign.worker.calls.turn_generator`). The
batch's episodes are split into ``env_groups`` fixed, contiguous groups that take
turns: group ``g`` decodes its turn ``t`` while the environment steps of the groups
before it (their turn ``t``) run in their threads, so while one sequence waits for
its tool the others keep decoding; every step of a group runs concurrently with the
others (one daemon thread each, :func:`realign.agents.tools.start`) within the
per-call timeout. Which rows a generate call holds depends on nothing but the
episodes' states, so with a deterministic environment the rollout is a function of
the weights and the seed (a resumed run repeats it bit for bit).

What the record holds (:func:`episode_records`): the context as it grew (prompt,
model turns, observations) in ``tokens``; ``action_mask`` [b, s-1] is 1 on the
log-prob positions that score a model token and 0 on observation tokens and
padding, so no algorithm trains on what the environment wrote
(:func:`realign.algorithms.common.batch_mask`); ``answer_start`` is where the last
model turn begins (``reward.fn`` and the verifier read the final answer from there);
``env_reward`` sums the per-turn rewards.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from realign.agents.config import MultiTurn
from realign.agents.interface import Environment, Episode, Step
from realign.agents.observation import cut_observation
from realign.agents.tools import ToolFailure, start, wait
from realign.data.collate import contiguous_ranges, pad_right

#: ``generate(contexts, max_new_tokens, call) -> [(token ids, log-probs)]`` per
#: context (``call``: the generate call's index within the rollout, distinct for every
#: call); a row's tokens end at its stop token (included) or at ``max_new_tokens``.
TurnGenerator = Callable[[list[list[int]], int, int], list[tuple[list[int], list[float]]]]


@dataclass
class _State:
    """One episode as it goes."""

    env: Environment | None
    prompt: list[int]
    budget: int                                  #: response tokens left
    response: list[int] = field(default_factory=list)
    is_model: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    answer_start: int = 0                        #: in ``response``
    turns: int = 0
    done: bool = False
    turn_rewards: list[float] = field(default_factory=list)
    pending: tuple | None = None                 #: (future, deadline, started) of a step
    tool_calls: float = 0.0

    def add(self, tokens: list[int], logprobs: list[float] | None) -> None:
        self.response += tokens
        self.is_model += [logprobs is not None] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.budget -= len(tokens)


@dataclass
class Counters:
    """The rollout's metrics (:meth:`metrics`)."""

    tool_calls: float = 0.0
    tool_errors: float = 0.0
    env_errors: float = 0.0
    truncated: float = 0.0
    env_s: float = 0.0           #: summed wall time of the steps (in their threads)
    env_wait_s: float = 0.0      #: time the loop stood waiting for a step
    steps: int = 0
    kinds: dict[str, float] = field(default_factory=dict)


class EpisodeLoop:
    """One generate call's episodes. ``encode(text) -> ids`` and ``decode(ids) ->
    text`` are the tokenizer's (no special tokens added); ``max_context`` is the
    longest context a generate call may take (the model's positions)."""

    def __init__(self, cfg: MultiTurn, make_env: Callable[[], Environment],
                 encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 budget: int, max_context: int):
        self.cfg, self.make_env, self.encode, self.decode = cfg, make_env, encode, decode
        self.budget, self.max_context = budget, max_context
        self.turn_tokens = min(cfg.turn_tokens or budget, budget)
        self.count = Counters()

    # ---- the loop ----------------------------------------------------------------------
    def run(self, prompts: list[list[int]], episodes: list[Episode],
            generate: TurnGenerator) -> list[_State]:
        states = [_State(None, list(p), self.budget) for p in prompts]
        for s, ep in zip(states, episodes):
            s.pending = self._start(partial(self._reset, s, ep))
        for s in states:
            self._finish(s, reset=True)
        groups = contiguous_ranges(len(states), self.cfg.env_groups)
        for turn in range(self.cfg.max_turns):
            for g, (lo, hi) in enumerate(groups):
                group = states[lo:hi]
                for s in group:
                    self._finish(s)
                active = [s for s in group if not s.done and s.budget > 0]
                if not active:
                    continue
                # each generate call its own index: no two calls share sampling noise
                self._decode(active, turn * len(groups) + g, generate)
                for s in active:
                    if s.budget <= 0:
                        s.done = True           # out of tokens: truncated, no step
                        continue
                    # (after the last turn too: its reward counts)
                    text = self.decode(s.response[s.answer_start:])
                    s.pending = self._start(partial(_env_step, s, text))
        for s in states:
            self._finish(s, last=True)
        return states

    def _decode(self, active: list[_State], call: int, generate: TurnGenerator) -> None:
        contexts = [s.prompt + s.response for s in active]
        room = self.max_context - max(len(c) for c in contexts)
        n = min(self.turn_tokens, max(s.budget for s in active), room)
        outs = generate(contexts, max(n, 1), call)
        for s, (tokens, logprobs) in zip(active, outs):
            keep = min(len(tokens), s.budget)
            s.answer_start = len(s.response)
            s.add(list(tokens[:keep]), [float(x) for x in logprobs[:keep]])
            s.turns += 1
            s.turn_rewards.append(0.0)

    # ---- environment steps ---------------------------------------------------------
    def _start(self, fn: Callable[[], object]) -> tuple:
        t0 = time.monotonic()
        return start(lambda: _timed(fn)), t0 + self.cfg.tool_timeout_s + 1.0, t0

    def _reset(self, s: _State, ep: Episode) -> Step:
        s.env = self.make_env()
        observation = s.env.reset(ep)
        return _as_step(("" if observation is None else observation, 0.0, False))

    def _finish(self, s: _State, reset: bool = False, last: bool = False) -> None:
        """Wait for the episode's pending step and apply it: its observation joins the
        context (unless the episode ended), its reward the turn's."""
        if s.pending is None:
            return
        fut, deadline, _ = s.pending
        s.pending = None
        t0 = time.monotonic()
        try:
            took, step = wait(fut, deadline, self.cfg.tool_timeout_s + 1.0)
        except Exception as e:          # a ToolFailure (timeout) or Raised: the step's own
            took = self.cfg.tool_timeout_s if isinstance(e, ToolFailure) else 0.0
            step = Step(reward=-self.cfg.error_penalty, done=True)
            self.count.env_errors += 1
            kind = e.kind if isinstance(e, ToolFailure) else "raised"
            self.count.kinds[f"env_error.{kind}"] = self.count.kinds.get(
                f"env_error.{kind}", 0.0) + 1
        self.count.env_wait_s += time.monotonic() - t0
        self.count.env_s += took
        if not reset:
            self.count.steps += 1
            s.turn_rewards[-1] += step.reward
        for k, v in step.info.items():
            if k == "tool_calls":
                self.count.tool_calls += v
                s.tool_calls += v
            elif k == "tool_errors":
                self.count.tool_errors += v
            else:
                self.count.kinds[k] = self.count.kinds.get(k, 0.0) + v
        if step.done:
            s.done = True
        if s.done or last or not step.observation:
            return
        ids, cut = cut_observation(step.observation, self.encode,
                                   self.cfg.max_observation_tokens)
        if cut:
            self.count.truncated += 1
        if len(ids) >= s.budget:                # no room left for another turn
            ids = ids[:s.budget]
            s.done = True
        s.add(ids, None)

    # ---- metrics -------------------------------------------------------------------
    def metrics(self, states: list[_State], prefix: str = "rollout.") -> dict[str, float]:
        """Turns per episode, tool calls (and the share of episodes with one), errors,
        environment time, the share of response tokens masked (observations), per-turn
        rewards (mean over the episodes that had the turn)."""
        c, n = self.count, max(len(states), 1)
        response = sum(len(s.response) for s in states)
        masked = sum(len(s.response) - sum(s.is_model) for s in states)
        called = sum(1 for s in states if s.tool_calls > 0)
        out = {"turns": sum(s.turns for s in states) / n, "tool_calls": c.tool_calls,
               "tool_call_rate": called / n, "tool_errors": c.tool_errors,
               "env_errors": c.env_errors, "truncated_observations": c.truncated,
               "env_s": c.env_s, "env_wait_s": c.env_wait_s,
               "env_s_per_call": c.env_s / max(c.steps, 1),
               "masked_share": masked / max(response, 1),
               "env_reward": sum(sum(s.turn_rewards) for s in states) / n, **c.kinds}
        for k in range(max((s.turns for s in states), default=0)):
            had = [s.turn_rewards[k] for s in states if s.turns > k]
            out[f"turn{k + 1}_reward"] = sum(had) / len(had)
        return {prefix + k: float(v) for k, v in out.items()}


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.monotonic()
    value = fn()
    return time.monotonic() - t0, value


def _env_step(s: _State, text: str) -> Step:
    """``s``'s environment's answer to ``text``, as a :class:`Step`."""
    assert s.env is not None, "an episode's environment is made when it starts"
    return _as_step(s.env.step(text))


def _as_step(value) -> Step:
    """An environment's return as a :class:`Step` (a Step, or an (observation, reward,
    done) tuple) of plain values: a ``str`` observation, float reward and info counts,
    a bool; anything else raises (the episode ends as an environment error). Called in
    the step's own thread, like everything else that may run user code (a subclass's
    ``__float__``, ``__bool__``, ``__str__``)."""
    if isinstance(value, tuple) and len(value) == 3:
        value = Step(*value)
    if not isinstance(value, Step):
        raise TypeError(f"step() returned a {type(value).__name__}, not (observation, "
                        "reward, done)")
    if not isinstance(value.observation, str):
        raise TypeError(f"the observation is a {type(value.observation).__name__}, not text")
    reward = float(value.reward)
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise ValueError(f"the reward {value.reward!r} is not finite")
    info = {str(k): float(v) for k, v in dict(value.info).items()}
    return Step(str.__str__(value.observation), reward, bool(value.done), info)


def episode_records(states: list[_State], pad_id: int) -> tuple[dict, dict]:
    """(``seqs`` record, ``logprobs`` record) of finished episodes (see the module doc)."""
    prompt_tokens, plen = pad_right([s.prompt for s in states], pad_id)
    b = len(states)
    lengths = plen + torch.tensor([len(s.response) for s in states], dtype=torch.long)
    width = int(lengths.max())
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    tokens[:, :prompt_tokens.shape[1]] = prompt_tokens
    action = torch.zeros(b, width - 1, dtype=torch.float32)
    logprobs = torch.zeros(b, width - 1, dtype=torch.float32)
    for i, s in enumerate(states):
        p, r = int(plen[i]), len(s.response)
        if r:
            tokens[i, p:p + r] = torch.tensor(s.response, dtype=torch.long)
            action[i, p - 1:p - 1 + r] = torch.tensor(s.is_model, dtype=torch.float32)
            logprobs[i, p - 1:p - 1 + r] = torch.tensor(s.logprobs, dtype=torch.float32)
    seqs = {"tokens": tokens, "lengths": lengths, "prompt_lengths": plen,
            "action_mask": action,
            "answer_start": plen + torch.tensor([s.answer_start for s in states]),
            "turns": torch.tensor([s.turns for s in states], dtype=torch.long),
            "env_reward": torch.tensor([sum(s.turn_rewards) for s in states],
                                       dtype=torch.float32)}
    return seqs, {"logprobs": logprobs}
