"""SIGTERM (what SLURM and Kubernetes send before killing a job) turns into "save, then stop".

The handler only sets a flag; the ranks agree on it at the next step-log flush, which already is a
collective (utils/train/step_log.py), so noticing costs no extra synchronisation. The reaction time is at
most log_every_n_steps steps plus the time of one checkpoint: keep it within the scheduler's grace period
(SLURM's KillWait, 30 s by default; torchrun waits 30 s before SIGKILL when it forwards the signal).
"""

import signal

from utils.log import get_logger


class StopRequest:
    """Installs a SIGTERM handler for its lifetime; `requested` tells whether the signal came."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, signum, _frame) -> None:
        if not self.requested:
            get_logger().warning(
                "received %s: saving a checkpoint at the next step boundary (or evaluation batch), then stopping",
                signal.Signals(signum).name,
            )
        self.requested = True

    def __enter__(self) -> "StopRequest":
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGTERM, self._previous)
