"""Checkpoint directories: atomic publication, the completion marker, `latest`.

[Note: atomic save] A save writes into `<path>.tmp-<id>` (the id is drawn by rank 0 and
shared). Only after every rank has written its blocks does rank 0 write `.metadata`,
then the completion marker `shardfn-complete.json`, fsync them, and rename the
directory to `<path>` (one `rename`, atomic on POSIX file systems). So:

- `<path>` exists only once it is complete; a crash at any earlier point leaves just a
  `*.tmp-*` directory, which `load` refuses and `latest` skips (when rank 0 survives the
  failure, it removes that directory);
- a previous checkpoint (another path, e.g. `step_000100`) is never touched;
- overwriting (`overwrite=True`) moves the old directory to `<path>.old-<id>`, renames
  the new one in, then deletes the old one; a crash in between leaves the old one there,
  complete.

Directories written by `dcp.save` itself (FSDP2, torchtitan) carry no marker; `load`
accepts them when `.metadata` is present, which DCP writes last.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid

from ._errors import CheckpointError, IncompleteCheckpointError

__all__ = ["MARKER", "new_id", "temp_path", "preflight", "publish", "discard", "check_complete", "latest"]

MARKER = "shardfn-complete.json"
METADATA = ".metadata"
_TMP = ".tmp-"
_OLD = ".old-"


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def temp_path(path: str, save_id: str) -> str:
    return f"{path}{_TMP}{save_id}"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def preflight(path: str, overwrite: bool, who: str) -> None:
    """Rank 0, before anything is written: the target must be free (or overwritable)."""
    if _TMP in os.path.basename(path) or _OLD in os.path.basename(path):
        raise CheckpointError(
            f"{who}: {path!r}: names containing {_TMP!r} or {_OLD!r} are reserved for saves in progress"
        )
    if os.path.exists(path) and not overwrite:
        raise CheckpointError(
            f"{who}: {path!r} already exists.\nFix: save each checkpoint to a new path (e.g. "
            f"f'{{dir}}/step_{{step:06d}}'), or pass overwrite=True to replace it atomically."
        )
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


def publish(tmp: str, path: str, info: dict, save_id: str) -> None:
    """Rank 0, after `.metadata`: write the marker, then rename `tmp` to `path` ([Note: atomic save])."""
    marker = os.path.join(tmp, MARKER)
    with open(marker + ".part", "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker + ".part", marker)
    _fsync_dir(tmp)
    old = None
    if os.path.exists(path):
        old = f"{path}{_OLD}{save_id}"
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def discard(tmp: str) -> None:
    """Rank 0, after a failed save (any rank's error, or a dead peer): remove the unfinished directory.

    A peer still writing into it then fails too. If rank 0 itself dies, the directory
    stays; `load` refuses it, `latest` skips it, and it can be deleted when no save runs.
    """
    shutil.rmtree(tmp, ignore_errors=True)


def check_complete(path: str, who: str) -> str:
    """`"shardfn"` or `"dcp"` (a marker-less DCP directory); raises if `path` is not complete."""
    path = os.fspath(path)
    name = os.path.basename(os.path.normpath(path))
    if _TMP in name:
        raise IncompleteCheckpointError(
            f"{who}: {path!r} is the temporary directory of a save that did not finish (or is still "
            f"running); it is never a complete checkpoint.\nFix: load the path the save was given, or "
            f"sf.checkpoint.latest(dir) for the newest complete one."
        )
    if not os.path.isdir(path):
        parent = os.path.dirname(os.path.abspath(path)) or "."
        base = os.path.basename(os.path.normpath(path))
        partial = sorted(n for n in os.listdir(parent) if n.startswith(base + _TMP)) if os.path.isdir(parent) else []
        if partial:
            raise IncompleteCheckpointError(
                f"{who}: {path!r} is not a complete checkpoint: only the unfinished save(s) {partial} exist "
                f"next to it (a save was interrupted, or is still running).\nFix: use "
                f"sf.checkpoint.latest({parent!r}) to find the newest complete checkpoint."
            )
        raise CheckpointError(f"{who}: no checkpoint at {path!r} (not a directory)")
    if not os.path.isfile(os.path.join(path, METADATA)):
        raise IncompleteCheckpointError(
            f"{who}: {path!r} has no {METADATA} file, so it is not a complete DCP checkpoint "
            f"(DCP writes {METADATA} last).\nFix: load a complete checkpoint, e.g. sf.checkpoint.latest(dir)."
        )
    return "shardfn" if os.path.isfile(os.path.join(path, MARKER)) else "dcp"


def is_complete(path: str) -> bool:
    try:
        check_complete(path, "latest")
    except CheckpointError:
        return False
    return True


def _order(name: str, path: str):
    numbers = re.findall(r"\d+", name)
    step = int(numbers[-1]) if numbers else -1
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        mtime = 0.0
    return (step, mtime, name)


def latest(directory) -> str | None:
    """The newest complete checkpoint directly under `directory`, or None.

    "Newest" is the largest trailing number in the name (`step_000200` after
    `step_000100`), then the latest modification time. Temporary directories of
    unfinished saves and directories without `.metadata` are skipped.

    Example:
      >>> import shardfn as sf, tempfile
      >>> sf.checkpoint.latest(tempfile.mkdtemp()) is None
      True
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    best = None
    for name in os.listdir(directory):
        if _TMP in name or _OLD in name:
            continue
        path = os.path.join(directory, name)
        if not os.path.isdir(path) or not is_complete(path):
            continue
        key = _order(name, path)
        if best is None or key > best[0]:
            best = (key, path)
    return None if best is None else best[1]


def describe(info: dict) -> dict:  # the marker's content, for `publish`
    return {"format": "torch.distributed.checkpoint", "writer": "shardfn", "version": 1,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **info}
