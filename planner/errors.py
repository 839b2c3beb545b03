"""User-facing input errors. Each names the offending field, what is wrong and what
is allowed; the CLI prints them without a traceback and exits with code 2.

One hierarchy for the whole project: :class:`UserError` is any bad input (the
runtime re-exports it as :class:`realign.errors.UserError`), :class:`PlanError` is bad
planning input, :class:`InfeasibleError` a plan that fits nowhere. One helper,
:func:`from_validation`, turns a pydantic ``ValidationError`` into a user error naming
the field path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from pydantic import ValidationError


class UserError(Exception):
    """Bad user input: ``field`` is the offending config path (or flag) when there is one."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class PlanError(UserError):
    """A user error in planning input: the message says how to fix it."""


class InfeasibleError(PlanError):
    """No allocation fits in GPU memory; the message names what does not fit and
    the smallest cluster that would."""


class NonFiniteError(UserError):
    """A reward, loss or gradient that is not a finite number: the run stops before the
    optimizer applies it (exit code 1, naming the step and the value)."""


def _schema_path(model: Any, loc: tuple[Any, ...]) -> tuple[list[str], Any]:
    """Walk ``loc`` through ``model``'s schema: (the path to print, the type reached).

    A discriminated union puts its tag in the location (``launcher.slurm.x``); the tag
    selects the member and is left out of the printed path (``launcher.x``)."""
    from pydantic import BaseModel

    cur: Any = model
    path: list[str] = []
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        path.append(str(part))
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)):
            cur = None
            continue
        field = cur.model_fields.get(str(part))
        if field is None:
            cur = None
            continue
        members = [a for a in getattr(field.annotation, "__args__", (field.annotation,))
                   if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(members) > 1 and parts:
            tagged = [m for m in members if any(
                f"'{parts[0]}'" in str(m.model_fields[t].annotation)
                for t in ("type", "algorithm") if t in m.model_fields)]
            if tagged:
                parts.pop(0)
                cur = tagged[0]
                continue
        cur = members[0] if members else field.annotation
    return path, cur


def from_validation(e: ValidationError, model: Any = None, *, prefix: str = "",
                    context: str = "", field: str | None = None,
                    cls: type[UserError] = UserError,
                    unknown: str = "Extra inputs are not permitted: an unknown key",
                    hidden: tuple[str, ...] = (),
                    renames: Mapping[str, str] | None = None) -> UserError:
    """The user error for a pydantic ``ValidationError``: each problem as ``<field path>:
    <what is wrong>`` (an unknown key lists the allowed ones, a missing one says so, a bad
    value shows what was given), the path walked through ``model``'s schema and put
    under ``prefix``; ``renames`` maps a path to the name the user wrote it under.
    ``context`` leads the message (a file, what it should have been); ``field`` is the
    error's field, by default the first problem's path (which a lone problem's message
    then leaves out); ``hidden`` keys are never listed as allowed (fields set by
    something else).

    >>> from pydantic import BaseModel, ConfigDict, ValidationError
    >>> class M(BaseModel):
    ...     model_config = ConfigDict(extra="forbid")
    ...     lr: float = 1.0
    >>> try:
    ...     M(lr="fast")
    ... except ValidationError as e:
    ...     err = from_validation(e, M, prefix="train")
    >>> str(err)
    "train.lr: Input should be a valid number, unable to parse string as a number (got 'fast')"
    """
    renames = renames or {}
    problems: list[tuple[str, str]] = []
    for err in e.errors():
        loc = tuple(x for x in err["loc"] if not (isinstance(x, str) and "[" in x))
        steps, _ = _schema_path(model, loc) if model is not None else ([str(x) for x in loc], None)
        raw = ".".join(steps)
        path = renames.get(raw) or ".".join(p for p in (prefix, raw) if p) or "(top level)"
        if err["type"] == "extra_forbidden":
            _, parent = _schema_path(model, loc[:-1]) if model is not None else ([], None)
            names = [k for k in getattr(parent, "model_fields", {}) if k not in hidden]
            text = f"{unknown}; allowed: {', '.join(names)}" if names else unknown
        elif err["type"] == "missing":
            text = f"{err['msg']}, but missing"         # Field required, but missing
        else:
            got = err.get("input")
            text = err["msg"] + ("" if isinstance(got, dict) else f" (got {got!r})")
        problems.append((path, text))
    lines = list(dict.fromkeys(f"{p}: {t}" for p, t in problems))
    if len(lines) > 1:
        body = "\n  " + "\n  ".join(lines)
    else:       # the error's field names the path already, unless it is another one
        body = problems[0][1] if field is None else lines[0]
    return cls(f"{context}{body}", field=field or problems[0][0])
