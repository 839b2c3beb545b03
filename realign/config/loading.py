"""Load an experiment YAML into :class:`ExperimentConfig`, turning every problem
into a :class:`~realign.errors.UserError` that names the field path, the bad value
and what is allowed."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from realign.config.experiment import ExperimentConfig
from realign.errors import UserError


def _resolve(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[list[str], Any]:
    """Walk ``loc`` through the schema: (the path to print, the type reached).

    A discriminated union puts its tag in the location (``launcher.slurm.x``); the tag
    selects the member and is left out of the printed path (``launcher.x``)."""
    cur: Any = model
    path: list[str] = []
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)):
            path.append(str(part))
            cur = None
            continue
        field = cur.model_fields.get(str(part))
        path.append(str(part))
        if field is None:
            cur = None
            continue
        members = [a for a in getattr(field.annotation, "__args__", (field.annotation,))
                   if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(members) > 1 and parts:
            tagged = [m for m in members if "type" in m.model_fields
                      and f"'{parts[0]}'" in str(m.model_fields["type"].annotation)]
            if tagged:
                parts.pop(0)
                cur = tagged[0]
                continue
        cur = members[0] if members else field.annotation
    return path, cur


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """Field names allowed at ``loc`` (the parent of an unknown key), if resolvable."""
    _path, cur = _resolve(model, loc)
    if isinstance(cur, type) and issubclass(cur, BaseModel):
        return list(cur.model_fields)
    return None


def format_validation_error(e: ValidationError, model: type[BaseModel], source: str) -> str:
    lines = []
    for err in e.errors():
        loc = tuple(x for x in err["loc"] if not (isinstance(x, str) and "[" in x))
        path = ".".join(_resolve(model, loc)[0]) or "(top level)"
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, loc[:-1])
            hint = f"; allowed keys: {', '.join(allowed)}" if allowed else ""
            lines.append(f"{path}: unknown key{hint}")
        elif err["type"] == "missing":
            lines.append(f"{path}: required but missing")
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{path}: {err['msg']}{shown}")
    return f"{source}: invalid experiment:\n  " + "\n  ".join(dict.fromkeys(lines))


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names a key twice (PyYAML keeps the
    last value silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise UserError(f"the key {key!r} is given twice (lines {seen[key]} and "
                                f"{line}); keep one", field="experiment")
            seen[key] = line
        return super().construct_mapping(node, deep)


def read_yaml(p: Path):
    """The YAML document in ``p``: a :class:`UserError` for a file that is not text, not
    YAML, or names a key twice."""
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{p} is not a text (UTF-8) file; an experiment is a YAML file",
                        field="experiment") from None
    except OSError as e:
        raise UserError(f"cannot read {p}: {e.strerror}", field="experiment") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise UserError(f"{p} is not valid YAML: {e}", field="experiment") from None


def load_experiment(path: str | Path) -> tuple[ExperimentConfig, Path]:
    """Parse and validate an experiment YAML. Returns the config and its folder."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"no experiment file at {str(p)!r}", field="experiment")
    raw = read_yaml(p)
    if not isinstance(raw, dict):
        raise UserError(f"{p} must hold a mapping with the sections name, models, algorithm, "
                        "cluster, plan", field="experiment")
    try:
        return ExperimentConfig.model_validate(raw), p.resolve().parent
    except ValidationError as e:
        raise UserError(format_validation_error(e, ExperimentConfig, str(p))) from None
