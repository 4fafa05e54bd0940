"""Long work on some ranks that the others wait for without a collective timeout.

    with progress_bounded("checkpoint save"):   # every rank; rank 0 writes model.pt inside, the others nothing
        ...

Inside the block each rank does its own part; at its end every rank waits, not in a collective but on the
process group's store, until every rank has finished its part, for as long as the working ranks show progress: a
thread of each counts what it does (`Work`), and a rank that shows none for --dist_timeout_s is stuck, which
every waiting rank raises as `PeerStalled`, naming it. A rank whose part raised says so on the store, and the
others stop at once (`PeerFailed`). Why, and the alternatives: docs/checkpoints.md#large-models-and-clusters.
"""

import contextlib
import threading
import time
from collections.abc import Iterator

import torch.distributed as dist

from configs.errors import UserError
from policies.private_api import default_store

BEAT_S = 1.0  # how often (at most) a working rank samples what it did, and a waiting rank looks at the beats
# How often a waiting rank looks whether the block is over: every 20 ms for the first seconds (most blocks are
# short, and every rank waits for the last one to see it), then once a beat.
QUICK_LOOK_S, QUICK_WAIT_S = 0.02, 5.0
# CPU seconds per beat that an idle rank's threads spend, which are no progress: the other threads' (torch's own
# and, on rank 0, the store's; 4-13 ms a second measured) and the working thread's (a stopped or blocked one: 0).
CPU_NOISE_S = 0.05
WORKER_NOISE_S = 0.001


class PeerStalled(RuntimeError):
    """Ranks that showed no progress for --dist_timeout_s inside a progress-bounded block (seen by a waiter)."""


class PeerFailed(RuntimeError):
    """Another rank's part of a progress-bounded block raised: its error is printed there, or, where it refused
    an input of its own (a UserError, which ranks other than 0 leave to rank 0 to say), `refusal` holds it."""

    def __init__(self, message: str, refusal: str | None = None):
        super().__init__(message)
        self.refusal = refusal


class Work:
    """What a rank has done so far, as three counts that move while it works: the CPU seconds of the thread that
    does its part (the one that entered the block) and the bytes it has read and written (Linux's per-thread
    /proc counts; 0 elsewhere), and the CPU seconds of the process's other threads (a pool that the part waits
    for), less the sampling thread's own. Not the process's bytes: on rank 0 they include the store's traffic,
    which the waiting ranks' polls make."""

    def __init__(self, worker_ident: int, worker_native_id: int):
        try:
            self.worker_clock: int | None = time.pthread_getcpuclockid(worker_ident)
        except (AttributeError, OSError):  # not on this platform: the process's CPU time stands for it
            self.worker_clock = None
        self.worker_io = f"/proc/self/task/{worker_native_id}/io"

    def sample(self) -> tuple[float, int, float]:
        worker_cpu = time.clock_gettime(self.worker_clock) if self.worker_clock is not None else 0.0
        return worker_cpu, _io_bytes(self.worker_io), time.process_time() - time.thread_time()

    @staticmethod
    def progressed(before: tuple[float, int, float], after: tuple[float, int, float]) -> bool:
        worker_cpu, worker_bytes, others_cpu = (a - b for a, b in zip(after, before, strict=True))
        return worker_cpu > WORKER_NOISE_S or worker_bytes > 0 or others_cpu - worker_cpu > CPU_NOISE_S


def _io_bytes(path: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["rchar"]) + int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return 0


class _Beats(threading.Thread):
    """While a rank does its part: once a beat, adds 1 to the block's beat counter if the rank did some work
    since the last beat (`Work`)."""

    def __init__(self, store, key: str, beat_s: float):
        super().__init__(name="progress-beats", daemon=True)
        self.store, self.key, self.beat_s = store, key, beat_s
        self.work = Work(threading.get_ident(), threading.get_native_id())  # made by the thread doing the part
        self.finished = threading.Event()

    def run(self) -> None:
        before = self.work.sample()
        while not self.finished.wait(self.beat_s):
            now = self.work.sample()
            if Work.progressed(before, now):
                try:
                    self.store.add(self.key, 1)
                except RuntimeError:  # the store is gone with its host: the waiting ranks find out themselves
                    return
            before = now

    def stop(self) -> None:
        self.finished.set()
        self.join()


@contextlib.contextmanager
def progress_bounded(phase: str) -> Iterator[None]:
    """Every rank's part of `phase` inside the block; on leaving it, every rank waits for the others' parts,
    for as long as they show progress (module docstring). Collective: every rank enters the same blocks in the
    same order. Without a process group, or on one rank, a plain block."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    store, rank, world_size = default_store(), dist.get_rank(), dist.get_world_size()
    # Every rank enters the same blocks in the same order, so its own count of them names the shared keys (a
    # count kept in the group's store: a new group starts from zero).
    key = f"progress_bounded/{store.add(f'progress_bounded/entered/{rank}', 1)}"
    timeout_s = store.timeout.total_seconds()  # --dist_timeout_s
    beat_s = min(BEAT_S, timeout_s / 4)  # a beat late by a loaded machine is no stall
    beats = _Beats(store, f"{key}/beats", beat_s)
    beats.start()
    try:
        yield
    except BaseException as err:
        if isinstance(err, UserError):  # said by rank 0 alone: a waiting rank 0 says this rank's
            store.set(f"{key}/refusal", str(err))
        store.set(f"{key}/failed", str(rank))
        store.set(f"{key}/over", "failed")  # wakes the waiting ranks
        raise
    finally:
        beats.stop()
    store.set(f"{key}/done/{rank}", "1")
    if store.add(f"{key}/done", 1) == world_size:  # the last part done: wakes the waiting ranks
        store.set(f"{key}/over", "done")
    # Until the block is over: the store is asked, not waited on (a wait that times out prints a C++ warning).
    started = last_progress = time.monotonic()
    last_beats = -1
    while not store.check([f"{key}/over"]):
        time.sleep(QUICK_LOOK_S if time.monotonic() - started < QUICK_WAIT_S else beat_s)
        seen = int(store.add(f"{key}/beats", 0))
        if seen != last_beats:
            last_beats, last_progress = seen, time.monotonic()
        elif time.monotonic() - last_progress > timeout_s:
            stuck = [str(r) for r in range(world_size) if not store.check([f"{key}/done/{r}"])]
            raise PeerStalled(
                f"rank(s) {', '.join(stuck)} showed no progress (no CPU time, no bytes read or written) for "
                f"{timeout_s:.0f} s (--dist_timeout_s) in {phase}, which the other ranks wait for: stuck (a "
                "stopped process, a hung file system, a deadlock)"
            )
    if store.check([f"{key}/failed"]):
        failed = store.get(f"{key}/failed").decode()
        if store.check([f"{key}/refusal"]):
            refusal = f"rank {failed}: {store.get(f'{key}/refusal').decode()}"
            raise PeerFailed(f"stopped: rank {failed} failed in {phase}: {refusal}", refusal=refusal)
        raise PeerFailed(f"stopped: rank {failed} failed in {phase} (its error is above)")
