"""An exception on one rank ends every rank quickly, with its traceback printed once."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("fail_rank", ["0", "1"])
def test_exception_on_one_rank_ends_all_ranks_with_one_traceback(tmp_path, fail_rank):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", FAIL_RANK=fail_rank, FAIL_STEP="3")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "tests/fault_entry.py",
        "--output_dir",
        str(tmp_path / "run"),
        "--num_train_samples",
        "96",
        "--num_val_samples",
        "24",
        "--dist_timeout_s",
        "30",
    ]
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=LIMIT_S + 60)
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert elapsed < LIMIT_S, f"ranks took {elapsed:.0f} s to stop"
    # The cause, once, with its traceback; torchrun's own launcher traceback (ChildFailedError) aside.
    assert output.count("RuntimeError: injected failure on one rank") == 1, output[-3000:]
    worker_tracebacks = output.count("Traceback") - output.count("ChildFailedError:")
    assert worker_tracebacks == 1, output[-3000:]
