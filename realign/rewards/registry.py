"""Reward functions by name: the built-ins, or a user's ``"module:function"``.

A reward function is called once per response as ``fn(prompt, response, answer)``
and returns a float; ``prompt`` and ``response`` are decoded text, ``answer`` is the
dataset's reference answer (None for prompt-only datasets).

A user's function is named ``"package.module:function"`` (imported from
``sys.path``, so the current folder or ``PYTHONPATH``), or
``"path/to/file.py:function"`` (a file, relative to ``base_dir`` when given). The
attribute may be dotted (``"mod:Scorer.score"``).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Callable

from realign.errors import UserError
from realign.rewards.math import math_verify, math_verify_format

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


def load_reward_fn(spec: str, field: str = "reward.fn",
                   base_dir: str | Path | None = None) -> RewardFn:
    """The reward function named by ``spec``: a built-in name or ``"module:function"``.

    Raises :class:`UserError` (at ``field``) for a malformed spec, a module that is
    missing or fails to import, a missing attribute, or an object that is not callable
    with ``(prompt, response, answer)``."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"expected a built-in name or 'module:function', got {spec!r}",
                        field=field)
    spec = spec.strip()
    if spec in BUILTINS:
        return BUILTINS[spec]
    if ":" not in spec:
        raise UserError(f"unknown reward {spec!r}: give a built-in "
                        f"({', '.join(sorted(BUILTINS))}) or 'module:function'", field=field)
    obj = import_object(spec, field, base_dir)
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


def import_object(spec: str, field: str, base_dir: str | Path | None = None):
    """The object named ``"module:attr"`` or ``"path/to/file.py:attr"`` (``attr`` may
    be dotted); :class:`UserError` at ``field`` for a malformed name, a module that is
    missing or raises while importing, or a missing attribute. Rewards, environments
    and tools are all named this way."""
    module_name, sep, attr = spec.strip().partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise UserError(f"malformed name {spec!r}: expected 'module:attr' or "
                        f"'file.py:attr' with one ':' and both parts non-empty", field=field)
    module = (_import_file(module_name, base_dir, field) if module_name.endswith(".py")
              else _import_module(module_name, field))
    obj = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = module_name if i == 0 else f"{module_name}:{'.'.join(attr.split('.')[:i])}"
            names = sorted(n for n in dir(obj) if not n.startswith("_")
                           and callable(getattr(obj, n, None)))
            raise UserError(f"{owner} has no attribute {part!r} (callables there: "
                            f"{', '.join(names[:20]) or 'none'})", field=field)
        obj = getattr(obj, part)
    return obj


def _import_module(name: str, field: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise UserError(f"no module named {name!r} (put its folder on PYTHONPATH, or "
                            f"name a file: 'path/to/file.py:function')", field=field) from None
        raise UserError(f"importing {name!r} failed: {e}", field=field) from e
    except Exception as e:  # the user's module raised while importing
        raise UserError(f"importing {name!r} raised {type(e).__name__}: {e}", field=field) from e


def _import_file(path: str, base_dir: str | Path | None, field: str):
    p = Path(path).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = Path(base_dir) / p
    if not p.is_file():
        raise UserError(f"no such file {str(p)!r}", field=field)
    name = "realign_reward_" + hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, p)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise UserError(f"importing {str(p)!r} raised {type(e).__name__}: {e}",
                        field=field) from e
    sys.modules[name] = module
    return module
