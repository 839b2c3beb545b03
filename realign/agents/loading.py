"""Environments and tools by name, checked before any worker starts: a missing module,
an import error, a class without ``reset(episode)`` / ``step(turn)``, a constructor
that rejects ``rollout.env_args`` or raises (``SystemExit`` included), a module that
calls ``sys.exit`` while importing, a tool without a usable schema or two tools of one
name are each a :class:`~realign.errors.UserError` (exit 2) naming the field."""
from __future__ import annotations

import inspect
from typing import Callable

from realign.agents.config import MultiTurn
from realign.agents.interface import Environment, Episode, Tool
from realign.agents.observation import observation_chars
from realign.agents.tools import Raised, as_tool, start
from realign.errors import UserError
from realign.usercode import import_object


def load_env_class(spec: str, env_args: dict, field: str = "rollout.env") -> type:
    """The environment class named ``spec``, its methods' signatures checked and one
    instance made with ``env_args`` (so a constructor that raises fails here), in a
    thread as the run makes them."""
    cls = import_object(spec, field)
    if not inspect.isclass(cls):
        raise UserError(f"{spec} is a {type(cls).__name__}; an environment is a class with "
                        "reset(episode) and step(turn) methods", field=field)
    for name, arg in (("reset", Episode("", None, 0)), ("step", "")):
        method = getattr(cls, name, None)
        if not callable(method):
            raise UserError(f"{spec} has no {name}() method; an environment has "
                            "reset(episode) -> str and step(turn) -> (observation, reward, "
                            "done)", field=field)
        try:
            inspect.signature(method).bind(None, arg)
        except TypeError:
            raise UserError(f"{spec}.{name} must take one argument after self "
                            f"({'episode' if name == 'reset' else 'turn'}); its signature "
                            f"is {inspect.signature(method)}", field=field) from None
    try:
        inspect.signature(cls).bind(**env_args)
    except TypeError as e:
        raise UserError(f"{spec}{inspect.signature(cls)} does not take rollout.env_args "
                        f"{sorted(env_args)}: {e}", field="rollout.env_args") from None
    try:
        start(lambda: cls(**env_args)).result()
    except Raised as e:
        raise UserError(f"{spec}(**rollout.env_args) raised {e}", field=field) from None
    return cls


def load_tools(specs: list[str]) -> dict[str, Tool]:
    """Tool name -> tool, from ``rollout.tools``."""
    out: dict[str, Tool] = {}
    for i, spec in enumerate(specs):
        field = f"rollout.tools[{i}]"
        try:
            tool = as_tool(import_object(spec, field), spec)
        except ValueError as e:
            raise UserError(str(e), field=field) from None
        if tool.name in out:
            raise UserError(f"two tools are named {tool.name!r}; tool names are unique",
                            field=field)
        out[tool.name] = tool
    return out


def env_factory(cfg: MultiTurn) -> Callable[[], Environment]:
    """What makes one episode's environment: the user's class, or the built-in tool
    environment over ``rollout.tools``."""
    from realign.agents.tool_env import ToolEnvironment

    if cfg.env is not None and cfg.tools:
        raise UserError("give rollout.env or rollout.tools, not both (an environment "
                        "that wants tools calls them itself)", field="rollout.tools")
    if cfg.env is not None:
        cls = load_env_class(cfg.env, cfg.env_args)
        args = dict(cfg.env_args)
        return lambda: cls(**args)
    if cfg.env_args:
        raise UserError("rollout.env_args are for rollout.env", field="rollout.env_args")
    tools = load_tools(cfg.tools)
    chars = observation_chars(cfg.max_observation_tokens)
    return lambda: ToolEnvironment(tools, cfg.tool_timeout_s, cfg.error_penalty, chars)
