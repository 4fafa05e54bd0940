"""--max_steps N as HF means it: the run's length in optimizer steps whatever --epochs says. On the embedded
tiny T5 and a tiny random Llama (2 pooled CPU ranks, fp32): a run of 8 steps over epochs of 3 takes 2 epochs
and 2 steps of a third, says so at start (and that the --epochs given beside it is left aside), spans its
cosine schedule over the 8 steps and ends with the normal evaluation, checkpoint and export at step 8; stopped
by SIGTERM mid-way and resumed with --resume true alone, it keeps N and ends with the same losses and rates;
the control without --max_steps trains its one epoch as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.make_tiny_family import make
from tests.launch import pooled
from tests.reference_run import complete_checkpoint_steps, read_records, step_lrs
from utils.train.optim import lr_factor

STEPS, STEPS_PER_EPOCH, WARMUP, LR = 8, 3, 2, 0.002  # 24 rows on 2 ranks in batches of 4: 3 steps an epoch
SIGNAL_STEP, SAVED_AT = 4, 5  # SIGTERM as step 4 starts, saved at step 5 (tests/test_preemption.py: 2 ranks)
RUN = ["--epochs", "1", "--num_train_samples", "24", "--num_val_samples", "4", "--eval_rouge", "false",
       "--max_source_length", "64", "--max_target_length", "16", "--mixed_precision", "false",
       "--log_every_n_steps", "1", "--lr_scheduler", "cosine", "--warmup_steps", str(WARMUP),
       "--save_every_n_steps", "1000"]  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, list[str]]:
    """The --model_name flags of each model: the embedded tiny T5 (the default), a tiny random Llama."""
    llama = tmp_path_factory.mktemp("llama") / "llama"
    make("llama", str(llama))
    return {"t5": [], "llama": ["--model_name", str(llama)]}


def step_losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(output_dir) if r["type"] == "step"}


def epoch_losses(output_dir: Path) -> dict[int, float]:
    return {r["epoch"]: r["val_loss"] for r in read_records(output_dir) if r["type"] == "epoch"}


def cosine_rates(total: int) -> dict[int, float]:
    """The rate of each step of a run of `total` steps (LambdaLR's factor before the step's scheduler.step())."""
    return {step: LR * lr_factor(step - 1, "cosine", WARMUP, total) for step in range(1, total + 1)}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["t5", "llama"])
def test_max_steps_beyond_the_epochs_runs_them_and_resumes_exactly(tmp_path, models, model):
    args = [*RUN, *models[model]]
    whole = tmp_path / "whole"
    run = pooled([*args, "--max_steps", str(STEPS), "--output_dir", str(whole)])
    assert run.returncode == 0, run.describe()
    for line in (
        "INFO --epochs 1 is left aside: --max_steps 8 is the run's length in optimizer steps, over as many epochs "
        "as it takes (HF's meaning)",
        "INFO --max_steps 8: 8 steps = 2 epochs + 2 (3 optimizer steps an epoch; the last epoch partial), "
        "whatever --epochs says",
        "INFO training steps 1-8, from epoch 1 of 3",
        "INFO training ends: --max_steps 8 reached",
    ):
        assert line in run.output, run.describe()
    losses = step_losses(whole)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert step_lrs(whole) == pytest.approx(cosine_rates(STEPS), rel=1e-6)  # the schedule spans the 8 steps
    assert sorted(epoch_losses(whole)) == [1, 2, 3]  # the partial third epoch evaluated as a normal end
    assert complete_checkpoint_steps(whole)[-1] == STEPS and (whole / "hf_model" / "config.json").is_file()

    # SIGTERM mid-way (in epoch 2), then --resume true alone: the run keeps --max_steps 8 from its record.
    stopped = tmp_path / "stopped"
    env = {"SIGNAL_STEP": str(SIGNAL_STEP), "SIGNAL_RANKS": "0,1", "SIGNAL": "SIGTERM"}
    run = pooled([*args, "--max_steps", str(STEPS), "--output_dir", str(stopped)], env=env,
                 script="tests/signal_entry.py")  # fmt: skip
    assert run.returncode == 0 and f"stopped at step {SAVED_AT} on SIGTERM" in run.output, run.describe()
    resumed = pooled(["--output_dir", str(stopped), "--resume", "true"])
    assert resumed.returncode == 0, resumed.describe()
    assert "INFO training steps 6-8, from epoch 2 of 3" in resumed.output, resumed.describe()
    assert "left aside" not in resumed.output  # no --epochs given this time
    assert step_losses(stopped) == losses  # exactly: fp32, the same ranks
    assert step_lrs(stopped) == step_lrs(whole) and epoch_losses(stopped) == epoch_losses(whole)

    # The control: without --max_steps, --epochs 1 is the run's length, as before (its schedule spans 3 steps).
    control = tmp_path / "control"
    run = pooled([*args, "--output_dir", str(control)])
    assert run.returncode == 0, run.describe()
    assert "INFO training steps 1-3, from epoch 1 of 1" in run.output and "--max_steps" not in run.output
    assert sorted(step_losses(control)) == [1, 2, 3] and sorted(epoch_losses(control)) == [1]
    assert step_lrs(control) == pytest.approx(cosine_rates(STEPS_PER_EPOCH), rel=1e-6)
