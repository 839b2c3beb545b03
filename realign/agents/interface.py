"""What a user writes for a multi-turn rollout: an environment or tools.

An **environment** is a class whose instances hold one episode::

    class Guess(Environment):
        def reset(self, episode):            # -> first observation text ("" for none)
            self.target = int(episode.answer)
            return ""
        def step(self, turn):                 # the model's turn, as text
            ok = turn.strip() == str(self.target)
            return Step(observation="" if ok else "\\nno, again: ", reward=float(ok),
                        done=ok)

``step`` may also return a plain ``(observation, reward, done)`` tuple. One instance
is made per episode (``Class(**rollout.env_args)``), ``reset`` is called once before
the first turn, ``step`` after every model turn until it says ``done`` or the episode
runs out of turns or tokens.

A **tool** is a name, a JSON schema of its arguments and a Python callable returning
text (:class:`Tool`; a plain function becomes one, its schema read from its
signature: :func:`realign.agents.tools.as_tool`). Tools named in ``rollout.tools``
run inside the built-in :class:`~realign.agents.tool_env.ToolEnvironment`, which
parses the model's ``<tool_call>{json}</tool_call>`` (:mod:`realign.agents.tool_calls`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Episode:
    """What an environment is told at ``reset``: the dataset's prompt (text and token
    ids), its reference answer (None for a prompt-only dataset) and the episode's index
    in the step's batch (prompt-major: a prompt's samples are consecutive)."""

    prompt: str
    answer: Any
    index: int
    prompt_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Step:
    """What ``Environment.step`` returns: the observation appended to the context (its
    tokens are never trained on), this turn's reward, and whether the episode ended.
    ``info`` counts go to the metrics (``tool_calls``, ``tool_errors``...)."""

    observation: str = ""
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)


class Environment(ABC):
    """Base class of an environment (subclassing it is optional: any class with these
    two methods will do; a subclass must define ``step``)."""

    def reset(self, episode: Episode) -> str:
        """The first observation, appended after the prompt before the first turn
        ("" for none)."""
        return ""

    @abstractmethod
    def step(self, turn: str) -> Step | tuple[str, float, bool]:
        """React to the model's turn (its decoded text, special tokens such as the end
        token left out)."""


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: its ``name`` (what the call names), a JSON schema of
    its arguments (an ``object`` schema) and the callable (keyword arguments from the
    call's ``arguments``; returns text, or a JSON-serialisable value that is shown as
    JSON)."""

    name: str
    parameters: dict
    fn: Callable[..., Any]
    description: str = ""
