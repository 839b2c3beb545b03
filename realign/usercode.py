"""User code named in the YAML: reward functions (``reward.fn``, ``eval.verifier``),
environments (``rollout.env``) and tools (``rollout.tools``) are all written
``"package.module:attr"`` (imported from ``sys.path``: the current folder or
``PYTHONPATH``) or ``"path/to/file.py:attr"`` (a file: the experiment loader has made
its path absolute, :data:`realign.paths.CodeRef`; a relative one is opened from the
current folder); ``attr`` may be dotted (``"mod:Scorer.score"``).

Whatever goes wrong while loading is a :class:`~realign.errors.UserError` naming the
field (exit 2 before any worker starts): a malformed name, a missing module, file or
attribute, and a module that raises while importing, ``SystemExit`` included (an
argparse or ``sys.exit`` at its top level). A ``KeyboardInterrupt`` propagates: the
import runs in the main thread, where it may be the user's Ctrl-C. Code that runs
later (a constructor, a call) is its caller's to contain (:mod:`realign.agents.tools`
runs it in a thread of its own).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from realign.errors import UserError


def import_object(spec: str, field: str) -> Any:
    """The object named ``"module:attr"`` or ``"path/to/file.py:attr"`` (``attr`` may be
    dotted). :class:`UserError` at ``field`` for a malformed name, a module or file that
    is missing or raises while importing (``SystemExit`` included), or a missing
    attribute; the message lists the callables the module does have."""
    module_name, sep, attr = spec.strip().partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise UserError(f"malformed name {spec!r}: expected 'module:attr' or "
                        f"'file.py:attr' with one ':' and both parts non-empty", field=field)
    try:
        module = (_import_file(module_name, field) if module_name.endswith(".py")
                  else _import_module(module_name, field))
    except BaseException as e:
        if isinstance(e, (Exception, KeyboardInterrupt)):   # a UserError already; Ctrl-C
            raise
        raise _left_while_importing(spec.strip(), e, field) from None
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = module_name if i == 0 else f"{module_name}:{'.'.join(attr.split('.')[:i])}"
            names = sorted(n for n in dir(obj) if not n.startswith("_")
                           and callable(getattr(obj, n, None)))
            raise UserError(f"{owner} has no attribute {part!r} (callables there: "
                            f"{', '.join(names[:20]) or 'none'})", field=field)
        obj = getattr(obj, part)
    return obj


def _import_module(name: str, field: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise UserError(f"no module named {name!r} (put its folder on PYTHONPATH, or "
                            f"name a file: 'path/to/file.py:attr')", field=field) from None
        raise UserError(f"importing {name!r} failed: {e}", field=field) from e
    except Exception as e:  # the user's module raised while importing
        raise UserError(f"importing {name!r} raised {type(e).__name__}: {e}", field=field) from e


def _import_file(path: str, field: str) -> ModuleType:
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"no such file {str(p)!r}", field=field)
    name = "realign_usercode_" + hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, p)
    assert spec is not None and spec.loader is not None   # a .py file that exists
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file raised while importing
        raise UserError(f"importing {str(p)!r} raised {type(e).__name__}: {e}",
                        field=field) from e
    sys.modules[name] = module
    return module


def _left_while_importing(spec: str, e: BaseException, field: str) -> UserError:
    """The :class:`UserError` of a module that left its import by a ``BaseException``
    that is no ``Exception`` (``sys.exit``, argparse, ``GeneratorExit``)."""
    if isinstance(e, SystemExit):
        return UserError(f"importing {spec} called sys.exit({e.code!r}); a module named "
                         "here must import without exiting (parse arguments under "
                         "if __name__ == '__main__')", field=field)
    return UserError(f"importing {spec} raised {type(e).__name__}: {e}", field=field)
