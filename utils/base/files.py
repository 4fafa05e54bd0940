"""Atomic writes: a file or folder appears under its final name complete, or not at all.

Every file and folder the package writes outside a checkpoint (config.json, the --save_model .pt files,
hf_model/, a cut-back metrics.jsonl, a download) goes through `atomic_path`: a crash mid-write leaves at
most a temporary sibling (`<name>.tmp`, or `<name>.old` while a folder is being swapped), never a truncated
file under the final name, and an existing file or folder of that name stays intact until the new one is
complete. A checkpoint is assembled by every rank in one temporary folder and renamed whole by
utils/checkpoint/manager.py.
"""

import contextlib
import difflib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

WRITE_PROBE_PREFIX = ".write_probe_"  # write_problem's test file, removed at once


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _replace(source: str, destination: str) -> None:
    """Rename `source` over `destination`, file or folder. A folder being replaced is first moved aside,
    so that until the rename `destination` still holds the old complete version."""
    if not os.path.isdir(destination):
        os.replace(source, destination)
        return
    old = f"{destination}.old"
    _remove(old)
    os.replace(destination, old)
    os.replace(source, destination)
    shutil.rmtree(old)


def tmp_path(path: str | os.PathLike) -> str:
    """Where `atomic_path` writes `path`'s content before it is renamed into place."""
    return f"{os.fspath(path)}.tmp"


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path to write `path`'s content to (a file, or a folder the caller creates); it
    replaces `path` when the block ends without an error and is removed when it raises."""
    path = os.fspath(path)
    tmp = tmp_path(path)
    _remove(tmp)  # left by a write that crashed
    try:
        yield tmp
        _replace(tmp, path)
    finally:
        _remove(tmp)


def write_json(path: str | os.PathLike, obj) -> None:
    """`obj` as indented JSON, atomically."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def disk_bytes(path: str) -> int:
    """Size of a file, or of every file under a folder."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def closest_folder(path: str | os.PathLike, holding: str | None = None) -> str | None:
    """For a folder that does not exist: the existing folder whose path is closest to it, component by component
    (a typo: data/sampel -> data/sample, output/hf_model -> outputs/hf_model), and that holds the file `holding`
    when given; else None."""
    path = os.path.normpath(os.path.expanduser(path))
    parts = path.split(os.sep)
    found = [parts[0] or os.sep] if os.path.isabs(path) else []  # '/a/b' splits into '', 'a', 'b'
    for part in parts[1:] if found else parts:
        here = os.path.join(*found) if found else "."
        if not os.path.isdir(os.path.join(here, part)):
            try:
                folders = [entry.name for entry in os.scandir(here) if entry.is_dir()]
            except OSError:
                return None
            close = difflib.get_close_matches(part, folders, n=1)
            if not close:
                return None
            part = close[0]
        found.append(part)
    candidate = os.path.join(*found)
    if candidate == path or (holding and not os.path.isfile(os.path.join(candidate, holding))):
        return None
    return candidate


def nearest_existing(path: str | os.PathLike) -> str:
    """`path`, or its nearest parent that exists (where a file or folder made at `path` would land)."""
    path = os.fspath(path)
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return path or "."


def free_bytes(path: str) -> int | None:
    """Free space of the file system that holds `path` (or its nearest existing parent), None if unknown."""
    try:
        return shutil.disk_usage(nearest_existing(path)).free
    except OSError:
        return None


def write_problem(folder: str | os.PathLike) -> str | None:
    """Why this process cannot write in `folder` (its nearest existing parent, where the folder would be created),
    or None. A real write, not `os.access`, which a full quota and an NFS server's root squashing pass: a file
    created, written, synced, renamed and removed (a few ms). Nothing is left."""
    where = nearest_existing(folder)
    probe = os.path.join(where, f"{WRITE_PROBE_PREFIX}{os.getpid()}_{secrets.token_hex(4)}")
    renamed = f"{probe}.renamed"
    try:
        descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(descriptor, b"probe")
            os.fsync(descriptor)  # where a network file system or a quota says no
        finally:
            os.close(descriptor)
        os.replace(probe, renamed)  # what atomic writes and checkpoint saves do
        os.remove(renamed)
    except OSError as err:
        for leftover in (probe, renamed):
            with contextlib.suppress(OSError):
                os.remove(leftover)
        return err.strerror or str(err)
    return None


def writable(folder: str | os.PathLike) -> bool:
    """Whether this process can create files in `folder`, or create it (its nearest existing parent): probed by
    a real write (write_problem)."""
    return write_problem(folder) is None
