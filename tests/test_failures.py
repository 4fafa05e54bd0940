"""An exception on one rank ends every rank quickly, with its traceback printed once; a checkpoint still being
written in the background when it happens is finished and completed first, and the run says so."""

import time

import pytest

from tests.launch import torchrun
from tests.reference_run import checkpoint_dir

# The whole run, start-up included, takes about 30 s on 2 idle cores; a rank left waiting for its peer would
# take the collective timeout (--dist_timeout_s, set far above both).
DIST_TIMEOUT_S = 600
LIMIT_S = 200
# FSDP2's background writer process (--async_checkpoint), a save every 2 steps: the failure at step 3 comes
# while step 2's checkpoint may still be on its way to disk.
BACKGROUND_SAVES = ["--checkpoint_type", "SHARDED_STATE_DICT", "--async_checkpoint", "true", "--fsdp_version", "2",
                    "--save_every_n_steps", "2", "--log_every_n_steps", "1"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("fail_rank", ["0", "1"])
def test_exception_on_one_rank_ends_all_ranks_with_one_traceback(tmp_path, fail_rank):
    output_dir = tmp_path / "run"
    args = ["--output_dir", str(output_dir), "--num_train_samples", "96", "--num_val_samples", "24",
            *BACKGROUND_SAVES]  # fmt: skip
    started = time.monotonic()
    done = torchrun(
        [*args, "--dist_timeout_s", str(DIST_TIMEOUT_S)],
        script="tests/fault_entry.py",
        timeout=LIMIT_S + 60,
        # When rank 1 fails, torchrun's SIGTERM reaches rank 0 before it has completed step 2's save: its
        # metrics' close (a tracker's network calls) lasts until the signal comes.
        env={"FAIL_RANK": fail_rank, "FAIL_STEP": "3", "CLOSE_UNTIL_SIGNALLED": "1" if fail_rank == "1" else "0"},
    )
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert elapsed < LIMIT_S, f"ranks took {elapsed:.0f} s to stop"
    # The cause, once, with its traceback; torchrun's own launcher traceback (ChildFailedError) aside.
    assert output.count("RuntimeError: injected failure on one rank") == 1, output[-3000:]
    worker_tracebacks = output.count("Traceback") - output.count("ChildFailedError:")
    assert worker_tracebacks == 1, output[-3000:]
    # The background save was not lost with the run: completed, and said once.
    assert (checkpoint_dir(output_dir, 2) / "train_state.json").is_file(), output[-3000:]
    said = f"the background save of {checkpoint_dir(output_dir, 2)} was completed before stopping"
    assert output.count(said) == 1, output[-3000:]
    if fail_rank == "1":  # torchrun's SIGTERM reached rank 0 before it had finished, and waited for the save
        # As a rule after training ("as the run ends"); or while rank 0 leaves training, which it does as rank 1's
        # exit closes the connections, 0.1 s before the signal (tests/test_run_safety.py tests each message).
        signal_noted = "[rank 0] INFO received SIGTERM"
        noted = [line.partition("[rank 0] INFO ")[2] for line in output.splitlines() if signal_noted in line]
        assert len(noted) == 1, output[-3000:]
        ending, leaving = "received SIGTERM as the run ends: its saves", "received SIGTERM: saving a checkpoint"
        assert noted[0].startswith((ending, leaving)), noted
