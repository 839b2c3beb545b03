"""pyproject.toml's acyclic contract: a loop between two modules of a package breaks
``lint-imports`` even when one side hides its import inside a function; an import under
``if TYPE_CHECKING:`` (an annotation) does not count."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def acyclic_contract() -> dict:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    found = [c for c in config["contracts"] if c["type"] == "acyclic_siblings"]
    assert len(found) == 1
    return found[0]


def lint_planted(tmp_path: Path, b_source: str) -> subprocess.CompletedProcess[str]:
    """lint-imports on a package ``pkg`` whose ``a`` imports ``b`` at the top, under the
    repository's import-linter settings and its acyclic contract (on ``pkg``)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import helper\n\n\ndef price():\n"
                              "    return helper()\n")
    (pkg / "b.py").write_text(b_source)
    repo_config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (tmp_path / "pyproject.toml").write_text(
        "[tool.importlinter]\nroot_packages = [\"pkg\"]\n"
        f"exclude_type_checking_imports = "
        f"{str(repo_config['exclude_type_checking_imports']).lower()}\n\n"
        "[[tool.importlinter.contracts]]\nname = \"acyclic\"\n"
        f"type = \"{acyclic_contract()['type']}\"\nancestors = [\"pkg\"]\n")
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


def test_the_contract_covers_both_packages_at_every_depth():
    c = acyclic_contract()
    assert set(c["ancestors"]) == {"planner", "realign"}
    assert "depth" not in c              # import-linter's default: 10 levels down
    assert "ignore_imports" not in c     # no loop is excused


def test_an_in_function_import_closing_a_loop_breaks_the_contract(tmp_path):
    r = lint_planted(tmp_path, "def helper():\n    from pkg.a import price\n\n"
                               "    return price\n")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "No cycles are allowed in pkg" in r.stdout
    assert ".b -> .a" in r.stdout


def test_an_annotation_import_closing_a_loop_is_allowed(tmp_path):
    r = lint_planted(tmp_path, "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                               "    from pkg.a import price\n\n\ndef helper():\n"
                               "    return None\n")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 kept, 0 broken" in r.stdout
