"""Folders built once per machine and shared by every process: the memory-mapped data cache.

Eight ranks on a node (and any other run started on the same files) need the same splits and token ids.
Building them is expensive (minutes for the real 600 MB wikihowAll.csv); reading the result is not,
because every process memory-maps the same files and the OS page cache holds them once.

`shared_folder` returns the folder `<cache_dir>/<name>-<digest of key and CACHE_FORMAT>`, building it first
when it is missing or damaged, unless the caller's `reuse` finds another complete folder that serves (a
token cache of more rows). A complete folder is never changed (only a damaged one is replaced), so a
process reading it is never pulled from under:

* **One builder per machine.** Only the process with LOCAL_RANK 0 builds, under a file lock next to the
  folder, so that two runs started together on one machine, or the nodes of a job that share a file system
  with working locks, build it once between them. The other ranks wait for a complete folder to appear (the
  one named by the key, or one that `reuse` accepts): a wait on the file system, with no collective whose
  timeout could fire while the builder works (the trap of a `main_process_first` barrier on a large file).
  The ranks of other nodes, done with their own cache, wait for the builders by their progress
  (T5_training.py reads the data in a `progress_bounded` block), not for --dist_timeout_s.
* **Complete or absent.** The builder writes into `<folder>.partial-<host>-<pid>` and renames it into place
  only after writing a manifest that records the key and the size of every Arrow file. A build killed
  half-way leaves its partial folder, which the next builder on that host reports and removes. A folder
  whose manifest is missing or unreadable, made from another key, or whose files do not have the recorded
  sizes (truncated or deleted since) is damaged: it is reported and rebuilt, never used. Content inside a
  file of the right size is not checksummed (that would read the whole cache at every start). Should two
  builders race all the same (a file system whose locks do not reach other nodes), the second to finish
  finds the folder complete and keeps it, its own build discarded.
* **A failed build ends the waiting ranks too.** The builder's error is written to `<folder>.failed`; the
  waiting ranks raise it instead of waiting for a folder that will not come. A bad-input error (DataError)
  stands for the same key in later runs too (the key holds the input's fingerprint, so a fixed input gets
  a new folder name); any other failure (a full disk) only for the ranks that were waiting when it happened.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from configs.errors import DataError
from utils.base.files import write_json, write_problem
from utils.base.log import get_logger

MANIFEST = "manifest.json"
# Bump when the layout of a cache folder changes: it is in every folder's name, so older folders are left
# alone (other checkouts may still use them) and new ones built beside them.
CACHE_FORMAT = 1
# How often a waiting process says it is still waiting.
_WAIT_REPORT_S = 60.0

Reuse = Callable[[], tuple[Path, dict] | None]


def is_folder_builder() -> bool:
    """Whether this process builds shared folders: LOCAL_RANK 0 (one per node), or a process outside torchrun."""
    return int(os.environ.get("LOCAL_RANK", 0)) == 0


def folder_for(cache_dir: Path, name: str, key: dict) -> Path:
    text = json.dumps({**key, "format": CACHE_FORMAT}, sort_keys=True)
    return cache_dir / f"{name}-{hashlib.sha256(text.encode('utf-8')).hexdigest()[:16]}"


def read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def checked_manifest(folder: Path, key: dict | None) -> tuple[dict | None, str | None]:
    """(`folder`'s manifest, None) when the folder can be used for `key` (None: whatever its key), else
    (None, why not). The manifest is read once: what was checked is what is returned."""
    if not folder.is_dir():
        return None, "missing"
    manifest = read_manifest(folder)
    if manifest is None:
        return None, "damaged: it has no readable manifest"
    if key is not None and manifest.get("key") != key:
        return None, "made from other inputs"
    for file_name, size in manifest.get("files", {}).items():
        path = folder / file_name
        if not path.is_file():
            return None, f"damaged: {file_name} is missing"
        if path.stat().st_size != size:
            return None, f"damaged: {file_name} has {path.stat().st_size} bytes, its manifest says {size}"
    return manifest, None


def complete_folders(cache_dir: Path, name: str) -> Iterator[tuple[Path, dict]]:
    """Every complete folder of `name` under cache_dir, with its manifest (for a caller's `reuse`)."""
    for folder in sorted(cache_dir.glob(f"{name}-*")):
        manifest, _ = checked_manifest(folder, None)
        if manifest is not None:
            yield folder, manifest


def shared_folder(
    cache_dir: Path, name: str, key: dict, build: Callable[[Path], dict], what: str, reuse: Reuse | None = None
) -> tuple[Path, dict]:
    """The folder for `key` (or the one `reuse()` finds) and its manifest, built first by
    `build(partial_folder) -> extra manifest fields` when needed (see the module docstring); `what` names
    it in messages."""
    folder = folder_for(cache_dir, name, key)
    found = _ready(folder, key, reuse)
    if found is not None:
        return found
    if not is_folder_builder():
        return _wait_for(folder, key, reuse, what)
    return _build_locked(folder, key, build, what, reuse)


def _ready(folder: Path, key: dict, reuse: Reuse | None) -> tuple[Path, dict] | None:
    manifest, _ = checked_manifest(folder, key)
    if manifest is not None:
        return folder, manifest
    return reuse() if reuse is not None else None


def _build_locked(folder: Path, key: dict, build: Callable[[Path], dict], what: str, reuse: Reuse | None):
    # A real write first (os.access passes a full quota, a squashed root): said here, not by the lock or build
    existed = folder.parent.is_dir()
    problem = write_problem(folder.parent)
    if problem is None:
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            problem = err.strerror
    if problem is not None:
        raise DataError(
            f"cannot {'write' if existed else 'create'} the data cache folder {folder.parent} ({problem}), which "
            f"lacks {what}: point --cache_dir at a writable folder."
        )
    lock = FileLock(str(folder) + ".lock")
    waited = 0.0
    while True:
        try:
            lock.acquire(timeout=_WAIT_REPORT_S)
            break
        except Timeout:
            waited += _WAIT_REPORT_S
            get_logger().info("waiting %.0f s for another process (another run, or another node) that builds %s "
                              "(%s)", waited, what, folder)  # fmt: skip
    try:
        found = _ready(folder, key, reuse)  # built by another process while this one waited
        if found is not None:
            return found
        _, problem = checked_manifest(folder, key)
        if problem != "missing":
            get_logger().warning("%s in %s is %s: building it again", what, folder, problem)
        _remove_unfinished_builds(folder, what)
        failed = Path(str(folder) + ".failed")
        failed.unlink(missing_ok=True)
        partial = Path(f"{folder}.partial-{socket.gethostname()}-{os.getpid()}")
        partial.mkdir()
        started = time.perf_counter()
        try:
            extra = build(partial)
        except BaseException as err:
            _record_failure(failed, err)
            shutil.rmtree(partial, ignore_errors=True)
            raise
        files = {str(path.relative_to(partial)): path.stat().st_size for path in partial.rglob("*.arrow")}
        manifest = {"key": key, "files": files, **extra}
        write_json(partial / MANIFEST, manifest)
        winner, _ = checked_manifest(folder, key)
        if winner is not None:  # built meanwhile where the lock does not reach (another node's): theirs is kept
            shutil.rmtree(partial, ignore_errors=True)
            return folder, winner
        if folder.exists():
            shutil.rmtree(folder)  # damaged: no process can be using it
        try:
            os.replace(partial, folder)
        except OSError:  # another builder renamed its own first (locks that do not reach other nodes)
            shutil.rmtree(partial, ignore_errors=True)
            winner, _ = checked_manifest(folder, key)
            if winner is None:
                raise
            return folder, winner
        get_logger().info("built %s in %.1f s: %s", what, time.perf_counter() - started, folder)
        return folder, manifest
    finally:
        lock.release()


def _remove_unfinished_builds(folder: Path, what: str) -> None:
    """Partial folders of this host whose builder is gone (killed half-way); other hosts' are left alone
    (their builders may still be running where locks do not reach)."""
    host = socket.gethostname()
    for partial in folder.parent.glob(f"{folder.name}.partial-{host}-*"):
        pid = int(partial.name.rsplit("-", 1)[1])
        if not _is_running(pid):
            get_logger().warning(
                "found %s, left by a build of %s that did not finish (killed?): removing it and building again",
                partial,
                what,
            )
            shutil.rmtree(partial, ignore_errors=True)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _record_failure(failed: Path, err: BaseException) -> None:
    """`<folder>.failed` for the ranks waiting on the folder (written whole, then renamed: never read half)."""
    record = {"message": str(err) if isinstance(err, DataError) else f"{type(err).__name__}: {err}",
              "bad_input": isinstance(err, DataError)}  # fmt: skip
    write_json(failed, record)


def _wait_for(folder: Path, key: dict, reuse: Reuse | None, what: str) -> tuple[Path, dict]:
    """Wait for LOCAL_RANK 0 to build `folder` (or to find one `reuse` accepts): no collective, so no
    timeout however long the build takes."""
    started = time.time()
    failed = Path(str(folder) + ".failed")
    next_report = _WAIT_REPORT_S
    while True:
        found = _ready(folder, key, reuse)
        if found is not None:
            return found
        try:
            failure, failed_at = json.loads(failed.read_text(encoding="utf-8")), failed.stat().st_mtime
        except (OSError, ValueError):  # none, or removed by a builder that tries again
            failure = None
        if failure is not None and (failure["bad_input"] or failed_at >= started):
            raise DataError(
                failure["message"] if failure["bad_input"] else f"building {what} failed: {failure['message']}"
            )
        waited = time.time() - started
        if waited >= next_report:
            get_logger().info("waiting %.0f s for LOCAL_RANK 0 to build %s (%s)", waited, what, folder)
            next_report += _WAIT_REPORT_S
        time.sleep(0.2)
