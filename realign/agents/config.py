"""The multi-turn keys of the experiment's ``rollout`` section (docs/tools.md)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from realign.paths import CodeRef


class MultiTurn(BaseModel):
    """Environments and tools: with ``env`` or ``tools`` set, every generate call of the
    run (rollout and evaluations) is a multi-turn episode per sequence."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    env: CodeRef | None = Field(
        None, description="An environment class, 'module:Class' or 'file.py:Class' (relative "
        "to the YAML's folder): one instance per episode, reset(episode) -> first observation, "
        "step(turn text) -> (observation, reward, done). Not with tools.")
    env_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the environment class.")
    tools: list[CodeRef] = Field(
        default_factory=list, description="Tools, each 'module:function' or 'file.py:function' "
        "(or a realign.agents.Tool): the built-in tool environment runs the model's "
        "<tool_call>{\"name\", \"arguments\"}</tool_call> and answers "
        "<tool_response>...</tool_response>; a turn without a call ends the episode.")
    max_turns: int = Field(4, ge=1, le=64, description="The most model turns per episode.")
    turn_tokens: int | None = Field(
        None, gt=0, description="The most tokens of one model turn (unset: the whole budget, "
        "algorithm.gen_len). A turn also ends at the end token or at a '</tool_call>' token.")
    max_observation_tokens: int = Field(
        64, gt=0, description="An observation longer than this many tokens is cut to it "
        "(counted in rollout.truncated_observations); only its first this * 256 + 256 "
        "characters are read (of a tool's answer) and tokenized.")
    tool_timeout_s: float = Field(
        10.0, gt=0, description="Per call: a tool (or an environment's step) that takes "
        "longer is abandoned; the model sees 'error: timed out'.")
    env_groups: int = Field(
        2, ge=1, le=64, description="The batch's episodes decode in this many groups, in "
        "turn: while one group's tools run, the next group decodes.")
    error_penalty: float = Field(
        0.0, ge=0, description="Subtracted from the turn's reward for each failed tool call "
        "(malformed, unknown tool, bad arguments, raised, timed out, bad result) and for an "
        "environment that fails (which also ends its episode).")
    plan_turns: float | None = Field(
        None, gt=0, description="The planner's turns per episode (unset: max_turns); "
        "the run's rollout.turns metric measures it.")
    plan_observation_tokens: int | None = Field(
        None, ge=0, description="The planner's tokens per observation (unset: "
        "max_observation_tokens).")
    plan_env_s: float = Field(
        0.0, ge=0, description="The planner's environment seconds per turn and episode group "
        "(a tool call's wall time); the run's rollout.env_s_per_call metric measures it.")

    @property
    def multi_turn(self) -> bool:
        return self.env is not None or bool(self.tools)
