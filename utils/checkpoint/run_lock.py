"""One run per output_dir: rank 0 holds an exclusive lock on output_dir/run.lock for the run's whole life
(docs/checkpoints.md: one run per output_dir).

    with claimed_output_dir(output_dir):   # collective; a second run into the folder stops here
        ...

The lock is the operating system's (`flock`), released when its process ends however it ends; without working
locks the check falls back to the holder's record, which can tell a live run only on the same host. Then every
rank probes each folder of output_dir the run will write (`check_writable`), at start, not at the first save.
"""

import contextlib
import errno
import json
import os
import socket
import sys
from datetime import datetime, timezone

import torch.distributed as dist

from configs.errors import ConfigError
from utils.base import layout
from utils.base.files import nearest_existing, write_problem
from utils.base.log import get_logger
from utils.checkpoint.start import OUTPUT_DIR_USE, prepare_output_dir, unwritable_folder
from utils.distributed.process_group import rank0_decides

try:
    import fcntl
except ImportError:  # Windows: no flock; the holder's record is all there is
    fcntl = None


class RunLock:
    """output_dir/run.lock, held (on rank 0) while a run writes into output_dir."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, layout.RUN_LOCK_FILE)
        self.file = None
        self.created_folder = False
        self.record: dict | None = None  # what rank 0 wrote into the lock file

    def acquire(self) -> None:
        """Take the lock, or raise ConfigError naming the live run that holds it."""
        self.created_folder = not os.path.exists(self.output_dir)
        prepare_output_dir(self.output_dir)
        file = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held until release()
        locked = _try_flock(file)
        previous = _read_holder(file)
        if locked is False or (locked is None and previous and _alive_here(previous)):
            file.close()
            raise ConfigError(
                f"output_dir {self.output_dir!r} is in use by another run ({describe(previous)}): two runs "
                "writing one folder would overwrite each other's checkpoints and metrics. Wait for it to end or "
                "stop it, or choose another --output_dir. Nothing was changed."
            )
        if locked is None:
            get_logger().warning(
                "cannot lock %s (its file system has no working file locks): a second run into this output_dir "
                "would be stopped only on this host",
                self.path,
            )
        if previous:
            get_logger().warning(
                "output_dir's previous run (%s) ended without releasing it (killed?): taking it over",
                describe(previous),
            )
        file.seek(0)
        file.truncate()
        self.record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": sys.argv,
        }
        json.dump(self.record, file)
        file.flush()
        os.fsync(file.fileno())  # on a network file system, what another node reads (check_shared)
        self.file = file

    def release(self) -> None:
        """Empty the record and let go of the lock (closing the file releases it). A folder this run created
        and left holding nothing but the lock (a start refused on bad input) is removed with it."""
        if self.file is None:
            return
        self.file.seek(0)
        self.file.truncate()
        self.file.close()
        self.file = None
        if self.created_folder and os.listdir(self.output_dir) == [layout.RUN_LOCK_FILE]:
            os.remove(self.path)
            os.rmdir(self.output_dir)


@contextlib.contextmanager
def claimed_output_dir(output_dir: str):
    """Hold output_dir for the block. Collective: rank 0 takes the lock, every rank gets its refusal."""
    lock = RunLock(output_dir)
    rank0_decides(lambda: lock.acquire())  # only rank 0 runs it; the others get its ConfigError, if any
    try:
        check_shared(lock)
        yield
    finally:
        lock.release()


def check_shared(lock: RunLock) -> None:
    """Every rank sees the lock file rank 0 has just written, or every rank stops with one message naming those
    that do not: every rank writes into output_dir, and a node-local path would fail only at the first save.
    Collective; nothing on one rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    written = [lock.record]
    dist.broadcast_object_list(written, src=0)
    try:
        with open(lock.path, encoding="utf-8") as f:
            seen = json.load(f) == written[0]
    except (OSError, ValueError):
        seen = False
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (seen, socket.gethostname()))
    blind = [(rank, host) for rank, (ok, host) in enumerate(everyone) if not ok]
    if blind:
        ranks = ", ".join(f"{rank} ({host})" for rank, host in blind)
        raise ConfigError(
            f"output_dir {lock.output_dir!r} is not shared by every node: rank(s) {ranks} do not see the "
            f"{layout.RUN_LOCK_FILE} that rank 0 ({everyone[0][1]}) has just written there. Every rank writes its "
            "part of each checkpoint into output_dir: give a --output_dir on storage that every node mounts at "
            "the same path (NFS, Lustre, GPFS; a relative path is relative to each node's working directory)."
        )


# Each folder check_writable probes, named in its message, with what the run writes there.
OUTPUT_DIR = "output_dir", OUTPUT_DIR_USE
CHECKPOINTS = "the checkpoints folder", "the run saves its checkpoints there"
EXPORT = "the export folder", "the run's model is exported there at the end, replacing it"
EVALUATE_ONLY = "--evaluate_only's folder", "--evaluate_only writes its scores there"


def check_writable(output_dir: str, *, evaluating: bool, saves_checkpoints: bool) -> None:
    """Every rank can write every folder of output_dir the run will write, or every rank stops with one message
    naming the folder, the rank and host that cannot, and the fix. Each rank probes for itself (a node's disk or
    mount can differ) by a real write, where the folder is or will be created. Collective."""
    folders = {output_dir: OUTPUT_DIR}
    if evaluating:
        folders[os.path.join(output_dir, layout.EVALUATE_ONLY_DIR)] = EVALUATE_ONLY
    else:
        if saves_checkpoints:
            folders[layout.checkpoint_root(output_dir)] = CHECKPOINTS
        folders.update(dict.fromkeys((os.path.join(output_dir, name) for name in layout.EXPORT_DIRS), EXPORT))
    probed, found = set(), None
    for folder, kind in folders.items():
        where = nearest_existing(folder)
        if where in probed:
            continue
        probed.add(where)
        problem = write_problem(where)
        if problem is not None:
            found = (folder, where, kind, problem)
            break
    everyone = [(found, socket.gethostname())]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (found, socket.gethostname()))
    failed = next(((rank, seen, host) for rank, (seen, host) in enumerate(everyone) if seen), None)
    if failed is None:
        return
    rank, (folder, where, (name, use), problem), host = failed
    seen_from = f" from rank {rank} (host {host})" if rank else ""
    raise unwritable_folder(name, folder, problem, use, where=where, seen_from=seen_from)


def _try_flock(file) -> bool | None:
    """True: locked; False: another process holds it; None: this file system cannot lock."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None  # ENOLCK, EOPNOTSUPP: no locks here


def _read_holder(file) -> dict | None:
    file.seek(0)
    text = file.read().strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {}


def _alive_here(holder: dict) -> bool:
    """Whether the holder is a live process of this host (what can be told without locks)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(holder: dict | None) -> str:
    if not holder:
        return "holder unknown: it is just starting"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started_at')}"
