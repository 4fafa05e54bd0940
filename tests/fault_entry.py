"""T5_training.py with a fault injected on one rank: `train_step` raises on rank FAIL_RANK at step FAIL_STEP.
With CLOSE_DELAY_S, rank 0 waits that long when it closes its metrics after training (where W&B's and
MLflow's close make network calls), before the checkpoint manager completes a background save: long enough
that torchrun's SIGTERM, sent 0.1 s after the failing rank exits, comes in between.

Used by tests/test_failures.py through torchrun; the product has no test hooks of its own.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import utils.observe.metrics as metrics  # noqa: E402
import utils.train.trainer as trainer  # noqa: E402

_real_train_step = trainer.train_step
_calls = {"n": 0}


def _failing_train_step(*args, **kwargs):
    _calls["n"] += 1
    if os.environ["RANK"] == os.environ["FAIL_RANK"] and _calls["n"] == int(os.environ["FAIL_STEP"]):
        raise RuntimeError("injected failure on one rank")
    return _real_train_step(*args, **kwargs)


trainer.train_step = _failing_train_step

_real_close = metrics.MetricsWriter.close


def _slow_close(self, *args, **kwargs):
    if os.environ["RANK"] == "0":
        time.sleep(float(os.environ.get("CLOSE_DELAY_S", "0")))
    return _real_close(self, *args, **kwargs)


metrics.MetricsWriter.close = _slow_close

import T5_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(T5_training.main())
