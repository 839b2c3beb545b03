"""The tool-call format: Hermes' and Qwen3's ``<tool_call>`` JSON.

A model's turn calls a tool by writing, anywhere in it::

    <tool_call>{"name": "add", "arguments": {"a": 12345, "b": 678}}</tool_call>

(whitespace around the JSON is allowed; several calls in one turn run in order). The
tool's answer comes back as the observation ``<tool_response>TEXT</tool_response>``
(Qwen3's chat template puts the same tags inside a ``tool`` turn; the tiny task uses
them bare). A turn whose ``<tool_call>`` block is not JSON of that shape is a
*malformed call*: :func:`parse_tool_calls` reports it, and the environment shows the
model an error observation instead of running anything.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)",
                    re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Malformed:
    """A ``<tool_call>`` block that is not a call: ``why`` says what is wrong."""

    text: str
    why: str


def parse_tool_calls(turn: str) -> list[ToolCall | Malformed]:
    """Every ``<tool_call>`` block of ``turn``, in order, as a call or as
    :class:`Malformed`. An unclosed block (the turn ran out of tokens) is malformed.

    >>> parse_tool_calls('x <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    [ToolCall(name='add', arguments={'a': 1})]
    >>> parse_tool_calls('<tool_call>{"name": 3}</tool_call>')[0].why
    "'name' must be a non-empty string, got 3"
    """
    out: list[ToolCall | Malformed] = []
    for m in _BLOCK.finditer(turn):
        body = m.group(1)
        if not m.group(0).endswith(CALL_CLOSE):
            out.append(Malformed(body, f"no closing {CALL_CLOSE}"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            out.append(Malformed(body, f"not JSON ({e.msg} at character {e.pos})"))
            continue
        out.append(_call(obj, body))
    return out


def _call(obj: Any, body: str) -> ToolCall | Malformed:
    if not isinstance(obj, dict):
        return Malformed(body, f"expected a JSON object, got {type(obj).__name__}")
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return Malformed(body, f"'name' must be a non-empty string, got {name!r}")
    if isinstance(args, str):            # some models write the arguments as a string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return Malformed(body, "'arguments' is a string that is not JSON")
    if not isinstance(args, dict):
        return Malformed(body, f"'arguments' must be an object, got {type(args).__name__}")
    return ToolCall(name, args)


def format_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of a call, as a model should write it (for SFT data and prompts)."""
    return CALL_OPEN + json.dumps({"name": name, "arguments": arguments},
                                  separators=(",", ":")) + CALL_CLOSE


def format_response(text: str) -> str:
    return RESPONSE_OPEN + text + RESPONSE_CLOSE
