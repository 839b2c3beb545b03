"""Tools: a plain function as a :class:`~realign.agents.interface.Tool`, and running
one call safely (arguments checked against the tool's JSON schema, a timeout, the
result turned into text). Every failure is a :class:`ToolFailure` whose message the
model is shown; nothing a tool does stops the run."""
from __future__ import annotations

import inspect
import json
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from realign.agents.interface import Tool

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean",
               list: "array", dict: "object"}


class ToolFailure(Exception):
    """A call that gave no usable result; ``kind``: malformed | unknown_tool |
    bad_arguments | raised | timeout | bad_result (a metrics counter each)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def as_tool(obj: Any, where: str) -> Tool:
    """``obj`` as a :class:`Tool`: a Tool as it is, or a function whose name, docstring
    and signature give the tool's name, description and schema (a parameter annotated
    int, float, str, bool, list or dict gets that JSON type; parameters without a
    default are required). Raises ValueError saying why ``obj`` is not a tool."""
    if isinstance(obj, Tool):
        if not isinstance(obj.parameters, dict) or obj.parameters.get("type") != "object":
            raise ValueError(f"{where}: Tool.parameters must be a JSON schema of type "
                             f"'object', got {obj.parameters!r}")
        _check_schema(obj.parameters, where)
        return obj
    if not callable(obj) or inspect.isclass(obj):
        raise ValueError(f"{where} is a {type(obj).__name__}: a tool is a function or a "
                         "realign.agents.Tool")
    try:
        sig = inspect.signature(obj)
    except ValueError:
        raise ValueError(f"{where} has no readable signature; wrap it in a "
                         "realign.agents.Tool with an explicit schema") from None
    props, required = {}, []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ValueError(f"{where}{sig}: a tool's parameters are named (no *args, "
                             "**kwargs or positional-only ones)")
        t = _JSON_TYPES.get(_annotation(obj, p.name))
        props[p.name] = {"type": t} if t else {}
        if p.default is p.empty:
            required.append(p.name)
    schema = {"type": "object", "properties": props, "required": required,
              "additionalProperties": False}
    return Tool(obj.__name__, schema, obj, inspect.getdoc(obj) or "")


def _annotation(fn: Callable, name: str):
    try:
        return inspect.get_annotations(fn, eval_str=True).get(name)
    except Exception:       # an annotation that cannot be evaluated: no type
        return None


def _check_schema(schema: dict, where: str) -> None:
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"{where}: its parameters are not a valid JSON schema: "
                         f"{e.message}") from None


def check_arguments(tool: Tool, arguments: dict) -> None:
    """Raise :class:`ToolFailure` (bad_arguments) when ``arguments`` do not follow the
    tool's schema (jsonschema, draft 2020-12)."""
    import jsonschema

    try:
        jsonschema.validate(arguments, tool.parameters,
                            cls=jsonschema.Draft202012Validator)
    except jsonschema.ValidationError as e:
        raise ToolFailure("bad_arguments", f"bad arguments for {tool.name}: "
                          f"{e.message}") from None


def start(fn: Callable[[], Any]) -> Future:
    """``fn()`` started in a daemon thread; its result (or exception) in the future.

    Why not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined when the
    interpreter exits, so one tool that hangs for ever would hang the worker's exit.
    Python cannot stop a thread: a call abandoned past its timeout runs on until it
    returns, in a daemon thread that never holds the worker's exit."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:      # handed to whoever waits, who decides
            fut.set_exception(e)

    threading.Thread(target=run, daemon=True, name="realign-env").start()
    return fut


def wait(fut: Future, deadline: float, timeout_s: float) -> Any:
    """The future's result, waiting until ``deadline`` (``time.monotonic()``); past it
    a :class:`ToolFailure` (timeout). Exceptions of the call are re-raised here."""
    try:
        return fut.result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        raise ToolFailure("timeout", f"timed out after {timeout_s:g} s") from None


def result_text(value: Any, name: str) -> str:
    """A tool's return value as text: a string as it is, anything JSON can write as
    JSON; anything else is a :class:`ToolFailure` (bad_result)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        raise ToolFailure("bad_result", f"{name} returned a {type(value).__name__}, "
                          "not text") from None


def start_tool(tool: Tool, arguments: dict) -> Future:
    """One call of ``tool`` started (arguments checked first: a
    :class:`ToolFailure` here); :func:`finish_tool` waits for its text."""
    check_arguments(tool, arguments)
    return start(lambda: tool.fn(**arguments))


def finish_tool(tool: Tool, fut: Future, deadline: float, timeout_s: float) -> str:
    """The started call's result as text; every failure a :class:`ToolFailure`."""
    try:
        value = wait(fut, deadline, timeout_s)
    except ToolFailure:
        raise
    except Exception as e:
        raise ToolFailure("raised", f"{tool.name} raised {type(e).__name__}: {e}") from None
    return result_text(value, tool.name)
