"""T5_training.py with a stop signal at a known step: each rank named in SIGNAL_RANKS (comma-separated) sends
itself SIGNAL (SIGTERM or SIGINT) as its optimizer step SIGNAL_STEP starts, before its forward, as torchrun
forwards a scheduler's SIGTERM or a terminal's Ctrl-C to every rank while it trains.

Used by tests/test_preemption.py on the pooled ranks; the product has no test hooks of its own.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import utils.train.trainer as trainer  # noqa: E402

_real_train_step = trainer.train_step
_calls = {"n": 0}


def _signalled_train_step(*args, **kwargs):
    _calls["n"] += 1
    signalled = os.environ["RANK"] in os.environ["SIGNAL_RANKS"].split(",")
    if signalled and _calls["n"] == int(os.environ["SIGNAL_STEP"]):
        os.kill(os.getpid(), signal.Signals[os.environ["SIGNAL"]])  # its handler runs before the next line
    return _real_train_step(*args, **kwargs)


trainer.train_step = _signalled_train_step

import T5_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(T5_training.main())
