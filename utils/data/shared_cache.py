"""Folders built once per machine and shared by every process: the memory-mapped WikiHow cache.

Eight ranks on a node (and any other run started on the same files) need the same cleaned splits and token
ids. Building them is expensive (minutes for the real 600 MB wikihowAll.csv); reading the result is not,
because every process memory-maps the same files and the OS page cache holds them once.

`shared_folder` returns the folder `<cache_dir>/<name>-<digest of key>`, building it first when it is
missing or damaged. A folder is never changed once complete (only a damaged one is replaced), so a process
that reads it is never pulled from under:

* **One builder per machine.** Only the process with LOCAL_RANK 0 builds, under a file lock next to the
  folder, so that two runs started together on one machine, or the nodes of a job that share a file
  system, build it once between them. The other ranks wait for the folder's manifest to appear: a wait on
  a file, with no collective whose timeout could fire while the builder works (the trap of a
  `main_process_first` barrier on a large file).
* **Complete or absent.** The builder writes into `<folder>.partial` and renames it into place only after
  writing a manifest that records the key and the size of every Arrow file. A build killed half-way leaves the
  `.partial` folder, which the next builder reports and removes. A folder whose manifest is missing or
  unreadable, made from another key, or whose files do not have the recorded sizes (truncated or deleted
  since) is damaged: it is reported and rebuilt, never used. Content inside a file of the right size is
  not checksummed (that would read the whole cache at every start).
* **A failed build ends the waiting ranks too.** A `DataError` of the builder (bad input) is written to
  `<folder>.failed`; the waiting ranks raise it, instead of waiting for a folder that will not come. The
  key holds the input's fingerprint, so a fixed input gets a new folder name and is not refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

from configs.errors import DataError
from utils.files import atomic_path, write_json
from utils.log import get_logger

MANIFEST = "manifest.json"
# Bump when the layout of a cache folder changes: older folders are then rebuilt, not misread.
CACHE_FORMAT = 1
# How often a waiting process says it is still waiting.
_WAIT_REPORT_S = 60.0


def digest(key: dict) -> str:
    """A short stable name for a key (JSON of plain values)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def is_folder_builder() -> bool:
    """Whether this process builds shared folders: LOCAL_RANK 0 (one per node), or a process outside torchrun."""
    return int(os.environ.get("LOCAL_RANK", 0)) == 0


def read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def problem_with(folder: Path, key: dict) -> str | None:
    """Why `folder` cannot be used for `key` (None: it can)."""
    if not folder.is_dir():
        return "missing"
    manifest = read_manifest(folder)
    if manifest is None:
        return "damaged: it has no readable manifest"
    if manifest.get("key") != {**key, "format": CACHE_FORMAT}:
        return "made from other inputs"
    for name, size in manifest.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            return f"damaged: {name} is missing"
        if path.stat().st_size != size:
            return f"damaged: {name} has {path.stat().st_size} bytes, its manifest says {size}"
    return None


def shared_folder(
    cache_dir: Path,
    name: str,
    key: dict,
    build: Callable[[Path], dict],
    what: str,
) -> tuple[Path, dict]:
    """The folder for `key` and its manifest, built first by `build(partial_folder) -> extra manifest fields`
    when needed (see the module docstring); `what` names it in messages."""
    folder = cache_dir / f"{name}-{digest(key)}"
    if problem_with(folder, key) is None:
        return folder, read_manifest(folder)
    if not is_folder_builder():
        return folder, _wait_for(folder, key, what)
    return folder, _build_locked(folder, key, build, what)


def _build_locked(folder: Path, key: dict, build: Callable[[Path], dict], what: str) -> dict:
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"cannot create the data cache folder {folder.parent} ({err.strerror}): point --cache_dir at a "
            "writable folder."
        ) from None
    lock = FileLock(str(folder) + ".lock")
    waited = 0.0
    while True:
        try:
            lock.acquire(timeout=_WAIT_REPORT_S)
            break
        except Timeout:
            waited += _WAIT_REPORT_S
            get_logger().info("waiting %.0f s for another run that builds %s (%s)", waited, what, folder)
    try:
        problem = problem_with(folder, key)
        if problem is None:  # built by another run while this one waited
            return read_manifest(folder)
        if problem != "missing":
            get_logger().warning("%s in %s is %s: building it again", what, folder, problem)
        partial = Path(str(folder) + ".partial")
        if partial.exists():
            get_logger().warning(
                "found %s, left by a build of %s that did not finish (killed?): removing it and building again",
                partial,
                what,
            )
            shutil.rmtree(partial)
        failed = Path(str(folder) + ".failed")
        failed.unlink(missing_ok=True)
        partial.mkdir()
        started = time.perf_counter()
        try:
            extra = build(partial)
        except DataError as err:
            with atomic_path(failed) as tmp:  # a waiting rank never reads it half-written
                Path(tmp).write_text(str(err), encoding="utf-8")
            shutil.rmtree(partial, ignore_errors=True)
            raise
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        files = {
            str(path.relative_to(partial)): path.stat().st_size for path in partial.rglob("*") if path.is_file()
        }
        manifest = {"key": {**key, "format": CACHE_FORMAT}, "files": files, **extra}
        write_json(partial / MANIFEST, manifest)
        if folder.exists():
            shutil.rmtree(folder)  # damaged: no process can be using it
        os.replace(partial, folder)
        get_logger().info("built %s in %.1f s: %s", what, time.perf_counter() - started, folder)
        return manifest
    finally:
        lock.release()


def _wait_for(folder: Path, key: dict, what: str) -> dict:
    """Wait for LOCAL_RANK 0 to build `folder`: no collective, so no timeout however long the build takes."""
    started = time.time()
    # The same key is the same input, so a recorded failure is this run's too (even one recorded before
    # this process started waiting); a builder removes it before it tries again.
    failed = Path(str(folder) + ".failed")
    next_report = _WAIT_REPORT_S
    while True:
        if problem_with(folder, key) is None:
            return read_manifest(folder)
        if failed.exists():
            raise DataError(failed.read_text(encoding="utf-8"))
        waited = time.time() - started
        if waited >= next_report:
            get_logger().info("waiting %.0f s for LOCAL_RANK 0 to build %s (%s)", waited, what, folder)
            next_report += _WAIT_REPORT_S
        time.sleep(0.2)
