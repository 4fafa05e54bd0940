"""T5_training.py with a fault injected on one rank: `train_step` raises on rank FAIL_RANK at step FAIL_STEP.

With CLOSE_UNTIL_SIGNALLED, rank 0, as it closes its metrics after training (where W&B's and MLflow's close
make network calls), before the checkpoint manager completes a background save, goes on closing until a stop
signal has reached it (at most CLOSE_WAIT_S): torchrun's SIGTERM, sent 0.1 s after the failing rank exits,
then comes before rank 0 has completed that save, however fast or loaded the machine. (It may come earlier,
while rank 0 leaves training: rank 0 learns of the failure as the failing rank's exit closes its
connections.)

Used by tests/test_failures.py through torchrun; the product has no test hooks of its own.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import utils.observe.metrics as metrics  # noqa: E402
import utils.train.preemption as preemption  # noqa: E402
import utils.train.trainer as trainer  # noqa: E402

CLOSE_WAIT_S = 120  # far above torchrun's SIGTERM, 0.1 s after the failing rank exits

_real_train_step = trainer.train_step
_calls = {"n": 0}


def _failing_train_step(*args, **kwargs):
    _calls["n"] += 1
    if os.environ["RANK"] == os.environ["FAIL_RANK"] and _calls["n"] == int(os.environ["FAIL_STEP"]):
        raise RuntimeError("injected failure on one rank")
    return _real_train_step(*args, **kwargs)


trainer.train_step = _failing_train_step

_real_handle = preemption.StopRequest._handle
_signalled = {"yes": False}


def _noted_handle(self, *args, **kwargs):
    _signalled["yes"] = True
    return _real_handle(self, *args, **kwargs)


preemption.StopRequest._handle = _noted_handle

_real_close = metrics.MetricsWriter.close


def _close_until_signalled(self, *args, **kwargs):
    if os.environ["RANK"] == "0" and os.environ.get("CLOSE_UNTIL_SIGNALLED") == "1":
        deadline = time.monotonic() + CLOSE_WAIT_S
        while not _signalled["yes"] and time.monotonic() < deadline:
            time.sleep(0.05)  # the handler runs between these sleeps
    return _real_close(self, *args, **kwargs)


metrics.MetricsWriter.close = _close_until_signalled

import T5_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(T5_training.main())
