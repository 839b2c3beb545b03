"""The built-in environment of ``rollout.tools``: it runs the tool calls of a turn and
answers each with ``<tool_response>...</tool_response>``; a turn that calls nothing is
the final answer and ends the episode (its reward then comes from ``reward.fn``)."""
from __future__ import annotations

import time

from realign.agents.interface import Environment, Episode, Step, Tool
from realign.agents.tool_calls import Malformed, format_response, parse_tool_calls
from realign.agents.tools import ToolFailure, finish_tool, start_tool


class ToolEnvironment(Environment):
    """Each failed call (malformed, an unknown tool, bad arguments, a tool that raised,
    timed out or returned no text) answers ``error: ...`` in its response tags, costs
    ``error_penalty`` of the turn's reward, and counts in ``tool_errors`` and in
    ``tool_error.<kind>``. A call's answer is read up to ``max_result_chars``
    characters (unset: whole); the run sets it to what an observation can show
    (:func:`~realign.agents.observation.observation_chars`), so the rest would never
    be seen anyway."""

    def __init__(self, tools: dict[str, Tool], timeout_s: float, error_penalty: float = 0.0,
                 max_result_chars: int | None = None):
        self.tools, self.timeout_s, self.error_penalty = tools, timeout_s, error_penalty
        self.max_result_chars = max_result_chars

    def reset(self, episode: Episode) -> str:
        return ""

    def step(self, turn: str) -> Step:
        """The turn's calls run concurrently, each within the timeout."""
        calls = parse_tool_calls(turn)
        if not calls:
            return Step(done=True)
        deadline = time.monotonic() + self.timeout_s
        started: list = []
        for call in calls:
            try:
                if isinstance(call, Malformed):
                    raise ToolFailure("malformed", f"malformed tool call: {call.why}")
                tool = self.tools.get(call.name)
                if tool is None:
                    raise ToolFailure("unknown_tool", f"no tool named {call.name!r} (tools: "
                                      f"{', '.join(sorted(self.tools))})")
                started.append((tool, start_tool(tool, call.arguments, self.max_result_chars)))
            except ToolFailure as e:
                started.append(e)
        parts, info = [], {"tool_calls": float(len(calls)), "tool_errors": 0.0}
        for item in started:
            try:
                if isinstance(item, ToolFailure):
                    raise item
                tool, fut = item
                parts.append(format_response(finish_tool(tool, fut, deadline,
                                                         self.timeout_s)))
            except ToolFailure as e:
                parts.append(format_response(f"error: {e}"))
                info["tool_errors"] += 1
                info[f"tool_error.{e.kind}"] = info.get(f"tool_error.{e.kind}", 0.0) + 1
        return Step(observation="".join(parts), reward=-self.error_penalty * info["tool_errors"],
                    info=info)
