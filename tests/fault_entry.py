"""T5_training.py with a fault injected on one rank: `train_step` raises on rank FAIL_RANK at step FAIL_STEP.

Used by tests/test_failures.py through torchrun; the product has no test hooks of its own.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import utils.train.trainer as trainer  # noqa: E402

_real_train_step = trainer.train_step
_calls = {"n": 0}


def _failing_train_step(*args, **kwargs):
    _calls["n"] += 1
    if os.environ["RANK"] == os.environ["FAIL_RANK"] and _calls["n"] == int(os.environ["FAIL_STEP"]):
        raise RuntimeError("injected failure on one rank")
    return _real_train_step(*args, **kwargs)


trainer.train_step = _failing_train_step

import T5_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(T5_training.main())
