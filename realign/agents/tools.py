"""Tools: a plain function as a :class:`~realign.agents.interface.Tool`, and running
one call safely (arguments checked against the tool's JSON schema, a timeout, the
result turned into text, at most a given number of characters of it). Every failure
is a :class:`ToolFailure` whose message the model is shown; nothing a tool does stops
the run: it runs in a thread of its own (:func:`start`), which contains whatever it
raises, ``SystemExit`` and ``KeyboardInterrupt`` included."""
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


class Raised(Exception):
    """What user code (a tool, an environment's constructor, ``reset`` or ``step``)
    raised in its thread, whatever it was (``SystemExit`` from ``sys.exit`` or argparse,
    ``KeyboardInterrupt``, ``GeneratorExit`` included), as an ordinary exception. Its
    text is taken in that thread (``str()`` of a user's exception is user code too);
    the exception itself is not kept (nor the frames its traceback holds)."""

    def __init__(self, error: BaseException):
        self.type_name = type(error).__name__
        try:
            self.text = str(error)
        except BaseException:  # user code's, in its own thread
            self.text = "(its str() raised too)"
        super().__init__(f"{self.type_name}: {self.text}" if self.text else self.type_name)


def start(fn: Callable[[], Any]) -> Future:
    """``fn()`` started in a daemon thread; its result in the future, or whatever it
    raised as a :class:`Raised`.

    Why every ``BaseException``: the thread runs nothing but user code, and there a
    ``SystemExit`` or ``KeyboardInterrupt`` is something the code raised itself (a real
    SIGINT is delivered to the main thread, never to this one; the interpreter's own
    exit does not raise in daemon threads), so it is that call's failure, not a request
    to stop the process. ``GeneratorExit`` too: ``run`` is no generator that could be
    closed. The waiting thread then catches ``Exception`` only, so what it sees of its
    own (a real SIGINT's ``KeyboardInterrupt``, a ``SystemExit`` of the process's
    shutdown) still propagates.

    Why not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined when the
    interpreter exits, so one tool that hangs for ever would hang the worker's exit.
    Python cannot stop a thread: a call abandoned past its timeout runs on until it
    returns, in a daemon thread that never holds the worker's exit."""
    fut: Future = Future()

    def run() -> None:
        try:
            value = fn()
        except BaseException as e:  # user code's: see above
            fut.set_exception(Raised(e))
            return
        fut.set_result(value)

    threading.Thread(target=run, daemon=True, name="realign-env").start()
    return fut


def wait(fut: Future, deadline: float, timeout_s: float) -> Any:
    """The future's result, waiting until ``deadline`` (``time.monotonic()``); past it
    a :class:`ToolFailure` (timeout). What the call raised comes as :class:`Raised`."""
    try:
        return fut.result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        raise ToolFailure("timeout", f"timed out after {timeout_s:g} s") from None


def result_text(value: Any, name: str, max_chars: int | None = None) -> str:
    """A tool's return value as text: a string as it is, anything JSON can write as
    JSON, either cut to its first ``max_chars`` characters (the JSON is not written
    past them); anything else is a :class:`ToolFailure` (bad_result).

    >>> result_text("abcdef", "t", 3), result_text(list(range(10**7)), "t", 8)
    ('abc', '[0, 1, 2')
    """
    if isinstance(value, str):
        return str.__str__(value)[:max_chars]          # a plain str, even of a subclass
    chunks: list[str] = []
    size = 0
    try:
        for chunk in json.JSONEncoder().iterencode(value):
            chunks.append(chunk)
            size += len(chunk)
            if max_chars is not None and size >= max_chars:
                break
    except (TypeError, ValueError):
        raise ToolFailure("bad_result", f"{name} returned a {type(value).__name__}, "
                          "not text") from None
    return "".join(chunks)[:max_chars]


def start_tool(tool: Tool, arguments: dict, max_chars: int | None = None) -> Future:
    """One call of ``tool`` started (arguments checked first: a :class:`ToolFailure`
    here); its text (cut to ``max_chars``), or the :class:`ToolFailure` of a result
    that is no text, is made in the call's own thread; :func:`finish_tool` waits."""
    check_arguments(tool, arguments)

    def call() -> str | ToolFailure:
        value = tool.fn(**arguments)
        try:
            return result_text(value, tool.name, max_chars)
        except ToolFailure as e:
            return e

    return start(call)


def finish_tool(tool: Tool, fut: Future, deadline: float, timeout_s: float) -> str:
    """The started call's text; every failure a :class:`ToolFailure`."""
    try:
        value = wait(fut, deadline, timeout_s)
    except Raised as e:
        raise ToolFailure("raised", f"{tool.name} raised {e}") from None
    if isinstance(value, ToolFailure):
        raise value
    return value
