"""T5_training.py whose checkpoint of step SLOW_STEP takes minutes to write: DCP's file writer touches the
file WRITE_MARKER, then sleeps before writing that checkpoint's shards (in the background thread with
--async_checkpoint true), so that a test can SIGKILL the run while the write is under way. Used by
tests/test_async_checkpoint.py; the product has no test hooks.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.distributed.checkpoint import filesystem  # noqa: E402

_real_write_data = filesystem._FileSystemWriter.write_data


def _slow_write_data(self, plan, planner):
    if f"step_{int(os.environ['SLOW_STEP']):08d}" in str(self.path):
        Path(os.environ["WRITE_MARKER"]).touch()
        time.sleep(600)
    return _real_write_data(self, plan, planner)


filesystem._FileSystemWriter.write_data = _slow_write_data

import T5_training  # noqa: E402

if __name__ == "__main__":
    sys.exit(T5_training.main())
