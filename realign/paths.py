"""Paths an experiment YAML names, made absolute while it is validated.

A relative path in the YAML means a path relative to the YAML file's folder. The
loader (:func:`realign.run.loading.load_experiment`) validates the YAML with the
validation context ``{YAML_DIR: <the folder>}``; every field that names a file has one
of the types below, whose validator reads that folder from the context and joins it,
so whatever reads the config later (the planner's front end, the workers, a resumed
run's saved spec) sees absolute paths only. A config validated without that context
(built in Python, or a saved spec read back) resolves against the current directory,
as a relative path opened there would be.

* :data:`FilePath`: a file or folder (``data.train.path``, ``plan.profile``...);
* :data:`ModelRef`: a model preset's name, kept as written, or a checkpoint path;
* :data:`CodeRef`: user code, ``"package.module:attr"`` or a built-in's name, kept as
  written, or ``"path/to/file.py:attr"``, whose file part is made absolute.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, get_args

from pydantic import AfterValidator, BaseModel, ValidationInfo

from planner.specs.model_spec import model_presets

#: The validation context's key holding the experiment YAML's folder.
YAML_DIR = "yaml_dir"


def absolute(path: str, info: ValidationInfo) -> str:
    """``path`` (``~`` expanded) joined to the context's :data:`YAML_DIR` (else the
    current directory) unless it is absolute already; not normalised otherwise
    (``..`` and links kept, as the user wrote them)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return str(p)
    base = (info.context or {}).get(YAML_DIR)
    return str((Path(base) if base is not None else Path.cwd()) / p)


def _model_ref(ref: str, info: ValidationInfo) -> str:
    return ref if ref in model_presets() else absolute(ref, info)


def _code_ref(ref: str, info: ValidationInfo) -> str:
    module, sep, attr = ref.strip().partition(":")
    if not (sep and module.endswith(".py")):
        return ref                 # a module name or a built-in: found on sys.path
    return f"{absolute(module, info)}:{attr}"


#: A path to a file or folder, absolute once validated.
FilePath = Annotated[str, AfterValidator(absolute)]
#: A model preset's name (kept) or a path to a checkpoint folder or config.json
#: (absolute once validated).
ModelRef = Annotated[str, AfterValidator(_model_ref)]
#: User code: ``module:attr`` or a built-in's name (kept), or ``file.py:attr`` (the file
#: absolute once validated).
CodeRef = Annotated[str, AfterValidator(_code_ref)]


def _path_kind(annotation: Any, metadata: list[Any] = []) -> Any:  # noqa: B006 (read only)
    """The path type of :mod:`realign.paths` a field's annotation holds (through
    ``| None``, ``list[...]`` and ``dict[..., ...]``; pydantic moves a bare
    ``Annotated``'s validator into the field's ``metadata``), else None."""
    for kind in _KINDS:
        if annotation == kind or get_args(kind)[1] in metadata:      # Annotated[str, v]: v
            return kind
    for arg in get_args(annotation):
        found = _path_kind(arg)
        if found is not None:
            return found
    return None


def named_paths(model: BaseModel, prefix: str = "") -> dict[str, Path]:
    """Field path (``data.train.path``, ``rollout.tools[0]``) -> the file or folder it
    names, for every field of ``model`` and its sections typed :data:`FilePath`,
    :data:`ModelRef` or :data:`CodeRef` that names one (a preset, a module name and an
    unset field name none).

    An experiment whose ``data.train.path`` is ``/d/train.jsonl`` and actor the preset
    ``tiny-llama``: ``{"data.train.path": Path("/d/train.jsonl")}``."""
    out: dict[str, Path] = {}
    for name, info in type(model).model_fields.items():
        value, at = getattr(model, name), f"{prefix}{name}"
        kind = _path_kind(info.annotation, info.metadata)
        items = (value.items() if isinstance(value, dict)
                 else ((f"[{i}]", v) for i, v in enumerate(value)) if isinstance(value, list)
                 else (("", value),))
        for key, v in items:
            where = f"{at}.{key}" if isinstance(value, dict) else f"{at}{key}"
            if isinstance(v, BaseModel):
                out.update(named_paths(v, where + "."))
            elif isinstance(v, str) and kind is not None:
                p = _named_file(kind, v)
                if p is not None:
                    out[where] = p
    return out


def _named_file(kind: Any, value: str) -> Path | None:
    if kind is CodeRef:
        module, sep, _attr = value.strip().partition(":")
        return Path(module) if sep and module.endswith(".py") else None
    if kind is ModelRef and value in model_presets():
        return None
    return Path(value)


_KINDS = (FilePath, ModelRef, CodeRef)
