"""Reading JSONL files: one JSON object per line, blank lines skipped."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from realign.data.errors import DataError


def read_jsonl(path: str | Path, field: str | None = None) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, object)`` for every non-blank line of ``path``.

    Raises :class:`DataError` for a missing or unreadable file, a line that is not
    JSON, or a line that is not a JSON object. An empty file yields nothing (the
    loaders decide that an empty dataset is an error)."""
    p = Path(path)
    if not p.is_file():
        what = "is a folder, not a file" if p.is_dir() else "no such file"
        raise DataError(f"{what} (give the path of a JSONL file)", str(p), field=field)
    try:
        f = p.open(encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read: {e.strerror}", str(p), field=field) from None
    with f:
        n = 0
        try:
            for n, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DataError(f"not valid JSON ({e.msg} at column {e.colno}); each line "
                                    f"must be one JSON object", str(p), n, field=field) from None
                if not isinstance(obj, dict):
                    raise DataError(f"expected a JSON object, got {type(obj).__name__}",
                                    str(p), n, field=field)
                yield n, obj
        except UnicodeDecodeError as e:
            raise DataError(f"not UTF-8 text ({e.reason})", str(p), n + 1, field=field) from None
