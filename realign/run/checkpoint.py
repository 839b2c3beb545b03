"""Checkpoint folders of a run, written atomically.

Layout: ``RUN/checkpoints/step_000012/`` holds one ``rank<R>.pt`` per worker and a
``manifest.json``. Workers write into ``step_000012.tmp/`` (each file through a
temporary name and a rename); the controller writes the manifest and renames the
folder only once every worker has written, so a kill at any moment leaves the
previous checkpoint complete and the partial one ignored (and removed at the next
start). A rename of a folder is atomic on POSIX file systems.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

KEEP_LAST = 2


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def tmp_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}.tmp"


def latest(run_dir: Path) -> tuple[int, Path] | None:
    """(completed steps, folder) of the newest complete checkpoint, or None."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return None
    done = []
    for d in root.iterdir():
        if d.is_dir() and not d.name.endswith(".tmp") and (d / "manifest.json").is_file():
            done.append((int(d.name.split("_")[1]), d))
    return max(done) if done else None


def clean_partial(run_dir: Path) -> None:
    root = run_dir / "checkpoints"
    if root.is_dir():
        for d in root.iterdir():
            if d.name.endswith(".tmp"):
                shutil.rmtree(d, ignore_errors=True)


def commit(run_dir: Path, step: int, manifest: dict) -> Path:
    """Seal the checkpoint of ``step``: manifest, then the atomic folder rename."""
    tmp = tmp_dir(run_dir, step)
    m = tmp / "manifest.json"
    m.with_suffix(".part").write_text(json.dumps(manifest, indent=1))
    os.replace(m.with_suffix(".part"), m)
    final = step_dir(run_dir, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    old = sorted(d for d in final.parent.iterdir()
                 if d.is_dir() and not d.name.endswith(".tmp") and d != final)
    for d in old[:-(KEEP_LAST - 1)] if KEEP_LAST > 1 else old:
        shutil.rmtree(d, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_file(obj_bytes: bytes, path: Path) -> None:
    """Write bytes through a temporary name and an atomic rename."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(obj_bytes)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
