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


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """Field names allowed at ``loc`` (the parent of an unknown key), if resolvable."""
    cur: Any = model
    for part in loc:
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)):
            return None
        field = cur.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        cur = next((a for a in getattr(ann, "__args__", (ann,))
                    if isinstance(a, type) and issubclass(a, BaseModel)), ann)
    if isinstance(cur, type) and issubclass(cur, BaseModel):
        return list(cur.model_fields)
    return None


def format_validation_error(e: ValidationError, model: type[BaseModel], source: str) -> str:
    lines = []
    for err in e.errors():
        loc = tuple(x for x in err["loc"] if not (isinstance(x, str) and "[" in x))
        path = ".".join(str(x) for x in loc) or "(top level)"
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


def load_experiment(path: str | Path) -> tuple[ExperimentConfig, Path]:
    """Parse and validate an experiment YAML. Returns the config and its folder."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"no experiment file at {str(p)!r}", field="experiment")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"{p} is not valid YAML: {e}", field="experiment") from None
    if not isinstance(raw, dict):
        raise UserError(f"{p} must hold a mapping with the sections name, models, algorithm, "
                        "cluster, plan", field="experiment")
    try:
        return ExperimentConfig.model_validate(raw), p.resolve().parent
    except ValidationError as e:
        raise UserError(format_validation_error(e, ExperimentConfig, str(p))) from None
