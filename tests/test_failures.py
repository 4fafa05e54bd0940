"""An exception on one rank ends every rank quickly, with its traceback printed once."""

import time

import pytest

from tests.launch import torchrun

LIMIT_S = 60


@pytest.mark.slow
@pytest.mark.parametrize("fail_rank", ["0", "1"])
def test_exception_on_one_rank_ends_all_ranks_with_one_traceback(tmp_path, fail_rank):
    args = ["--output_dir", str(tmp_path / "run"), "--num_train_samples", "96", "--num_val_samples", "24"]
    started = time.monotonic()
    done = torchrun(
        [*args, "--dist_timeout_s", "30"],
        script="tests/fault_entry.py",
        timeout=LIMIT_S + 60,
        env={"FAIL_RANK": fail_rank, "FAIL_STEP": "3"},
    )
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert elapsed < LIMIT_S, f"ranks took {elapsed:.0f} s to stop"
    # The cause, once, with its traceback; torchrun's own launcher traceback (ChildFailedError) aside.
    assert output.count("RuntimeError: injected failure on one rank") == 1, output[-3000:]
    worker_tracebacks = output.count("Traceback") - output.count("ChildFailedError:")
    assert worker_tracebacks == 1, output[-3000:]
