"""The run folder's checkpoints and final model, written atomically and verified.

Layout: ``RUN/checkpoints/step_000012/`` holds one ``rank<R>.pt`` per worker and a
``manifest.json`` that records every file's size and SHA-256, the optimizer sharding
and the trained copies the checkpoint is for. Workers write into
``step_000012.tmp/`` (each file through a temporary name and a rename); the controller
writes the manifest and renames the folder only once every worker has written, so a
kill at any moment leaves the previous checkpoint complete and the partial one ignored
(and removed at the next start). A rename of a folder is atomic on POSIX file systems.

Resuming takes the newest checkpoint whose files match its manifest; a damaged newer
one is renamed ``step_000012.damaged`` (never deleted) and the run says so. Only
folders named ``step_NNNNNN`` are checkpoints: anything else beside them (a user's
backup copy) is neither read nor removed.

The final model (``RUN/final/<role>``) is written into ``<role>.part`` and renamed
once complete, with ``realign_final.json`` listing its files and sizes: a rerun
finds a missing or damaged one and writes it again from the last checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

KEEP_LAST = 2
MANIFEST = "manifest.json"
#: a checkpoint's copy of the run's metrics lines of the steps it covers
METRICS = "metrics.jsonl"
FINAL_MARKER = "realign_final.json"
_STEP = re.compile(r"step_(\d{6,})")
_CHUNK = 1 << 22


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def tmp_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}.tmp"


def committed(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP.fullmatch(d.name)
        if m and d.is_dir() and (d / MANIFEST).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def file_digest(path: Path) -> tuple[int, str]:
    """(size, SHA-256 hex) of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return path.stat().st_size, h.hexdigest()


def bytes_digest(data: bytes) -> tuple[int, str]:
    return len(data), hashlib.sha256(data).hexdigest()


def read_manifest(folder: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads((folder / MANIFEST).read_text())
    return manifest


def problems(folder: Path) -> list[str]:
    """Why the checkpoint in ``folder`` cannot be trusted (empty when it is intact): a
    manifest that does not parse, files missing, or of another size or SHA-256 than the
    manifest records. Manifests from before sizes were recorded list no files."""
    try:
        manifest = read_manifest(folder)
        files = manifest.get("files", {})
        if not (isinstance(files, dict) and all(
                isinstance(i, dict) and isinstance(i.get("size"), int)
                and isinstance(i.get("sha256"), str) for i in files.values())):
            raise ValueError("its files are not listed as {name: {size, sha256}}")
    except (OSError, ValueError, AttributeError) as e:
        return [f"{folder / MANIFEST} cannot be read ({e})"]
    out = []
    present = {}
    for name, info in files.items():
        p = folder / name
        if not p.is_file():
            out.append(f"{p} is missing")
        elif p.stat().st_size != info["size"]:
            out.append(f"{p} has {p.stat().st_size} bytes, the manifest says {info['size']}")
        else:
            present[name] = p
    with ThreadPoolExecutor(max_workers=4) as pool:      # hashlib releases the GIL
        digests = dict(zip(present, pool.map(file_digest, present.values())))
    out += [f"{present[n]} does not match its SHA-256 in the manifest"
            for n, (_, sha) in digests.items() if sha != files[n]["sha256"]]
    return out


def quarantine(folder: Path) -> Path:
    """Rename a damaged folder out of the way (``<name>.damaged``, numbered if taken)."""
    target = folder.with_name(folder.name + ".damaged")
    k = 1
    while target.exists():
        k += 1
        target = folder.with_name(f"{folder.name}.damaged{k}")
    os.replace(folder, target)
    return target


def resume_point(run_dir: Path) -> tuple[tuple[int, Path] | None, list[str]]:
    """(the newest intact checkpoint's (step, folder) or None, what was set aside).

    Damaged checkpoints newer than the one resumed from are renamed out of the way
    (:func:`quarantine`), each noted. When checkpoints exist but none is intact, a
    :class:`UserError` names the files and nothing on disk is changed: the run neither
    starts over silently nor renames or deletes them."""
    from realign.errors import UserError

    found = committed(run_dir)
    damaged: list[tuple[Path, list[str]]] = []
    for step, folder in reversed(found):
        bad = problems(folder)
        if not bad:
            notes = []
            for d, why in damaged:
                moved = quarantine(d)
                notes.append(f"checkpoint {d.name} is damaged ({'; '.join(why)}); "
                             f"set aside as {moved.name}")
            return (step, folder), notes
        damaged.append((folder, bad))
    if found:
        said = " / ".join(f"checkpoint {d.name} is damaged ({'; '.join(why)})"
                          for d, why in damaged)
        raise UserError(f"no intact checkpoint in {run_dir / 'checkpoints'}: {said}. "
                        "Nothing was changed: restore the files, or run in a new run "
                        "folder to start over", field="run_dir")
    return None, []


def saved_metrics(run_dir: Path) -> dict[int, tuple[str, str]]:
    """step -> (its metrics line, the checkpoint that holds it), from every committed
    checkpoint whose metrics copy matches its manifest (newer checkpoints win)."""
    out: dict[int, tuple[str, str]] = {}
    for _, folder in committed(run_dir):
        try:
            info = read_manifest(folder)["files"][METRICS]
            data = (folder / METRICS).read_bytes()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if bytes_digest(data) != (info.get("size"), info.get("sha256")):
            continue
        for line in data.decode(errors="replace").splitlines():
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(step, int):
                out[step] = (line, folder.name)
    return out


#: what a run folder holds, and of which kind (a folder, or a file)
LAYOUT = {"checkpoints": "folder", "logs": "folder", "final": "folder",
          "tensorboard": "folder", "metrics.jsonl": "file", "timeline.jsonl": "file"}


def check_layout(run_dir: Path) -> None:
    """A :class:`UserError` when something in the run folder stands where the run keeps
    something of another kind (a file named ``checkpoints``, a folder named
    ``metrics.jsonl``): nothing of it is touched."""
    from realign.errors import UserError

    for name, kind in LAYOUT.items():
        p = run_dir / name
        wrong = p.is_dir() if kind == "file" else (p.exists() and not p.is_dir())
        if wrong:
            raise UserError(f"{p} is a {'folder' if kind == 'file' else 'file'}, but the run "
                            f"keeps a {kind} there; move it away", field="run_dir")


def clean_partial(run_dir: Path) -> None:
    """Remove checkpoint folders a killed run left half-written (``step_N.tmp``)."""
    root = run_dir / "checkpoints"
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and d.name.endswith(".tmp") and _STEP.fullmatch(d.name[:-4]):
                shutil.rmtree(d, ignore_errors=True)


def commit(run_dir: Path, step: int, manifest: dict[str, Any]) -> Path:
    """Seal the checkpoint of ``step``: manifest, then the atomic folder rename; then
    remove checkpoints older than the last :data:`KEEP_LAST` (checkpoints only)."""
    tmp = tmp_dir(run_dir, step)
    _write_json(tmp / MANIFEST, manifest)
    final = step_dir(run_dir, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    older = [d for s, d in committed(run_dir) if d != final]
    for d in older[:-(KEEP_LAST - 1)] if KEEP_LAST > 1 else older:
        shutil.rmtree(d, ignore_errors=True)
    return final


def check_sharding(was: bool | None, now: bool, name: str) -> None:
    """A :class:`UserError` when checkpoint ``name``'s optimizer was sharded over the
    data-parallel ranks (``was``; None: not recorded) otherwise than this run's (``now``)."""
    from realign.errors import UserError

    if was is not None and was != now:
        raise UserError(f"checkpoint {name} was written with the optimizer "
                        f"{'' if was else 'not '}sharded over data-parallel ranks; this run "
                        f"{'shards' if now else 'does not shard'} it. Set "
                        f"train.distributed_optimizer: {str(was).lower()} to resume",
                        field="train.distributed_optimizer")


def in_flight_usable(manifest: dict[str, Any], ahead_ranks: tuple[int, ...]) -> bool:
    """Whether a checkpoint's samples in flight (a rollout generated ahead, saved by the
    ranks that made it) can feed the resumed run: its plan generated on the same ranks.
    Otherwise the first resumed step generates its rollout again, with the current
    policy (still within the staleness bound, but not the uninterrupted run's)."""
    return bool(ahead_ranks) and manifest.get("in_flight_ranks") == list(ahead_ranks)


def check_resumable(manifest: dict[str, Any], folder: Path, distributed_optimizer: bool,
                    trained: list[str]) -> None:
    """A :class:`UserError` (before any worker starts) when the checkpoint in ``folder``
    cannot resume this run: its optimizer was sharded otherwise, or it holds other
    trained copies than this plan trains. Older manifests lack the records: the
    workers check what they load."""
    from realign.errors import UserError

    check_sharding(manifest.get("distributed_optimizer"), distributed_optimizer, folder.name)
    had = manifest.get("trained")
    if had is not None and sorted(had) != sorted(trained):
        raise UserError(f"checkpoint {folder.name} holds the trained copies {sorted(had)}; "
                        f"this plan trains {sorted(trained)}. Resume with the plan it was "
                        f"written with (plan.file: {folder.parents[1] / 'plan.json'}) or run "
                        "in a new run folder", field="plan")


def latest(run_dir: Path) -> tuple[int, Path] | None:
    """(completed steps, folder) of the newest committed checkpoint (unverified)."""
    found = committed(run_dir)
    return found[-1] if found else None


# ---- the final model ------------------------------------------------------------------
def final_part(final_dir: Path) -> Path:
    return final_dir.with_name(final_dir.name + ".part")


def final_intact(final_dir: Path) -> bool:
    """The final model is there, complete: its marker lists files of those sizes."""
    try:
        files = json.loads((final_dir / FINAL_MARKER).read_text())["files"]
        return all((final_dir / n).is_file() and (final_dir / n).stat().st_size == size
                   for n, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def seal_final(final_dir: Path, steps: int) -> Path:
    """Mark the written ``<role>.part`` folder complete and move it into place (a
    damaged earlier one is set aside, not deleted)."""
    part = final_part(final_dir)
    files = {p.name: p.stat().st_size for p in sorted(part.iterdir()) if p.is_file()}
    _write_json(part / FINAL_MARKER, {"steps": steps, "files": files})
    if final_dir.exists():
        quarantine(final_dir)
    os.replace(part, final_dir)
    _fsync_dir(final_dir.parent)
    return final_dir


# ---- atomic files ---------------------------------------------------------------------
def _write_json(path: Path, data: dict[str, Any]) -> None:
    save_file(json.dumps(data, indent=1).encode(), path)


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
