"""docs/config.md is the experiment schema's reference: it equals what the schema renders
today (a field, default or description changed without regenerating fails here), and
every key the shipped experiment YAMLs write is in it, under its section."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from realign.cli.config_doc import main, render

pytestmark = pytest.mark.pure

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "config.md"


def test_docs_config_md_is_what_the_schema_renders():
    assert DOC.read_text() == render(), (
        "docs/config.md is stale: run .venv/bin/python -m realign.cli.config_doc --out docs/config.md")


def documented() -> dict[str, set[str]]:
    """Section title without backquotes (``plan.cost``, ``launcher (type: slurm)``) ->
    the keys its table lists."""
    out: dict[str, set[str]] = {}
    title = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            title = line[3:].replace("`", "")
            out[title] = set()
        elif title and (m := re.match(r"\| `(\w+)` \|", line)):
            out[title].add(m.group(1))
    return out


def section_of(where: str, value: dict, doc: dict[str, set[str]], algorithm: str
               ) -> str | None:
    """The documented section of the YAML mapping at ``where`` (its path in the doc's
    spelling, ``plan.manual.<mfc>.mesh``), or None (a free mapping: env_args, ...)."""
    if where == "launcher":
        return f"launcher (type: {value.get('type', 'local')})"
    if where == "algorithm.params":
        return f"algorithm.params (name: {algorithm})"
    return (where or "Top level") if (where or "Top level") in doc else None


def unknown_keys(cfg: dict) -> list[str]:
    """The keys of ``cfg`` that docs/config.md does not list under their section."""
    doc, missing = documented(), []
    algorithm = cfg.get("algorithm", {}).get("name", "")

    def walk(path: str, where: str, value: dict) -> None:
        sec = section_of(where, value, doc, algorithm)
        if sec is None:
            return
        for k, v in value.items():
            sub, sub_where = f"{path}.{k}".lstrip("."), f"{where}.{k}".lstrip(".")
            if k not in doc[sec]:
                missing.append(f"{sub} (section {sec})")
                continue
            keyed = [t for t in doc if re.fullmatch(re.escape(sub_where) + r"\.<\w+>", t)]
            if keyed and isinstance(v, dict):         # a mapping of sections: lora.<role>
                for key, item in v.items():
                    if isinstance(item, dict):
                        walk(f"{sub}.{key}", keyed[0], item)
            elif isinstance(v, dict):
                walk(sub, sub_where, v)

    walk("", "", cfg)
    return missing


YAMLS = sorted((REPO / "experiments").rglob("*.yaml"))


@pytest.mark.parametrize("path", YAMLS, ids=[p.name for p in YAMLS])
def test_every_key_a_shipped_experiment_writes_is_documented(path):
    assert unknown_keys(yaml.safe_load(path.read_text())) == []


def test_a_key_missing_from_the_doc_is_found():
    """The walk above finds what is not documented (it would pass vacuously otherwise)."""
    cfg = {"name": "x", "models": {"actor": "a"}, "algorithm": {"name": "grpo", "params":
           {"kl_coef": 0.1, "nope": 1}}, "plan": {"cost": {"recompute": "auto", "nah": 2},
           "manual": {"actor.generate": {"mesh": {"first_gpu": 0, "n_gpus": 1, "bad": 0}}}},
           "lora": {"actor": {"rank": 8, "typo": 1}},
           "launcher": {"type": "slurm", "partition": "p", "address": "auto"}}
    assert sorted(unknown_keys(cfg)) == [
        "algorithm.params.nope (section algorithm.params (name: grpo))",
        "launcher.address (section launcher (type: slurm))",
        "lora.actor.typo (section lora.<role>)",
        "plan.cost.nah (section plan.cost)",
        "plan.manual.actor.generate.mesh.bad (section plan.manual.<mfc>.mesh)"]


def test_every_key_has_a_type_a_default_and_a_description():
    rows = [ln for ln in DOC.read_text().splitlines() if re.match(r"\| `\w+` \|", ln)]
    assert len(rows) > 150
    for row in rows:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        key, type_, default, _allowed, desc = cells
        assert type_ and default and desc, row


def test_the_doc_states_defaults_bounds_and_choices():
    text = DOC.read_text()
    assert ("| `max_staleness` | int | 0 | >= 0, <= 64 |" in text)
    assert "| `device` | str | cuda | cpu, cuda |" in text
    assert "| `fn` | str | math_verify |" in text
    assert "| `lora` | mapping str -> [section](#lorarole) | {} | keys actor, critic, reward |" in text


def test_check_and_out(tmp_path, capsys):
    out = tmp_path / "config.md"
    assert main(["--out", str(out)]) == 0 and out.read_text() == render()
    assert main(["--check", str(out)]) == 0
    out.write_text(render().replace("Discount factor.", "Discount."))
    assert main(["--check", str(out)]) == 1
    assert "stale" in capsys.readouterr().err
    assert main(["--check", str(tmp_path / "none.md")]) == 1
