"""The error of a bad dataset line: names the file, the line and the key."""
from __future__ import annotations

from realign.errors import UserError


class DataError(UserError):
    """A dataset problem. ``path`` is the file, ``line`` its 1-based line number (None
    for the whole file), ``key`` the JSON key at fault (None when not about one key);
    ``field`` is the config field that names the file (e.g. ``data.path``)."""

    def __init__(self, problem: str, path: str, line: int | None = None,
                 key: str | None = None, field: str | None = None):
        self.path, self.line, self.key, self.problem = path, line, key, problem
        where = path if line is None else f"{path}, line {line}"
        if key is not None:
            where += f", key {key!r}"
        super().__init__(f"{where}: {problem}", field=field)
