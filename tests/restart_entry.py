"""T5_training.py with one rank SIGKILLed once: on rank KILL_RANK, right after its KILL_STEP-th optimizer
step in this process (as an OOM kill or a node failure would end it), if the file KILL_MARKER does not exist
yet (it is created just before). Restarted attempts run the plain training: the marker, not the restart
count, says so, because on several nodes only the failed node counts a restart and ranks may move between
nodes. Used by tests/test_resume.py; the product has no test hooks.
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
    marker = Path(os.environ["KILL_MARKER"])
    chosen = os.environ["RANK"] == os.environ["KILL_RANK"] and _calls["n"] == int(os.environ["KILL_STEP"])
    if chosen and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return stats


trainer.train_step = _train_step_then_die

import T5_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(T5_training.main())
