"""SIGTERM (what SLURM and Kubernetes send before killing a job) and Ctrl-C (SIGINT) turn into "save, then stop".

`StopRequest` is the run's one owner of both signals, entered before loading and left after the checkpoint
manager's close. Until training starts (loading, `--evaluate_only`, a finished run resumed, which only
exports) it installs nothing: the signals end the process at once, with nothing to lose. From the first
training step on they are a stop request.

The handler only sets a flag; the ranks agree on it at the next step-log flush, which already is a
collective (utils/train/step_log.py), so noticing costs no extra synchronisation. The reaction time is at
most log_every_n_steps steps plus the time of one checkpoint: keep it within the scheduler's grace period
(SLURM's KillWait, 30 s by default; torchrun waits 30 s before SIGKILL when it forwards a signal).

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

from utils.log import get_logger

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SAID_IN_TRAINING = "received %s: saving a checkpoint at the next step boundary (or evaluation batch), then stop%s"
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
        self._previous: dict = {}

    def _handle(self, signum, _frame) -> None:
        if self.interrupted:
            raise KeyboardInterrupt  # a second Ctrl-C (torchrun forwards it as SIGTERM): stop at once
        name, ctrl_c = signal.Signals(signum).name, signum == signal.SIGINT
        if not self.requested or ctrl_c:  # said once, and again for a Ctrl-C: what a second one would do
            again = " (Ctrl-C again stops at once, without saving)" if ctrl_c else ""
            get_logger().info(SAID_AT_THE_END if self.training_over else SAID_IN_TRAINING, name, again)
        self.interrupted = ctrl_c
        if not self.requested:
            self.name = name
        self.requested = True

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
