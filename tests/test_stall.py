"""A run whose global gradient norm is exactly 0.0 on STALL_STEPS optimizer steps in a row is said to have
stalled, once, with the step (utils/train/step_log.py: StallWatch), and its closing line says a best model
chosen while it was stalled is one; steps with no trained token or a non-finite loss neither count nor break a
row; a healthy run never says it."""

import logging
import math

import pytest

from tests.launch import pooled
from tests.reference_run import read_records
from utils.train.step_log import STALL_STEPS, StallWatch

STALLED = "training has stalled"


def _stall_warnings(log_records, norms: list[float], tokens: list[float] | None = None, flushes: int = 1):
    """(the stall warnings, the stall the watch is in at the end) of steps 1.. with these gradient norms and
    trained tokens, read in `flushes` windows."""
    watch = StallWatch()
    tokens = tokens or [10.0] * len(norms)
    records = [{"step": step, "loss": 7.0, "grad_norm": norm} for step, norm in enumerate(norms, 1)]
    size = math.ceil(len(records) / flushes)
    for start in range(0, len(records), size):
        watch.read(records[start : start + size], tokens[start : start + size])
    said = [record.getMessage() for record in log_records if record.levelno == logging.WARNING]
    return said, watch.stalled_since


def test_a_row_of_zero_norms_is_said_once_with_its_step(log_records):
    said, since = _stall_warnings(log_records, [4.0] + [0.0] * 10, flushes=4)  # a row across flushes
    assert len(said) == 1 and said[0].startswith(f"step {1 + STALL_STEPS}: training has stalled"), said
    assert "exactly 0.0 since step 2" in said[0] and "--lr" in said[0] and "frozen" in said[0]
    assert since == 2


@pytest.mark.parametrize(
    "norms, tokens",
    [
        ([4.0, 0.0, 0.0, 1e-30, 0.0, 0.0], None),  # rows shorter than STALL_STEPS
        ([0.0] * 6, [0.0] * 6),  # no token trained: a zero gradient by construction
        ([3.0, 2.5, 2.0, 1.5, 1.0, 0.5], None),  # the control: a run that learns
    ],
)
def test_no_stall_is_said_without_a_row_of_steps_that_trained(log_records, norms, tokens):
    assert _stall_warnings(log_records, norms, tokens) == ([], None)


def test_steps_without_tokens_or_with_a_non_finite_norm_neither_count_nor_break_a_row(log_records):
    """A skipped NaN step (--on_nonfinite skip, fp16's scaler: its tokens zeroed by step_record) and a step that
    trained on no token sit inside a row of zeros; the row goes on across them. A second stall is said again."""
    norms = [0.0, math.nan, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]
    tokens = [9.0, 0.0, 0.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0]
    said, since = _stall_warnings(log_records, norms, tokens)
    assert [line.split(":")[0] for line in said] == ["step 5", "step 9"], said
    assert "since step 1" in said[0] and since == 7


# The embedded tiny T5 on one rank, 6 steps of 4 samples; --lr 1e6 collapses it after its first step: the loss
# flat at ln(1100) (its vocabulary), every later gradient exactly 0.
SHAPE = ["--epochs", "1", "--num_train_samples", "24", "--num_val_samples", "8", "--eval_rouge", "false",
         "--mixed_precision", "false", "--log_every_n_steps", "2", "--save_every_n_steps", "1000"]  # fmt: skip


@pytest.mark.slow  # two whole runs on a pooled rank (3.5 s)
def test_a_collapsed_run_says_it_stalled_and_a_healthy_one_does_not(tmp_path):
    stalled = pooled([*SHAPE, "--lr", "1e6", "--output_dir", str(tmp_path / "stalled")], nproc=1)
    assert stalled.returncode == 0, stalled.describe()
    norms = [r["grad_norm"] for r in read_records(tmp_path / "stalled") if r["type"] == "step"]
    assert norms[0] > 0 and norms[1:] == [0.0] * 5, norms  # the fault itself, finite throughout
    assert stalled.output.count(STALLED) == 1, stalled.describe()
    said = f"step {1 + STALL_STEPS}: training has stalled: the gradient norm has been exactly 0.0 since step 2"
    assert said in stalled.output, stalled.describe()
    closing = [line for line in stalled.output.splitlines() if "run finished in" in line]
    assert (
        len(closing) == 1
        and "best val_loss 7.0031 (epoch 1, a stalled model: gradient norm 0.0 since step 2)" in (closing[0])
    ), closing

    healthy = pooled([*SHAPE, "--output_dir", str(tmp_path / "healthy")], nproc=1)  # the control: the default --lr
    assert healthy.returncode == 0, healthy.describe()
    assert all(r["grad_norm"] > 0 for r in read_records(tmp_path / "healthy") if r["type"] == "step")
    assert STALLED not in healthy.output and "stalled model" not in healthy.output, healthy.describe()
