"""Tool-call parsing, tools from functions, and every failure a tool can have turned
into an observation (the built-in tool environment), exits and interrupts raised by
a tool included; a tool's answer read up to its character bound."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import pytest

from realign.agents.interface import Tool
from realign.agents.tool_calls import Malformed, ToolCall, format_call, parse_tool_calls
from realign.agents.tool_env import ToolEnvironment
from realign.agents.tools import as_tool

pytestmark = pytest.mark.pure


def add(a: int, b: int) -> str:
    """The sum of two integers."""
    return str(a + b)


def test_parses_calls_in_order_and_reports_malformed_ones():
    turn = ('think <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
            '<tool_call> {"name":"add","arguments":"{\\"a\\": 3, \\"b\\": 4}"} </tool_call>'
            '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'
            '<tool_call>not json</tool_call><tool_call>{"name": "add"')
    got = parse_tool_calls(turn)
    assert got[:2] == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 3, "b": 4})]
    assert [type(g) for g in got[2:]] == [Malformed] * 3
    assert "'arguments' must be an object" in got[2].why
    assert got[3].why.startswith("not JSON")
    assert got[4].why == "no closing </tool_call>"
    assert parse_tool_calls("no call here") == []
    assert parse_tool_calls(format_call("add", {"a": 5, "b": 6})) == [ToolCall("add", {"a": 5, "b": 6})]


def test_a_function_becomes_a_tool_with_a_schema_from_its_signature():
    t = as_tool(add, "m:add")
    assert t.name == "add" and t.description == "The sum of two integers."
    assert t.parameters["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    assert t.parameters["required"] == ["a", "b"]
    with pytest.raises(ValueError, match="parameters are named"):
        as_tool(lambda *xs: 0, "m:f")
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        as_tool(Tool("t", {"type": "object", "properties": 3}, add), "m:t")
    with pytest.raises(ValueError, match="is a int"):
        as_tool(3, "m:x")


def _env(timeout_s=0.5, penalty=0.0):
    def boom(x: int) -> str:
        raise ZeroDivisionError("no")

    def hang(x: int) -> str:
        time.sleep(30)
        return "late"

    def obj(x: int):
        return object()

    def data(x: int):
        return {"x": x}

    tools = {t.name: t for t in map(lambda f: as_tool(f, f.__name__),
                                    (add, boom, hang, obj, data))}
    return ToolEnvironment(tools, timeout_s, penalty)


@pytest.mark.parametrize("call, shown, kind", [
    ('{"name": "add", "arguments": {"a": 2, "b": 3}}', "<tool_response>5</tool_response>", None),
    ('{"name": "data", "arguments": {"x": 2}}', '<tool_response>{"x": 2}</tool_response>', None),
    ('{"name": "boom", "arguments": {"x": 1}}', "error: boom raised ZeroDivisionError: no",
     "raised"),
    ('{"name": "hang", "arguments": {"x": 1}}', "error: timed out after 0.5 s", "timeout"),
    ('{"name": "obj", "arguments": {"x": 1}}', "error: obj returned a object, not text",
     "bad_result"),
    ('{"name": "add", "arguments": {"a": "2"}}', "error: bad arguments for add", "bad_arguments"),
    ('{"name": "mul", "arguments": {}}', "error: no tool named 'mul'", "unknown_tool"),
    ('{"name": "add", "arguments": {"a": 2', "error: malformed tool call: not JSON", "malformed"),
])
def test_every_failure_is_an_observation_counted_by_kind(call, shown, kind):
    t0 = time.monotonic()
    step = _env(penalty=0.25).step(f"<tool_call>{call}</tool_call>")
    assert time.monotonic() - t0 < 5          # a hung tool is abandoned at its timeout
    assert shown in step.observation and not step.done
    assert step.info["tool_calls"] == 1
    assert step.info["tool_errors"] == (0 if kind is None else 1)
    assert step.reward == (0.0 if kind is None else -0.25)
    if kind:
        assert step.info[f"tool_error.{kind}"] == 1


def test_a_turn_without_a_call_ends_the_episode_and_calls_run_concurrently():
    env = _env(timeout_s=5)
    assert env.step("579").done
    # five calls that each wait for all five to be running: one after another, the first
    # would wait alone until its barrier gave up and come back as an error
    meet = threading.Barrier(5, timeout=4.0)
    env = ToolEnvironment({"meet": as_tool(_meeting(meet), "m:meet")}, 5.0)
    step = env.step("".join(format_call("meet", {}) for _ in range(5)))
    assert step.observation.count("<tool_response>met</tool_response>") == 5, step.observation
    assert step.info["tool_calls"] == 5 and step.info["tool_errors"] == 0


def _meeting(barrier: threading.Barrier):
    def meet() -> str:
        """Wait until every call of the turn is running."""
        barrier.wait()
        return "met"
    return meet


def _sleepy(s: float) -> str:
    time.sleep(s)
    return "slept"


def _exits(x: int) -> str:
    sys.exit(2)


def _argparse(argv: str) -> str:
    """A tool that parses its arguments like a command line (``--n`` is required)."""
    parser = argparse.ArgumentParser(prog="count")
    parser.add_argument("--n", type=int, required=True)
    return str(parser.parse_args(argv.split()).n)


def _interrupts(x: int) -> str:
    raise KeyboardInterrupt


def _generator_exit(x: int) -> str:
    raise GeneratorExit("closed")


def _unprintable(x: int) -> str:
    class Odd(SystemExit):
        def __str__(self):
            raise KeyboardInterrupt
    raise Odd(3)


@pytest.mark.parametrize("fn, arguments, shown", [
    (_exits, {"x": 1}, "error: _exits raised SystemExit: 2"),
    (_argparse, {"argv": "--m 3"}, "error: _argparse raised SystemExit: 2"),
    (_interrupts, {"x": 1}, "error: _interrupts raised KeyboardInterrupt"),
    (_generator_exit, {"x": 1}, "error: _generator_exit raised GeneratorExit: closed"),
    (_unprintable, {"x": 1}, "error: _unprintable raised Odd: (its str() raised too)"),
])
def test_a_tool_that_exits_or_interrupts_is_an_error_observation(fn, arguments, shown):
    """sys.exit, argparse's exit on a missing argument, KeyboardInterrupt and
    GeneratorExit raised by the tool are that call's failure (the environment's step
    returns), and the next call of the same turn still runs."""
    tools = {t.name: t for t in (as_tool(fn, fn.__name__), as_tool(add, "add"))}
    step = ToolEnvironment(tools, 5.0, 0.5).step(
        format_call(fn.__name__, arguments) + format_call("add", {"a": 1, "b": 2}))
    assert step.observation == (f"<tool_response>{shown}</tool_response>"
                                "<tool_response>3</tool_response>")
    assert step.info["tool_errors"] == 1 and step.info["tool_error.raised"] == 1
    assert step.reward == -0.5 and not step.done
    if fn is _argparse:                      # given its argument, the same tool answers
        step = ToolEnvironment(tools, 5.0).step(format_call("_argparse", {"argv": "--n 7"}))
        assert step.observation == "<tool_response>7</tool_response>"


def test_a_real_sigint_while_waiting_for_a_tool_still_interrupts():
    """The process's own KeyboardInterrupt (a SIGINT delivered to the main thread while
    it waits for a call) is not a tool's failure: it propagates."""
    env = ToolEnvironment({"_sleepy": as_tool(_sleepy, "m:_sleepy")}, 20.0)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            env.step(format_call("_sleepy", {"s": 5.0}))
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)


def test_an_answer_is_read_up_to_its_character_bound():
    """Text cut to the bound; JSON written only up to it (a list of a million numbers
    is not serialised whole); a result that is no text still a bad_result."""
    def long_text(x: int) -> str:
        return "y" * 10_000_000

    def long_list(x: int):
        return list(range(1_000_000))

    def bad_late(x: int):
        return [1, 2, object()]

    tools = {t.name: t for t in map(lambda f: as_tool(f, f.__name__),
                                    (long_text, long_list, bad_late))}
    env = ToolEnvironment(tools, 5.0, max_result_chars=100)
    step = env.step(format_call("long_text", {"x": 1}))
    assert step.observation == "<tool_response>" + "y" * 100 + "</tool_response>"
    step = env.step(format_call("long_list", {"x": 1}))
    assert step.observation == ("<tool_response>" + json.dumps(list(range(100)))[:100]
                                + "</tool_response>")
    step = env.step(format_call("bad_late", {"x": 1}))
    assert step.info["tool_error.bad_result"] == 1
    assert ToolEnvironment(tools, 5.0).step(format_call("long_list", {"x": 1})).observation \
        == "<tool_response>" + json.dumps(list(range(1_000_000))) + "</tool_response>"
