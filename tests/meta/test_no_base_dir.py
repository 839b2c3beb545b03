"""Paths are resolved once, when the experiment YAML is loaded (:mod:`realign.paths`):
nothing in ``realign/`` or ``planner/`` takes the YAML's folder as a parameter
(``base`` or ``base_dir`` of a path type), joins a relative path to it inline, or keeps
it in the prepared run."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[2]
NAMES = {"base", "base_dir"}


def folder_parameters(source: str) -> list[str]:
    """``function(parameter: annotation)`` for every parameter named ``base`` or
    ``base_dir`` that is untyped or typed with a path or a string."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        a = node.args
        for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
            if arg.arg not in NAMES:
                continue
            note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            if not note or "Path" in note or "str" in note:
                out.append(f"{getattr(node, 'name', 'lambda')}({arg.arg}: {note or '?'})")
    return out


def sources() -> list[Path]:
    return sorted(p for top in ("realign", "planner") for p in (REPO / top).rglob("*.py"))


def test_the_check_sees_a_folder_parameter():
    planted = ("from pathlib import Path\n\n\n"
               "def load(cfg, base: Path):\n    return cfg\n\n\n"
               "def read(path, base_dir: str | Path | None = None):\n    return path\n\n\n"
               "def fit(base: list[float]):\n    return base\n")
    assert folder_parameters(planted) == ["load(base: Path)",
                                          "read(base_dir: str | Path | None)"]


def test_no_function_takes_the_yamls_folder():
    found = {str(p.relative_to(REPO)): hits for p in sources()
             if (hits := folder_parameters(p.read_text(encoding="utf-8")))}
    assert found == {}


def test_no_relative_path_is_joined_inline():
    joins = [str(p.relative_to(REPO)) for p in sources()
             if "is_absolute() else" in p.read_text(encoding="utf-8")]
    assert joins == []


def test_a_prepared_run_holds_no_folder_to_resolve_against():
    from realign.run.spec import RunSpec

    assert not NAMES & set(RunSpec.model_fields)
