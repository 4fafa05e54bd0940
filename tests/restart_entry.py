"""T5_training.py with one rank SIGKILLed in torchrun's first attempt: on rank KILL_RANK, right after its
KILL_STEP-th optimizer step (as an OOM kill or a node failure would end it), when TORCHELASTIC_RESTART_COUNT
is 0. Restarted attempts run the plain training. Used by tests/test_restarts.py; the product has no test hooks.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import utils.train.trainer as trainer  # noqa: E402

_real_train_step = trainer.train_step
_calls = {"n": 0}


def _train_step_then_die(*args, **kwargs):
    stats = _real_train_step(*args, **kwargs)
    _calls["n"] += 1
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    chosen = os.environ["RANK"] == os.environ["KILL_RANK"] and _calls["n"] == int(os.environ["KILL_STEP"])
    if first_attempt and chosen:
        os.kill(os.getpid(), signal.SIGKILL)
    return stats


trainer.train_step = _train_step_then_die

import T5_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(T5_training.main())
