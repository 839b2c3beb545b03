"""Reward functions by name: the built-ins, or a user's ``"module:function"``.

A reward function is called once per response as ``fn(prompt, response, answer)``
and returns a float; ``prompt`` and ``response`` are decoded text, ``answer`` is the
dataset's reference answer (None for prompt-only datasets).

A user's function is named ``"package.module:function"`` (imported from
``sys.path``, so the current folder or ``PYTHONPATH``), or
``"path/to/file.py:function"`` (a file; the experiment loader makes its path absolute). The
attribute may be dotted (``"mod:Scorer.score"``). It is loaded as all user code is
(:mod:`realign.usercode`): a module that raises or calls ``sys.exit`` while importing
is a :class:`UserError` at the field.
"""
from __future__ import annotations

import inspect
from typing import Callable

from realign.errors import UserError
from realign.rewards.math import math_verify, math_verify_format
from realign.usercode import import_object

RewardFn = Callable[[str, str, "str | None"], float]


def _table(*entries: tuple[str, RewardFn]) -> dict[str, RewardFn]:
    out: dict[str, RewardFn] = {}
    for name, fn in entries:
        if name in out:
            raise ValueError(f"duplicate built-in reward {name!r}")
        out[name] = fn
    return out


#: Built-in reward functions by name.
BUILTINS: dict[str, RewardFn] = _table(
    ("math_verify", math_verify),
    ("math_verify_format", math_verify_format),
)


def load_reward_fn(spec: str, field: str = "reward.fn") -> RewardFn:
    """The reward function named by ``spec``: a built-in name or ``"module:function"``.

    Raises :class:`UserError` (at ``field``) for a malformed spec, a module that is
    missing or fails to import (or exits while importing), a missing attribute, or an
    object that is not callable with ``(prompt, response, answer)``."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"expected a built-in name or 'module:function', got {spec!r}",
                        field=field)
    spec = spec.strip()
    if spec in BUILTINS:
        return BUILTINS[spec]
    if ":" not in spec:
        raise UserError(f"unknown reward {spec!r}: give a built-in "
                        f"({', '.join(sorted(BUILTINS))}) or 'module:function'", field=field)
    obj = import_object(spec, field)
    if not callable(obj):
        raise UserError(f"{spec} is a {type(obj).__name__}, not a function", field=field)
    try:
        inspect.signature(obj).bind("prompt", "response", "answer")
    except TypeError:
        raise UserError(f"{spec} must accept (prompt, response, answer); its signature is "
                        f"{inspect.signature(obj)}", field=field) from None
    except ValueError:
        pass   # no signature available (some C callables): checked when called
    return obj
