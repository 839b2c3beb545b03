"""``realign/config/`` is the experiment schema and nothing else: pydantic models and
their validators. Every class it defines is a pydantic model; every module-level function
is a validator (called from a model's ``field_validator`` / ``model_validator``, or
wrapped in ``AfterValidator`` and its kin); nothing else runs at module level; and it
imports nothing from ``realign.run`` or ``planner.search`` (the planning front end, the
loader, host timing and lengths live in ``realign/run/``, the docs generator in
``realign/cli/``). The checks read the source (AST); each is shown to catch what it
forbids."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from pydantic import BaseModel

import realign.config

pytestmark = pytest.mark.pure

CONFIG = Path(realign.config.__file__).parent
FORBIDDEN = ("realign.run", "planner.search")
VALIDATOR_DECORATORS = {"field_validator", "model_validator"}
VALIDATOR_WRAPPERS = {"AfterValidator", "BeforeValidator", "PlainValidator", "WrapValidator"}


def _name(node: ast.AST) -> str:
    """``f`` of ``f(...)`` / ``m.f(...)`` / ``@f(...)``; '' for anything else."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def validator_uses(trees: list[ast.Module]) -> set[str]:
    """The names the schema's validators call or wrap: calls inside methods decorated
    with a pydantic validator decorator, and the arguments of ``AfterValidator(...)``."""
    used: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                    _name(d) in VALIDATOR_DECORATORS for d in node.decorator_list):
                used |= {_name(c) for c in ast.walk(node) if isinstance(c, ast.Call)}
            if isinstance(node, ast.Call) and _name(node) in VALIDATOR_WRAPPERS:
                used |= {_name(a) for a in node.args}
    return used - {""}


def _imports(tree: ast.Module) -> list[str]:
    out = []
    for node in ast.walk(tree):                # in functions and TYPE_CHECKING too
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
    return out


def problems(sources: dict[str, str]) -> list[str]:
    """What in ``sources`` (module name -> its text) is not schema: a module-level
    function no validator uses, a statement that does work at import, an import of a
    forbidden package."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    used = validator_uses(list(trees.values()))
    out = []
    for name, tree in trees.items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name not in used:
                    out.append(f"{name}.{node.name}: a module-level function that no "
                               "validator uses")
            elif isinstance(node, ast.If):
                if ast.unparse(node.test) != "TYPE_CHECKING":
                    out.append(f"{name} line {node.lineno}: code at module level")
            elif not isinstance(node, (ast.Import, ast.ImportFrom, ast.ClassDef, ast.Assign,
                                       ast.AnnAssign, ast.Expr)):
                out.append(f"{name} line {node.lineno}: code at module level")
            elif isinstance(node, ast.Expr) and not isinstance(node.value, ast.Constant):
                out.append(f"{name} line {node.lineno}: code at module level")
        for mod in _imports(tree):
            if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN):
                out.append(f"{name} imports {mod}")
    return out


def config_sources() -> dict[str, str]:
    return {f"realign.config.{p.stem}": p.read_text() for p in sorted(CONFIG.glob("*.py"))}


def test_realign_config_holds_only_the_schema_and_its_validators():
    assert problems(config_sources()) == []


def test_every_class_realign_config_defines_is_a_pydantic_model():
    for name in config_sources():
        mod = importlib.import_module(name)
        own = [v for v in vars(mod).values()
               if isinstance(v, type) and v.__module__ == name]
        assert all(issubclass(c, BaseModel) for c in own), (name, own)


def test_realign_config_has_the_schema_modules():
    """What it holds, by name: moved modules do not creep back."""
    assert sorted(config_sources()) == ["realign.config.__init__",
                                        "realign.config.experiment",
                                        "realign.config.streaming"]


def test_the_check_finds_what_is_not_schema():
    """Each rule catches its case (the checks would pass vacuously otherwise)."""
    bad = {"realign.config.x": (
        "from pydantic import BaseModel, model_validator\n"
        "from realign.run.planning import plan_experiment\n"
        "def helper(cfg):\n    return 1\n"
        "def check(cfg):\n    return 2\n"
        "print('side effect')\n"
        "class M(BaseModel):\n"
        "    @model_validator(mode='after')\n"
        "    def _ok(self):\n        check(self)\n        return self\n"
        "    def f(self):\n        from planner.search.search import search\n")}
    assert problems(bad) == ["realign.config.x.helper: a module-level function that no "
                             "validator uses",
                             "realign.config.x line 7: code at module level",
                             "realign.config.x imports realign.run.planning",
                             "realign.config.x imports planner.search.search"]
