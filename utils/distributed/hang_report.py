"""Hang reports: where each rank was when a collective did not complete within --dist_timeout_s.

Inside `reported_hangs`, a collective's timeout makes the rank that waited write
output_dir/hang_reports/rank_<r>_<time>.txt (the error; the step and phase the loop last entered, `WHERE`; the
flight recorder's last collectives; every thread's Python stack), and the error becomes `CollectiveTimedOut`,
whose one line names the file. A rank that is itself stuck cannot write; the others' reports show which
collective they waited for it in. NCCL's watchdog dumps the flight recorder (`record_collectives`) and takes
the process down itself. What a report holds, how to read it, and its cost: docs/observability.md#hang-reports.
"""

import contextlib
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator, MutableMapping

import torch.distributed as dist

from configs.errors import FAILURES, error_chain, error_summary
from policies.private_api import flight_recorder_dump
from utils.base import files, layout
from utils.distributed.progress_bounded import PeerStalled

# How a wait that outlived the process group's timeout is worded: gloo's send and recv ("Timed out waiting
# 10000ms for recv operation to complete"), NCCL's watchdog ("Watchdog caught collective operation timeout: ...
# ran for 600011 milliseconds before timing out"), the store's wait and barrier ("wait timeout after 10000ms"),
# monitored_barrier. Not "timed out" alone: a hub download's "Read timed out" is no hang of the group.
TIMEOUT_PHRASES = re.compile(
    r"Timed out waiting \d+ms|collective operation timeout|before timing out|wait timeout after \d+ms"
    r"|barrier timeout after \d+ms|timed out in monitoredBarrier"
)
REPORTED_COLLECTIVES = 8  # the newest flight-recorder entries a report lists

# The flight recorder's settings, each by its name since torch 2.9 and the older one it still reads (and warns
# about): the package sets only the current name, and none where the user set either.
BUFFER_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DUMP_ON_TIMEOUT = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)
DUMP_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
BUFFER_ENTRIES = "2000"


class Position:
    """Where this rank is: the step and the phase the training loop last entered, and since when. Plain
    attribute writes, no collective, no sync: cheap enough for every micro-batch."""

    def __init__(self):
        self.step: int | None = None
        self.phase = "setup"
        self.since = time.monotonic()

    def enter(self, phase: str, step: int | None = None) -> None:
        self.phase, self.since = phase, time.monotonic()
        if step is not None:
            self.step = step

    def describe(self) -> str:
        step = "before the first step" if self.step is None else f"step {self.step}"
        return f"{step}, {self.phase} (for {time.monotonic() - self.since:.1f} s)"


WHERE = Position()  # this process's; the training loop, validation, generation and saves update it


class CollectiveTimedOut(RuntimeError):
    """A collective outlived --dist_timeout_s on this rank; the message names the report it wrote."""


def record_collectives(output_dir: str, backend: str, environ: MutableMapping[str, str] = os.environ) -> None:
    """Before the process group forms: torch's flight recorder on, and NCCL's dump of it on a timeout going to
    output_dir/hang_reports/, which exists from now on (a collective may time out before the run has begun;
    `reported_hangs` removes it at the end if it stayed empty); each setting only where the user has set none of
    its names."""
    if device_backend(backend) == "nccl":
        os.makedirs(os.path.join(output_dir, layout.HANG_REPORTS_DIR), exist_ok=True)
    settings = {
        BUFFER_SIZE: BUFFER_ENTRIES,
        DUMP_ON_TIMEOUT: "1",
        DUMP_FILE: layout.flight_recorder_prefix(output_dir),
    }
    for names, value in settings.items():
        if not any(name in environ for name in names):
            environ[names[0]] = value


@contextlib.contextmanager
def reported_hangs(output_dir: str, timeout_s: int) -> Iterator[None]:
    """Inside: a collective that times out writes this rank's report, and its error becomes CollectiveTimedOut.

    NCCL's watchdog writes its dump into the reports' folder (made by `record_collectives`); left empty, the
    folder goes again when the block ends."""
    folder = os.path.join(output_dir, layout.HANG_REPORTS_DIR)
    nccl = dist.is_initialized() and device_backend(dist.get_backend()) == "nccl"
    try:
        yield
    except FAILURES as err:
        if not is_collective_timeout(err):
            raise
        raise CollectiveTimedOut(write_report(err, output_dir, timeout_s)) from err
    finally:
        if nccl:
            with contextlib.suppress(OSError):  # not empty: it holds a report
                os.rmdir(folder)


def is_collective_timeout(err: BaseException | None) -> bool:
    """Whether `err`, or an error it was raised from or while handling, is a wait that outlived the group's
    timeout (a background checkpoint write's CheckpointError carries its cause's text), or a wait for ranks
    that showed no progress for as long (utils/distributed/progress_bounded.py)."""
    for link in error_chain(err):
        if isinstance(link, PeerStalled):
            return True
        if TIMEOUT_PHRASES.search(str(link)) or TIMEOUT_PHRASES.search(error_summary(link)):
            return True
    return False


def device_backend(backend: str) -> str:
    """A process group's backend for the device: "nccl" also where a GPU run's group has a CPU backend beside
    it ("cuda:nccl,cpu:gloo", utils/distributed/process_group.py: group_backend)."""
    return "nccl" if "nccl" in str(backend) else str(backend)


def write_report(err: BaseException, output_dir: str, timeout_s: int) -> str:
    """Write this rank's report of `err`, a collective's timeout; returns the one line that names it. No
    collective: the group is broken."""
    rank, backend = dist.get_rank(), device_backend(dist.get_backend())
    path = layout.hang_report_file(output_dir, rank, layout.time_stamp())
    entries, none_because = recorded_collectives(backend)
    now = time.time_ns()
    text = "\n".join(
        [
            f"Hang report of rank {rank} of {dist.get_world_size()} ({backend}), pid {os.getpid()} on "
            f"{socket.gethostname()}, {time.strftime('%Y-%m-%d %H:%M:%S')}",
            f"error: {type(err).__name__}: {error_summary(err)}",
            f"where: {WHERE.describe()}",
            f"timeout: {timeout_s} s (--dist_timeout_s)",
            "",
            "Last collectives this rank entered (torch's flight recorder, oldest first; gloo leaves every "
            "state at 'scheduled'):",
            *(f"  {describe_collective(entry, now)}" for entry in entries),
            *([] if entries else [f"  {none_because}"]),
            "",
            "Main thread, where the collective timed out (the error's traceback):",
            "".join(traceback.format_exception(err)),
            *thread_stacks(),
        ]
    )
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with files.atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        written = f"Where this rank was: {path}; each other rank that could write has its own in hang_reports/"
    except OSError as write_error:
        written = f"This rank's report could not be written ({write_error})"
    if backend == "nccl":
        written += ", and NCCL's flight recorder its dump (torchfrtrace reads them)"
    if isinstance(err, PeerStalled):
        return f"{err}. {written}."
    last = entries[-1] if entries else {}
    waited = f" in {last.get('profiling_name', '?')} #{last.get('collective_seq_id', '?')}" if last else ""
    return (
        f"a collective did not complete within {timeout_s} s (--dist_timeout_s): this rank waited{waited} at "
        f"{WHERE.describe()}; another rank is hung, stopped or far behind. {written}."
    )


def recorded_collectives(backend: str) -> tuple[list[dict], str]:
    """The newest collectives of this process as the flight recorder holds them, oldest first; and, where there
    are none, why."""
    try:
        dump = flight_recorder_dump(backend)
    except (RuntimeError, ValueError) as err:  # the dump failed, or was no JSON
        return [], f"(the flight recorder could not be read: {err})"
    if dump is None:
        return [], "(this torch has no flight recorder to read)"
    if "entries" not in dump:
        return [], f"(the flight recorder is off: {BUFFER_SIZE[0]}=0)"
    entries = sorted(dump["entries"], key=lambda entry: entry.get("record_id", 0))
    return entries[-REPORTED_COLLECTIVES:], "(none recorded)"


def describe_collective(entry: dict, now_ns: int) -> str:
    """One flight-recorder entry: '#57 gloo:all_gather on default_pg, inputs [[4096]] Float, scheduled, entered
    10.2 s ago (thread python3)'."""
    group = entry.get("process_group") or ["?", ""]
    age = (now_ns - entry["time_created_ns"]) / 1e9 if "time_created_ns" in entry else float("nan")
    return (
        f"#{entry.get('collective_seq_id', '?')} {entry.get('profiling_name', '?')} on {group[-1] or group[0]}, "
        f"inputs {entry.get('input_sizes', '?')} {' '.join(entry.get('input_dtypes', []))}, "
        f"{entry.get('state', '?')}, entered {age:.1f} s ago (thread {entry.get('thread_name', '?')})"
    )


def thread_stacks() -> list[str]:
    """Every other thread's Python stack, by name (the calling thread's would show only this report)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return [
        f"Thread {names.get(ident, '?')} ({ident}):\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
        if ident != threading.get_ident()
    ]
