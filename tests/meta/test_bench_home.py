"""Benchmark code has one home, the ``realign.bench`` package (linted, under the
import-linter contracts); ``benchmarks/<study>/`` holds what a study produces and
explains: records, READMEs and shell wrappers that run ``python -m realign.bench...``.
A Python file under ``benchmarks/`` fails here, and so does a reference to a study
module that does not exist, a study module that cannot be run with ``python -m``, or a
module of realign outside ``realign/bench/studies`` that imports one (studies are leaves)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[2]
STUDIES = REPO / "realign" / "bench" / "studies"
#: ``realign.bench.studies.<module>`` as a command or a name in a README, doc or script
STUDY_NAME = re.compile(r"realign\.bench\.studies\.([a-z0-9_]+)")


def python_files_under(folder: Path) -> list[Path]:
    """Every ``.py`` file below ``folder``, as paths relative to it, sorted."""
    return sorted(p.relative_to(folder) for p in folder.rglob("*.py"))


def study_references(folders: list[Path], files: list[Path]) -> dict[str, list[str]]:
    """module name -> the files (relative to the repository) that name
    ``realign.bench.studies.<module>``, over the READMEs, docs and shell scripts of
    ``folders`` and the given ``files``."""
    texts = [p for f in folders for p in f.rglob("*") if p.suffix in (".md", ".sh")] + files
    found: dict[str, list[str]] = {}
    for path in sorted(texts):
        for name in STUDY_NAME.findall(path.read_text()):
            found.setdefault(name, []).append(str(path.relative_to(REPO)))
    return found


def runs_as_main(source: str) -> bool:
    """The module defines ``main`` and calls it under ``if __name__ == "__main__":``."""
    tree = ast.parse(source)
    defines = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
    guarded = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)
                  and "main(" in ast.unparse(n) for n in tree.body)
    return defines and guarded


def test_no_python_under_benchmarks() -> None:
    readmes = list((REPO / "benchmarks").rglob("README.md"))
    assert len(readmes) >= 10        # the folder the rule is about, not an empty path
    assert python_files_under(REPO / "benchmarks") == [], (
        "benchmark code lives in realign/bench (realign/bench/studies/<study>_<what>.py, "
        "run as python -m realign.bench.studies.<module>); benchmarks/<study>/ keeps its "
        "records, README and shell wrappers")


def test_a_planted_script_is_found(tmp_path: Path) -> None:
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "README.md").write_text("# a study\n")
    (tmp_path / "study" / "run.sh").write_text("python -m realign.bench.studies.x\n")
    assert python_files_under(tmp_path) == []
    (tmp_path / "study" / "driver.py").write_text("print('numbers')\n")
    assert python_files_under(tmp_path) == [Path("study/driver.py")]


def test_every_named_study_module_exists() -> None:
    refs = study_references([REPO / "benchmarks", REPO / "docs"], [REPO / "README.md"])
    # the scan reads what it should: the GPU wrapper, the packing README, docs/benchmarks.md
    assert {"gpu_decode_capture", "packing_summarize", "plan_speed_run"} <= set(refs)
    assert "benchmarks/gpu/decode_capture.sh" in refs["gpu_decode_capture"]
    missing = {name: where for name, where in refs.items()
               if not (STUDIES / f"{name}.py").is_file()}
    assert missing == {}


def imported_modules(source: str) -> set[str]:
    """The modules a source file imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_nothing_outside_the_studies_imports_them() -> None:
    importers = [str(p.relative_to(REPO)) for p in sorted((REPO / "realign").rglob("*.py"))
                 if STUDIES not in p.parents
                 and any(m.startswith("realign.bench.studies")
                         for m in imported_modules(p.read_text()))]
    assert importers == []
    assert imported_modules("def f():\n    from realign.bench import studies\n") >= {
        "realign.bench.studies"}


def test_study_modules_run_with_python_m() -> None:
    modules = [p for p in sorted(STUDIES.glob("*.py")) if p.stem not in ("__init__", "checkout")]
    assert len(modules) >= 20
    assert [p.name for p in modules if not runs_as_main(p.read_text())] == []
    assert runs_as_main("def main() -> None:\n    pass\n\n\nif __name__ == '__main__':\n    main()\n")
    assert not runs_as_main("def main() -> None:\n    pass\n")
