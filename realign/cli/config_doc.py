"""``docs/config.md``, the experiment YAML's reference, rendered from the schema: every
section of :class:`~realign.config.experiment.ExperimentConfig` and the models it nests
(and each algorithm's ``algorithm.params``), each field with its type, default, allowed
values and description. Nothing is written by hand: a field's text is its
``description``, a section's is its model's docstring.

    python -m realign.cli.config_doc --out docs/config.md      # regenerate
    python -m realign.cli.config_doc --check docs/config.md    # exit 1 when stale

``tests/meta/test_config_doc.py`` fails when the file and :func:`render` differ.
"""
from __future__ import annotations

import argparse
import inspect
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from realign.algorithms.param_paths import SHAPE_OWNED
from realign.config.experiment import ExperimentConfig

#: how the key of a mapping of sections is written in its path (``lora.<role>``)
KEY_NAMES = {"lora": "role", "plan.manual": "mfc"}

#: a union of sections chosen by a key of the section above it, not by a key of its own:
#: its path -> (that key, the member's keys set from above, a note on each member)
CHOSEN_ABOVE = {"algorithm.params": (
    "name", frozenset({"algorithm", *SHAPE_OWNED}),
    "The batch shape's keys (samples_per_prompt, gen_len, ...) are written on "
    "`algorithm`, not here.")}

HEADER = """# Experiment YAML reference

Every section and key of an experiment YAML (`realign plan`, `realign run`, `realign
submit`), generated from the schema's own descriptions (`realign/config/experiment.py`
and the models it nests) by `python -m realign.cli.config_doc --out docs/config.md`;
`tests/meta/test_config_doc.py` fails when this file is stale. Unknown keys are errors
in every section. A default of *required* means the key must be written; *null* means
unset.
"""


@dataclass(frozen=True)
class Section:
    """One YAML mapping: its dotted path, heading, text and the model of its keys."""

    path: str
    title: str
    model: type[BaseModel]
    text: str
    skip: frozenset[str] = frozenset()

    @property
    def anchor(self) -> str:
        return slug(self.title)

    @property
    def link(self) -> str:
        """How a field's type names this section: ``[section](#plancost)``, or the tag of
        one of several (``[slurm](#launcher-type-slurm)``)."""
        tag = re.search(r"\(\w+: (\w+)\)", self.title)
        return f"[{tag.group(1) if tag else 'section'}](#{self.anchor})"


def slug(title: str) -> str:
    """GitHub's anchor of a heading: ``"`plan.cost`"`` -> ``"plancost"``,
    ``"`launcher` (type: slurm)"`` -> ``"launcher-type-slurm"``."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def plain(text: str | None) -> str:
    """A docstring or description as one markdown line: reST roles, double backquotes
    and ``<tag>``s become code spans, whitespace runs one space."""
    text = re.sub(r":\w+:`~?([^`]*?)`", lambda m: f"`{m.group(1).split('.')[-1]}`", text or "")
    parts = text.replace("``", "`").split("`")
    for i in range(0, len(parts), 2):   # outside code spans, <tag> would be read as HTML
        parts[i] = re.sub(r"(<[/\w][^<>`]*>)", r"`\1`", parts[i])
    return " ".join("`".join(parts).split())


def doc_of(model: type[BaseModel]) -> str:
    """A model's own docstring (not one inherited from pydantic's BaseModel)."""
    return plain(inspect.cleandoc(model.__doc__)) if "__doc__" in vars(model) and model.__doc__ else ""


def _models_in(t: Any) -> Iterator[type[BaseModel]]:
    if isinstance(t, type) and issubclass(t, BaseModel):
        yield t
    for a in get_args(t):
        yield from _models_in(a)


def _mapping_in(t: Any) -> Any:
    """The ``dict[...]`` type ``t`` is, or holds as one side of a union; None if none."""
    if get_origin(t) is dict:
        return t
    return next((a for a in get_args(t) if get_origin(a) is dict), None) if _is_union(t) else None


def _is_union(t: Any) -> bool:
    return get_origin(t) in (Union, types.UnionType)


def type_text(t: Any, links: dict[type[BaseModel], str]) -> str:
    """A type as a reader of YAML sees it: ``int or null``, ``mapping str -> float``."""
    if t is type(None):
        return "null"
    if t is Any:
        return "any"
    if isinstance(t, type) and issubclass(t, BaseModel):
        return links.get(t, "mapping")
    if isinstance(t, type):
        return t.__name__
    origin, args = get_origin(t), get_args(t)
    if origin is Annotated:           # a path type (realign.paths): its YAML type
        return type_text(args[0], links)
    if _is_union(t):
        return " or ".join(type_text(a, links) for a in args)
    if origin is Literal:
        return " or ".join(sorted({type(a).__name__ for a in args}))
    if origin in (list, tuple):
        return f"list of {type_text(args[0], links)}"
    if origin is dict:
        return f"mapping {type_text(args[0], links)} -> {type_text(args[1], links)}"
    return str(t)


def _literals(t: Any) -> list[Any]:
    if get_origin(t) is Literal:
        return list(get_args(t))
    return [v for a in get_args(t) for v in _literals(a)]


_BOUNDS = ((at.Gt, "gt", ">"), (at.Ge, "ge", ">="), (at.Lt, "lt", "<"), (at.Le, "le", "<="))


def allowed_text(f: FieldInfo) -> str:
    """The values a field allows: its choices, the keys of a mapping of choices, and its
    bounds (``> 0, <= 64``)."""
    t = f.annotation
    parts = []
    if get_origin(t) is dict and _literals(get_args(t)[0]):
        parts.append("keys " + ", ".join(map(yaml_value, _literals(get_args(t)[0]))))
    elif _literals(t):
        parts.append(", ".join(map(yaml_value, _literals(t))))
    for m in f.metadata:
        for cls, attr, sign in _BOUNDS:
            if isinstance(m, cls):
                parts.append(f"{sign} {yaml_value(getattr(m, attr))}")
    return ", ".join(parts)


def yaml_value(v: Any) -> str:
    """A value as it is written in YAML: ``null``, ``true``, ``[a, b]``, ``{CPU: 1.0}``."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(yaml_value, v)) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def default_text(f: FieldInfo) -> str:
    """A field's default: *required*, a value, or ``(section)`` for a section's own defaults."""
    if f.default_factory is not None:
        value = f.default_factory()  # type: ignore[call-arg]
        return "(section)" if isinstance(value, BaseModel) else yaml_value(value)
    if f.default is PydanticUndefined:
        return "*required*"
    return yaml_value(f.default)


def sections() -> list[Section]:
    """Every section of the experiment YAML, parents before children, in the schema's
    order; a mapping of sections (``lora``) as one ``<key>`` section, each launcher type
    and each algorithm's ``algorithm.params`` (the union of the algorithms' parameters,
    chosen by ``algorithm.name``) as a section of its own."""
    out: list[Section] = []

    def visit(model: type[BaseModel], path: str, title: str, text: str) -> None:
        if any(s.model is model and s.path == path for s in out):
            return
        out.append(Section(path, title, model, text))
        for name, f in model.model_fields.items():
            sub = f"{path}.{name}" if path else name
            mapping = _mapping_in(f.annotation)
            if mapping is not None:                 # lora.<role>, plan.manual.<mfc>
                keyed = f"{sub}.<{KEY_NAMES.get(sub, 'key')}>"
                for m in _models_in(get_args(mapping)[1]):
                    visit(m, keyed, f"`{keyed}`", doc_of(m))
                continue
            tag = f.discriminator if isinstance(f.discriminator, str) else None
            for m in _models_in(f.annotation):
                if tag is None:
                    visit(m, sub, f"`{sub}`", doc_of(m))
                    continue
                value = _literals(m.model_fields[tag].annotation)[0]
                if sub in CHOSEN_ABOVE:             # algorithm.params (name: ppo)
                    key, skip, note = CHOSEN_ABOVE[sub]
                    text = f"`{sub}` of `{key}: {value}`. {doc_of(m)} {note}"
                    out.append(Section(sub, f"`{sub}` ({key}: {value})", m, text, skip))
                else:                               # launcher (type: slurm)
                    visit(m, sub, f"`{sub}` ({tag}: {value})", doc_of(m))
    visit(ExperimentConfig, "", "Top level", doc_of(ExperimentConfig))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or " "


def render() -> str:
    """The whole of ``docs/config.md``."""
    secs = sections()
    lines = [HEADER, "Sections:", ""] + [f"- [{s.title}](#{s.anchor})" for s in secs] + [""]
    for s in secs:
        lines += [f"## {s.title}", "", s.text, ""]
        keys = [n for n in s.model.model_fields if n not in s.skip]
        if not keys:
            lines += ["No keys (an empty mapping or none).", ""]
            continue
        lines += ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
        for name in keys:
            f = s.model.model_fields[name]
            sub = f"{s.path}.{name}" if s.path else name
            links = {x.model: x.link for x in secs
                     if x.path == sub or x.path.startswith(sub + ".<")}
            lines.append("| " + " | ".join(_cell(c) for c in (
                f"`{name}`", type_text(f.annotation, links), default_text(f),
                allowed_text(f), description(name, f))) + " |")
        lines.append("")
    return "\n".join(lines)


def description(name: str, f: FieldInfo) -> str:
    """A field's description; for a section without one its model's docstring, for the
    tag of one of several sections (``launcher.type``) what it selects."""
    if f.description:
        return plain(f.description)
    models = list(_models_in(f.annotation))
    if models:
        return doc_of(models[0])
    values = _literals(f.annotation)
    if len(values) == 1:
        return f"Selects this section's kind: `{name}: {yaml_value(values[0])}`."
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m realign.cli.config_doc",
                                description="docs/config.md from the experiment schema")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--out", type=Path, help="write the reference to this file")
    g.add_argument("--check", type=Path, help="exit 1 when this file differs from the schema's")
    args = p.parse_args(argv)
    text = render()
    if args.check is not None:
        if not args.check.is_file() or args.check.read_text() != text:
            print(f"{args.check} is stale: run python -m realign.cli.config_doc --out {args.check}",
                  file=sys.stderr)
            return 1
        return 0
    if args.out is not None:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
