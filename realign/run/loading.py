"""Load an experiment YAML into :class:`ExperimentConfig`, turning every problem
into a :class:`~realign.errors.UserError` that names the field path, the bad value
and what is allowed. Relative paths in it are resolved against its folder while it is
validated (:mod:`realign.paths`): the config holds absolute paths."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from planner.errors import from_validation
from realign.config.experiment import ExperimentConfig
from realign.errors import UserError
from realign.paths import YAML_DIR


class _UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML is untyped here
    """YAML's safe loader, refusing a mapping that names a key twice (PyYAML keeps the
    last value silently)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise UserError(f"the key {key!r} is given twice (lines {seen[key]} and "
                                f"{line}); keep one", field="experiment")
            seen[key] = line
        return super().construct_mapping(node, deep)


def read_yaml(p: Path) -> Any:
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


def load_experiment(path: str | Path) -> ExperimentConfig:
    """Parse and validate an experiment YAML, its relative paths resolved against its
    folder."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"no experiment file at {str(p)!r}", field="experiment")
    raw = read_yaml(p)
    if not isinstance(raw, dict):
        raise UserError(f"{p} must hold a mapping with the sections name, models, algorithm, "
                        "cluster, plan", field="experiment")
    try:
        cfg = ExperimentConfig.model_validate(raw, context={YAML_DIR: p.resolve().parent})
    except ValidationError as e:
        raise from_validation(e, ExperimentConfig, context=f"{p}: invalid experiment: ") from None
    return cfg
