"""SIGTERM (what SLURM and Kubernetes send before killing a job) and Ctrl-C (SIGINT) turn into "save, then stop".

`StopRequest` is the run's one owner of both signals, entered before loading and left after the checkpoint
manager's close. Until training starts (loading, `--evaluate_only`, a finished run resumed, which only
exports) it installs nothing: the signals end the process at once, with nothing to lose. From the first
training step on they are a stop request.

The handler only sets a flag; the ranks agree on it by a vote after every optimizer step (`StopVote`), which
waits for nothing: each rank's flag is all-reduced in the background, on a gloo group of its own over host
memory, and read a step later. A request made during step k is saved after step k + 1 (after step k on one
rank, which needs no vote), or sooner where the epoch ends first; during an evaluation, within two of its
batches (utils/distributed/process_group.py: StopCheck). The line the signal prints names that step. The
reaction time is at most two steps plus the time of one checkpoint: keep it within the scheduler's grace
period (SLURM's KillWait, 30 s by default; torchrun waits 30 s before SIGKILL when it forwards a signal).

After training, however it ended, a signal is noted and the run's saves are finished first (the final
export, the trackers' close, a background save's completion): when one rank fails, torchrun sends SIGTERM to
the others 0.1 s after it exits, often while rank 0 still completes a background save, and Python's default
disposition would kill it there. torchrun's SIGKILL, 30 s later, still kills a rank whose shutdown hangs
(a rank blocked inside a collective does not run Python handlers: it waits for that SIGKILL, or for
--dist_timeout_s). torchrun signals each rank's whole process group, so a process the rank started (DCP's
writer) is not covered.

Ctrl-C in a terminal reaches torchrun, which forwards SIGINT to every rank once (each rank runs in a session
of its own, so the terminal does not signal them itself). A second Ctrl-C means "stop now"; torchrun passes
it on as SIGTERM, so after a SIGINT either signal raises KeyboardInterrupt, which the entry point turns into
one line and exit code 130, without saving. (A SIGTERM after a SIGTERM changes nothing: schedulers repeat it.)
"""

import contextlib
import signal
from collections.abc import Iterator

import torch
import torch.distributed as dist

from policies.private_api import default_store
from utils.base.log import get_logger

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SAID_IN_TRAINING = "received %s: saving a checkpoint %s, then stop%s"
UNKNOWN_SAVE_STEP = "at the next step boundary (or evaluation batch)"  # before the first step's vote
SAID_AT_THE_END = "received %s as the run ends: its saves are finished first%s"


class StopRequest:
    """Owns SIGTERM and SIGINT for the run, as a context manager: `watching()` turns them into a request from
    the first training step on, `requested` tells whether one came, `name` which. The handlers that
    `watching()` replaced are back when the owner exits."""

    def __init__(self) -> None:
        self.requested = False
        self.name = "a stop request"  # where another rank received the signal, this one learns only that
        self.interrupted = False  # a Ctrl-C came: the next signal stops at once
        self.training_over = False
        self.save_step: int | None = None  # where training saves a request made now (StopVote, the trainer say)
        self._previous: dict = {}

    def _handle(self, signum, _frame) -> None:
        if self.interrupted:
            raise KeyboardInterrupt  # a second Ctrl-C (torchrun forwards it as SIGTERM): stop at once
        name, ctrl_c = signal.Signals(signum).name, signum == signal.SIGINT
        if not self.requested or ctrl_c:  # said once, and again for a Ctrl-C: what a second one would do
            again = " (Ctrl-C again stops at once, without saving)" if ctrl_c else ""
            if self.training_over:
                get_logger().info(SAID_AT_THE_END, name, again)
            else:
                where = UNKNOWN_SAVE_STEP if self.save_step is None else f"at step {self.save_step}"
                get_logger().info(SAID_IN_TRAINING, name, where, again)
        self.interrupted = ctrl_c
        if not self.requested:
            self.name = name
        self.requested = True

    @contextlib.contextmanager
    def saved_at(self, step: int) -> Iterator[None]:
        """Inside: a request is saved at `step` (an evaluation there is abandoned for it)."""
        before, self.save_step = self.save_step, step
        try:
            yield
        finally:
            self.save_step = before

    def __enter__(self) -> "StopRequest":
        return self

    @contextlib.contextmanager
    def watching(self) -> Iterator["StopRequest"]:
        """Training: a signal is a stop request from here on. When the block ends, however it ends, signals
        stay noted, not obeyed, until this owner exits, so the saves still in flight are finished."""
        self._previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        try:
            yield self
        finally:
            self.training_over = True

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


class StopVote:
    """The ranks' agreement on a stop request after every optimizer step, without waiting for it.

    After step k each rank casts its flag in a background all-reduce and reads the sum cast after step k - 1:
    every rank cast that one before it could finish step k's collectives, so reading it waits for no rank's
    training (measured: 0.13 ms a step on 2 CPU ranks, against steps of 0.13-0.19 s). A request made
    during step k is thus agreed after step k + 1 (`lag` 2), by every rank after the same step, since all read
    the same sum. The vote has a gloo group of its own and its flag lives in host memory: a GPU run never waits
    for its device for it, and its one all-reduce per step, cast by every rank in the same order, cannot
    interleave with FSDP's or the step log's collectives on the default group. One rank needs no vote: its own
    flag is read after the step it came in (`lag` 1, no group).
    """

    def __init__(self, world_size: int) -> None:
        # The default group's timeout (--dist_timeout_s) also bounds a vote a failed peer never cast.
        self.group = (
            dist.new_group(backend="gloo", timeout=default_store().timeout, group_desc="stop_vote")
            if world_size > 1
            else None
        )
        self.lag = 2 if self.group is not None else 1
        self.pending: tuple[dist.Work, torch.Tensor] | None = None  # the vote cast after the last step, unread

    def after_step(self, request: StopRequest, step: int, last_step: int) -> bool:
        """Cast this rank's vote on `request` after optimizer step `step` and read the one cast a step before:
        True on every rank, after the same step, once any rank was asked to stop. Collective on the vote's
        group."""
        self.expect(request, step, last_step)  # before the flag is read: a signal in between is saved sooner
        if self.group is None:
            return request.requested
        agreed = self.settle()
        flag = torch.tensor([float(request.requested)])
        self.pending = dist.all_reduce(flag, group=self.group, async_op=True), flag
        return agreed

    def expect(self, request: StopRequest, step: int, last_step: int) -> None:
        """Tell `request` where a signal from now on, after step `step`, is saved: `lag` steps later, or at
        `last_step` (where the pass ends, which saves anyway) if sooner."""
        request.save_step = min(step + self.lag, last_step)

    def settle(self) -> bool:
        """Wait for the vote in flight, if any, and say whether it agreed on a stop. Every rank cast it a step
        ago. Settled at a pass's end, no vote is left in flight over the epoch's evaluation and checkpoint or the
        group's end (the periodic ones inside a pass run beside one, on the default group; the peers of a rank
        that failed leave theirs to the group's end: that rank's exit, or the group's timeout, ends it)."""
        if self.pending is None:
            return False
        (work, flag), self.pending = self.pending, None
        work.wait()
        return flag.item() > 0
