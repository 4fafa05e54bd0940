"""SIGTERM (what SLURM and Kubernetes send before killing a job) and Ctrl-C (SIGINT) turn into "save, then stop".

The handler only sets a flag; the ranks agree on it at the next step-log flush, which already is a
collective (utils/train/step_log.py), so noticing costs no extra synchronisation. The reaction time is at
most log_every_n_steps steps plus the time of one checkpoint: keep it within the scheduler's grace period
(SLURM's KillWait, 30 s by default; torchrun waits 30 s before SIGKILL when it forwards a signal).

Ctrl-C in a terminal reaches torchrun, which forwards SIGINT to every rank once (each rank runs in a session
of its own, so the terminal does not signal them itself). A second Ctrl-C means "stop now"; torchrun passes
it on as SIGTERM, so after a SIGINT either signal raises KeyboardInterrupt, which the entry point turns into
one line and exit code 130, without saving. (A SIGTERM after a SIGTERM changes nothing: schedulers repeat it.)
"""

import signal

from utils.log import get_logger

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Installs SIGTERM and SIGINT handlers for its lifetime; `requested` tells whether one came, `name`
    which."""

    def __init__(self) -> None:
        self.requested = False
        self.name = "a stop request"  # where another rank received the signal, this one learns only that
        self._previous: dict = {}

    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.requested and self.name == "SIGINT":
            raise KeyboardInterrupt  # a second Ctrl-C (torchrun forwards it as SIGTERM): stop at once
        if not self.requested:
            again = " (Ctrl-C again stops at once, without saving)" if signum == signal.SIGINT else ""
            get_logger().info(
                "received %s: saving a checkpoint at the next step boundary (or evaluation batch), then stop%s",
                name,
                again,
            )
            self.name = name
        self.requested = True

    def __enter__(self) -> "StopRequest":
        self._previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
