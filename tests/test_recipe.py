"""The training recipe of the other seeds: gradient accumulation, clipping, LR schedules, step budgets and
dropout override, against unsharded references and through torchrun."""

import contextlib
import json
import math
from pathlib import Path
from unittest import mock

import pytest
import torch

from configs.errors import TrainingDivergedError
from configs.evaluation import EvalConfig
from configs.recipe import RecipeConfig
from configs.training import TrainConfig
from scripts.compare_step_losses import step_losses
from tests.dist_harness import run_ranks
from tests.dist_workers import (
    CPU,
    FP32,
    LR,
    _fsdp_config,
    _split_rows,
    accumulation_reference,
    batch_seed,
    make_batch,
    sharded,
    tiny_t5,
)
from tests.launch import RESTARTING, pooled, torchrun
from utils.spec import SEQ2SEQ
from utils.train import step as step_module
from utils.train.optim import lr_factor, lr_scheduler
from utils.train.step import StepSettings, train_step
from utils.train.step_log import StepLog

STEPS = 3


def accumulation_worker(rank: int, world_size: int, steps: int) -> dict:
    """Per-step losses, gradient norms and final weights of 2 micro-batches of 2 rows accumulated, for each
    backend, gradient-sync mode and clipping setting; the unsharded references on rank 0."""
    from utils.train.step import GRAD_NORM

    out = {"runs": {}, "references": {}}
    for max_norm in (0.0, 0.05):
        if rank == 0:
            out["references"][max_norm] = accumulation_reference(steps, world_size, max_norm)
        for version in (1, 2):
            for sync in (True, False):
                model, parallelism = sharded(tiny_t5(), _fsdp_config({"fsdp_version": version}), FP32)
                optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
                settings = StepSettings(
                    parallelism, max_grad_norm=max_norm, sync_each_micro_batch=sync, spec=SEQ2SEQ
                )
                records: list[dict] = []
                step_log = StepLog(every=steps, on_flush=records.extend)
                for step in range(steps):
                    micro = _split_rows(make_batch(batch_seed(step, rank), rows=4), 2)
                    step_log.add(step + 1, LR, train_step(model, micro, optimizer, None, world_size, settings))
                step_log.flush()
                state = parallelism.full_state_dict(model, CPU)
                out["runs"][(max_norm, version, sync)] = {
                    "losses": [r["loss"] for r in records],
                    "norms": [r["grad_norm"] for r in records],
                    "state": state if rank == 0 else None,
                }
                assert GRAD_NORM == 4
    return out


@pytest.fixture(scope="module")
def accumulated():
    return run_ranks(accumulation_worker, STEPS, timeout_s=300)


@pytest.mark.parametrize("max_norm", [0.0, 0.05])
def test_accumulated_micro_batches_equal_the_unsharded_full_batch(accumulated, max_norm):
    """2 micro-batches of 2 rows on each of 2 ranks = one batch of 8 rows: same token-mean losses, same
    global gradient norm (clip_grad_norm_ of the unsharded model) and same weights, for both backends and
    both gradient-sync modes; with max_norm 0.05 every step is clipped."""
    rank0, rank1 = accumulated
    losses, norms, state = rank0["references"][max_norm]
    if max_norm:
        assert all(norm > max_norm for norm in norms), norms  # the clipping really acted
    for (norm_setting, version, sync), run in rank0["runs"].items():
        if norm_setting != max_norm:
            continue
        where = f"FSDP{version}, sync each micro-batch {sync}, max_norm {max_norm}"
        assert run["losses"] == rank1["runs"][(norm_setting, version, sync)]["losses"], where
        for got, want in zip(run["losses"], losses, strict=True):
            assert got == pytest.approx(want, rel=1e-5), where
        # The first step's norm is of the same weights: equal up to the summation order. Later steps' norms are
        # of weights that AdamW already moved apart by float32 rounding (the state check below): measured up
        # to 2.5e-4 relative at step 3 under FSDP1 without clipping (torch 2.13 CPU), so 1e-3 there.
        assert run["norms"][0] == pytest.approx(norms[0], rel=1e-5), where
        for got, want in zip(run["norms"][1:], norms[1:], strict=True):
            assert got == pytest.approx(want, rel=1e-3), where
        deltas = torch.cat([(run["state"][k] - v).abs().flatten() for k, v in state.items()])
        # Accumulation sums the gradient in another order than the full batch. AdamW divides each gradient by
        # its own running magnitude, so where a gradient is near zero, float32 rounding can change the sign
        # of that element's update: up to 2 x LR per step for that element (measured 7.5e-4 after 3 steps
        # under FSDP1 on this project's CPU; 0.5-1.2e-5 on another). Losses and the first norm above are the
        # tight checks; here no element moves more than those flips allow, and the mean moves far less.
        assert deltas.max().item() < 2 * STEPS * LR, (where, deltas.max().item())
        assert deltas.mean().item() < 1e-6, (where, deltas.mean().item())


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_each_schedule_follows_its_formula(schedule):
    train, recipe = TrainConfig(lr=1.0), RecipeConfig(lr_scheduler=schedule, warmup_steps=3)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=train.lr)
    scheduler = lr_scheduler(optimizer, train.gamma, recipe, total_steps=10)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    warmup = [0.25, 0.5, 0.75]  # (step + 1) / (warmup + 1)
    after = {
        "constant": [1.0] * 7,
        "linear": [1 - k / 7 for k in range(7)],
        "cosine": [0.5 * (1 + math.cos(math.pi * k / 7)) for k in range(7)],
    }[schedule]
    assert seen == pytest.approx(warmup + after)
    assert lr_factor(10, schedule, 3, 10) == pytest.approx(1.0 if schedule == "constant" else 0.0)


def test_the_schedule_spans_the_steps_the_run_trains():
    """--max_steps is the run's length whatever --epochs says (HF's meaning): the decay and the warmup share are
    sized to it, within the epochs or beyond them, so a linear decay reaches 0 at its last step; without it, the
    epochs' steps (the control). The start line says it in epochs of this run's steps."""
    from utils.train.optim import run_length, total_optimizer_steps

    two_epochs = {"epochs": 2, "batches_per_epoch": 20}
    assert total_optimizer_steps(RecipeConfig(), **two_epochs) == 40
    assert total_optimizer_steps(RecipeConfig(gradient_accumulation_steps=3), **two_epochs) == 14
    assert total_optimizer_steps(RecipeConfig(max_steps=25), **two_epochs) == 25
    assert total_optimizer_steps(RecipeConfig(max_steps=100), **two_epochs) == 100  # past the epochs
    assert total_optimizer_steps(RecipeConfig(max_steps=100, gradient_accumulation_steps=3), **two_epochs) == 100
    assert lr_factor(99, "linear", 0, 100) == pytest.approx(1 / 100) and lr_factor(100, "linear", 0, 100) == 0
    assert run_length(100, 20) == (
        "--max_steps 100: 100 steps = 5 epochs (20 optimizer steps an epoch), whatever --epochs says"
    )
    assert run_length(5, 20) == (
        "--max_steps 5: 5 steps = part of one epoch (20 optimizer steps an epoch), whatever --epochs says"
    )
    assert run_length(25, 20) == (
        "--max_steps 25: 25 steps = 1 epoch + 5 (20 optimizer steps an epoch; the last epoch partial), whatever "
        "--epochs says"
    )


def schedule_rates(kind: str, total: int, warmup: int, stop: int | None = None, steps_after: int = 0,
                   legacy: bool = False):  # fmt: skip
    """The rates a per-step schedule of `total` steps gives each step; with `stop`, the run is stopped there
    (its scheduler's state through JSON, as train_state.json holds it) and resumed in a shape that leaves it
    `steps_after` steps, through restore_schedule and continue_schedule as a run does. `legacy`: the
    checkpoint is of the format before the schedule was recorded. Returns (rates, the rate after the last
    step, what the resume said)."""
    from utils.checkpoint.manager import restore_schedule
    from utils.train.optim import continue_schedule

    def fresh(steps: int):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        recipe = RecipeConfig(lr_scheduler=kind, warmup_steps=warmup)
        return optimizer, lr_scheduler(optimizer, TrainConfig().gamma, recipe, total_steps=steps)

    def train(optimizer, scheduler, steps: int) -> list[float]:
        rates = []
        for _ in range(steps):
            rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return rates

    optimizer, scheduler = fresh(total)
    rates = train(optimizer, scheduler, total if stop is None else stop)
    said = None
    if stop is not None:
        saved = json.loads(json.dumps(scheduler.state_dict()))
        if legacy:
            saved["lr_lambdas"] = [None] * len(saved["lr_lambdas"])
        optimizer_state = optimizer.state_dict()
        # The resumed run builds its schedule for its own shape (what T5_training.py does), then restores.
        optimizer, scheduler = fresh(stop + steps_after)
        optimizer.load_state_dict(optimizer_state)
        restore_schedule(scheduler, optimizer, {"scheduler": saved, "has_optimizer": True}, [1.0])
        said = continue_schedule(scheduler, stop, stop + steps_after, "out")
        rates += train(optimizer, scheduler, steps_after)
    return rates, optimizer.param_groups[0]["lr"], said


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant"])
@pytest.mark.parametrize("steps_after", [22, 6, 30])  # half the batch (or ranks), twice it, more epochs
def test_a_resume_in_another_shape_spreads_the_rest_of_the_schedule(kind, steps_after):
    """Stopped at step 5 of 16 (warmup 3) and resumed with the schedule's 11 steps left spread over
    `steps_after` steps (half the global batch: 22; twice it: 6; more epochs: 30): the rate goes on from where
    it was, never rises after warmup, and linear and cosine reach 0 after the last step. The control, the
    unchanged resume (11 steps left), is bit for bit the uninterrupted run and says nothing."""
    uninterrupted, end, _ = schedule_rates(kind, total=16, warmup=3)
    rates, after_last, said = schedule_rates(kind, total=16, warmup=3, stop=5, steps_after=steps_after)
    assert rates[:6] == uninterrupted[:6]  # the resume's first step takes the rate the run had reached
    after_warmup = rates[3:]
    assert all(later <= earlier for earlier, later in zip(after_warmup, after_warmup[1:], strict=False)), rates
    assert after_last == end == (1.0 if kind == "constant" else 0.0)
    if kind == "linear":  # the rest of the decay in equal steps: 11 positions over steps_after steps
        pace = rates[5] - rates[6]
        assert pace == pytest.approx((11 / steps_after) / 13) and rates[-1] == pytest.approx(pace)
    assert "spread over them" in said and f"{steps_after} steps left where the schedule had 11" in said, said

    same, same_end, said = schedule_rates(kind, total=16, warmup=3, stop=5, steps_after=11)
    assert (same, same_end, said) == (uninterrupted, end, None)


def test_a_resume_inside_warmup_stretches_it_and_an_old_checkpoint_counts_as_before():
    """Stopped at step 2 of a 4-step warmup and resumed with twice the steps left: the warmup goes on to the
    peak at half the pace (not repeated: every rate up to it rises), then decays. A checkpoint from before the
    schedule was recorded keeps the counting it had: the step counter over the new shape's length."""
    rates, _, _ = schedule_rates("linear", total=12, warmup=4, stop=2, steps_after=20)
    peak = rates.index(max(rates))
    assert max(rates) == 1.0 and peak == 2 + 4  # 2 positions of warmup left, 2 steps each
    assert all(a < b for a, b in zip(rates[:peak], rates[1 : peak + 1], strict=True)), rates
    assert rates[:3] == pytest.approx([0.2, 0.4, 0.6])  # (position + 1) / 5 at positions 0, 1, 2
    assert rates[3:7] == pytest.approx([0.7, 0.8, 0.9, 1.0])  # half a position a step

    legacy, _, said = schedule_rates("linear", total=12, warmup=4, stop=2, steps_after=20, legacy=True)
    assert said is None and legacy[2:] == [lr_factor(step, "linear", 4, 22) for step in range(2, 22)]


def test_a_resume_past_the_end_of_a_decayed_schedule_is_refused():
    """A finished linear run resumed with more epochs would train at a rate of 0: refused, naming the fix. A
    constant schedule goes on at its rate."""
    from configs.errors import ConfigError

    with pytest.raises(ConfigError, match=r"linear learning-rate schedule ended at step 16 .* out/hf_model_last"):
        schedule_rates("linear", total=16, warmup=0, stop=16, steps_after=8)
    rates, after_last, _ = schedule_rates("constant", total=16, warmup=0, stop=16, steps_after=8)
    assert rates[16:] == [1.0] * 8 and after_last == 1.0


# ------------------------------------------------------------------------------------- through torchrun

COMMON = ["--mixed_precision", "false", "--dropout_rate", "0", "--num_train_samples", "48", "--num_val_samples",
          "8", "--eval_rouge", "false", "--epochs", "1"]  # fmt: skip


@pytest.mark.slow
def test_two_micro_batches_of_two_equal_one_batch_of_four(tmp_path):
    """Through torchrun: 2 micro-batches of 2 give the losses of one batch of 4 (both backends and both
    gradient-sync modes are compared with an unsharded model in one process: the tests above)."""
    runs = {}
    micro_batches = ["--batch_size_training", "2", "--gradient_accumulation_steps", "2"]
    cases = (("whole", "1", ["--batch_size_training", "4"]), ("accumulated1", "1", micro_batches))
    for name, fsdp_version, flags in cases:
        output_dir = tmp_path / name
        run = pooled([*COMMON, *flags, "--fsdp_version", fsdp_version, "--output_dir", str(output_dir)])
        assert run.returncode == 0, run.describe()
        runs[name] = step_losses(output_dir)
        assert_epoch_flops_count_every_real_token(output_dir, num_samples=48)
    for version in ("1",):
        accumulated = runs[f"accumulated{version}"]
        assert sorted(accumulated) == sorted(runs["whole"]) == list(range(1, 7))  # 24 samples a rank / 4
        for step, loss in runs["whole"].items():
            assert accumulated[step] == pytest.approx(loss, rel=1e-5), (version, step)


def assert_epoch_flops_count_every_real_token(output_dir: Path, num_samples: int, world_size: int = 2):
    """The epoch record's model and hardware TFLOP/s per device, times devices and training seconds, are
    the hand-count formula summed over every training sample's real (unpadded) lengths, once each."""
    from transformers import T5Config, T5Tokenizer

    from configs.paths import EMBEDDED_MODEL_DIR
    from summarization_dataset import SummarizationDataset
    from utils.observe.flops import Seq2SeqFlops

    dataset = SummarizationDataset(T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR), "train", num_samples, 512, 150)
    items = [dataset[i] for i in range(len(dataset))]
    src = torch.tensor([float(item["source_mask"].sum()) for item in items], dtype=torch.float64)
    tgt = torch.tensor([float(item["target_mask"].sum()) for item in items], dtype=torch.float64)
    flops = Seq2SeqFlops.from_config(T5Config.from_pretrained(EMBEDDED_MODEL_DIR))
    model = 3 * flops.forward(src, tgt).item()
    hardware = model + flops.forward(src, tgt, head=False).item()  # activation checkpointing is on by default
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    epoch = next(r for r in records if r["type"] == "epoch")
    device_seconds = world_size * num_samples / epoch["samples_per_s"]
    assert epoch["model_tflops_per_s"] * 1e12 * device_seconds == pytest.approx(model, rel=1e-9)
    assert epoch["hardware_tflops_per_s"] * 1e12 * device_seconds == pytest.approx(hardware, rel=1e-9)
    config = json.loads((output_dir / "config.json").read_text())
    assert epoch["mfu"] == pytest.approx(epoch["model_tflops_per_s"] / config["mfu_peak_tflops"], rel=1e-9)


@pytest.mark.parametrize(
    "next_epoch, best_epoch, patience, stops",
    [(3, 1, 2, False), (4, 1, 2, True), (4, 2, 2, False), (5, None, 2, False), (9, 1, 0, False)],
)
def test_early_stopping_counts_the_epochs_since_the_best(next_epoch, best_epoch, patience, stops):
    """The rule reads only the checkpointed progress (next epoch, best epoch): a resumed run counts the same."""
    from utils.checkpoint.progress import TrainProgress
    from utils.train.policies import RunEnd

    end = RunEnd(TrainConfig(epochs=20), RecipeConfig(early_stopping_patience=patience), EvalConfig())
    progress = TrainProgress(epoch=next_epoch, global_step=100, best_epoch=best_epoch)
    reason = end.done(progress)
    assert (reason is not None) is stops
    assert reason is None or reason.startswith(f"early stopping: {patience} epochs without a better val_loss")
    # A finished run's resume names the setting that would train on: not --epochs, which changes nothing here
    assert not stops or end.ending(progress)[1] == f"a higher --early_stopping_patience than {patience} (0: never)"


@pytest.mark.parametrize("global_step, stops", [(4, False), (5, True), (6, True)])
def test_max_steps_ends_the_run_whatever_epochs_says(global_step, stops):
    """The step budget at an epoch boundary (tests/test_fsdp2.py's cross-backend run stops inside one), and
    past the epochs: --max_steps, where given, is the run's only length (HF's meaning). The control: without
    it, the epochs end the run."""
    from utils.checkpoint.progress import TrainProgress
    from utils.train.policies import RunEnd

    end = RunEnd(TrainConfig(epochs=20), RecipeConfig(max_steps=5), EvalConfig())
    ending = end.ending(TrainProgress(epoch=2, global_step=global_step))
    assert ending == (("--max_steps 5 reached", "a higher --max_steps than 5 (0: none)") if stops else None)
    assert end.ending(TrainProgress(epoch=21, global_step=global_step)) == ending  # epochs no bound
    few_epochs = RunEnd(TrainConfig(epochs=1), RecipeConfig(max_steps=5), EvalConfig())
    assert few_epochs.done(TrainProgress(epoch=3, global_step=4)) is None  # 2 epochs trained, 4 steps: on
    without = RunEnd(TrainConfig(epochs=20), RecipeConfig(), EvalConfig())
    assert without.ending(TrainProgress(epoch=21, global_step=3)) == (
        "all 20 epochs trained",
        "more --epochs than 20",
    )
    assert without.done(TrainProgress(epoch=20, global_step=1000)) is None


@pytest.mark.slow  # a whole training through torchrun
def test_early_stopping_ends_a_run_that_got_worse_and_keeps_the_best(tmp_path):
    # gamma 1000 takes the LR from 0.002 to 2 after epoch 1, so the second epoch is far worse than the first
    # (val_loss measured 5.73 -> 9.13): patience 1 ends the run there, of 3 epochs.
    output_dir = tmp_path / "early"
    flags = ["--num_train_samples", "48", "--num_val_samples", "8", "--eval_rouge", "false", "--epochs", "3",
             "--gamma", "1000", "--early_stopping_patience", "1"]  # fmt: skip
    run = pooled([*flags, "--output_dir", str(output_dir)])
    assert run.returncode == 0, run.describe()
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["type"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2] and epochs[1]["val_loss"] > epochs[0]["val_loss"], epochs
    assert "early stopping: 1 epochs without a better val_loss than epoch 1's" in run.output
    assert (output_dir / "hf_model").is_dir() and (output_dir / "hf_model_last").is_dir()


def decay_groups_worker(rank: int, world_size: int) -> dict:
    """Names of the parameters in each AdamW group, with weight decay, for FSDP2 and FSDP1 (orig params)."""
    from utils.train import optim

    out = {}
    train = TrainConfig(weight_decay=0.1)
    for version, overrides in ((1, {"use_orig_params": True}), (2, {"fsdp_version": 2})):
        model, parallelism = sharded(tiny_t5(), _fsdp_config(overrides), FP32)
        names = {id(p): n for n, p in model.named_parameters()}
        # As T5_training.fsdp_main builds it.
        optimizer = torch.optim.AdamW(optim.parameter_groups(model, train.weight_decay), lr=train.lr)
        out[version] = [(group["weight_decay"], sorted(names[id(p)] for p in group["params"]))
                        for group in optimizer.param_groups]  # fmt: skip
    return out


def test_weight_decay_skips_the_layer_norms_for_both_backends():

    for version, groups in run_ranks(decay_groups_worker, timeout_s=120)[0].items():
        (decay, decayed), (no_decay, kept) = groups
        assert (decay, no_decay) == (0.1, 0.0), version
        assert kept and all("layer_norm" in name for name in kept), (version, kept)
        assert decayed and not any("layer_norm" in name for name in decayed), (version, decayed)
        assert any("shared" in name for name in decayed) and any("DenseReluDense.wi" in name for name in decayed)


@contextlib.contextmanager
def _nan_loss(enabled: bool):
    """This rank's token losses (and so its gradients) become NaN while the context is open."""
    original = SEQ2SEQ.token_losses

    def poisoned(model, batch):
        token_losses, labels = original(model, batch)
        return token_losses * float("nan"), labels

    with mock.patch.object(SEQ2SEQ, "token_losses", poisoned if enabled else original):
        yield


def _guarded_run(version: int, rank: int, world_size: int, steps: list[int], bad_step: int, stop: bool) -> dict:
    """train_step over `steps` with rank 1's loss NaN at `bad_step`: the step records, the final weights (rank
    0), and the error a stopping step log raised (None if none)."""
    model, parallelism = sharded(tiny_t5(), _fsdp_config({"fsdp_version": version}), FP32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    settings = step_module.StepSettings(parallelism, skip_nonfinite=not stop, spec=SEQ2SEQ)
    records: list[dict] = []
    step_log = StepLog(every=len(steps), on_flush=records.extend, stop_on_nonfinite=stop)
    error = None
    try:
        for step in steps:
            with _nan_loss(step == bad_step and rank == 1):
                stats = train_step(
                    model, make_batch(batch_seed(step, rank)), optimizer, None, world_size, settings
                )
            step_log.add(step + 1, LR, stats)
        step_log.flush()
    except TrainingDivergedError as err:
        error = str(err)
    return {"records": records, "state": parallelism.full_state_dict(model, CPU), "error": error}


def nonfinite_worker(rank: int, world_size: int, steps: int = 4, bad_step: int = 1) -> dict:
    """For each backend: a run whose step `bad_step` is NaN on rank 1 only, skipped; the same run without
    that step at all; the same run with a step log that stops."""
    out = {}
    for version in (1, 2):
        every = list(range(steps))
        out[version] = {
            "skipped": _guarded_run(version, rank, world_size, every, bad_step, stop=False),
            "left_out": _guarded_run(version, rank, world_size, [s for s in every if s != bad_step], -1, False),
            "stopped": _guarded_run(version, rank, world_size, every, bad_step, stop=True),
        }
    return out


@pytest.fixture(scope="module")
def nonfinite():

    return run_ranks(nonfinite_worker, timeout_s=180)


@pytest.mark.parametrize("version", [1, 2])
def test_a_nan_on_one_rank_is_skipped_on_both(nonfinite, version):
    """Rank 1's loss is NaN at step 2: both ranks record it skipped and the weights end exactly
    as in a run that never took that step (fused AdamW leaves parameters, moments and step count alone)."""
    for rank_out in nonfinite:
        records = rank_out[version]["skipped"]["records"]
        assert [r.get("skipped", False) for r in records] == [False, True, False, False], records
        assert [r.get("nonfinite", False) for r in records] == [False, True, False, False], records
        assert math.isnan(records[1]["loss"]) and math.isnan(records[1]["grad_norm"])
        assert all(math.isfinite(r["loss"]) for i, r in enumerate(records) if i != 1)
        left_out = rank_out[version]["left_out"]["records"]
        assert [r["loss"] for r in left_out] == [r["loss"] for i, r in enumerate(records) if i != 1]
    skipped, left_out = nonfinite[0][version]["skipped"]["state"], nonfinite[0][version]["left_out"]["state"]
    assert all(torch.equal(skipped[k], left_out[k]) for k in left_out)


@pytest.mark.parametrize("version", [1, 2])
def test_a_nan_on_one_rank_stops_both(nonfinite, version):
    for rank_out in nonfinite:
        stopped = rank_out[version]["stopped"]
        assert stopped["error"] and stopped["error"].startswith("step 2: NaN or infinite"), stopped["error"]
        assert "--on_nonfinite skip" in stopped["error"]
        # The NaN update was applied (nothing skips it), so every later step is NaN too: why stopping matters.
        assert [r.get("nonfinite", False) for r in stopped["records"]] == [False, True, True, True]
        assert not any(r.get("skipped") for r in stopped["records"])


@pytest.mark.slow
def test_a_diverging_run_stops_keeping_its_checkpoints_or_skips_every_bad_step(tmp_path):
    """lr 1e30 turns the first update into weights of ~1e30, and every later step's gradient norm infinite.
    stop, under torchrun --max_restarts 1: the restart continues from step 1's checkpoint and fails at step
    2's flush with the same one message as the first attempt, before step 2's checkpoint; torchrun gives up,
    the run exits non-zero, and step 1's checkpoint is as the first attempt wrote it. skip: the run ends normally
    over 2 epochs, steps 2-12 skipped; epoch 1's train_loss is step 1's loss (the only step that trained),
    epoch 2's is null (none trained)."""
    flags = [*COMMON, "--lr", "1e30", "--save_every_n_steps", "1", "--log_every_n_steps", "3"]
    stopped = tmp_path / "stopped"
    run = torchrun([*flags, "--output_dir", str(stopped)], launcher=["--standalone", *RESTARTING])
    assert run.returncode != 0, run.describe()
    messages = [line for line in run.output.splitlines() if "NaN or infinite loss or gradient norm" in line]
    assert len(messages) == 2 and len(set(messages)) == 1, messages  # once per attempt, rank 0's
    assert "step 2: NaN or infinite loss or gradient norm" in messages[0]
    assert run.output.count("torchrun restart 1 of this run") == 1, run.describe()  # it continued step 1's
    assert [p.name for p in (stopped / "checkpoints").iterdir()] == ["step_00000001"]
    state = json.loads((stopped / "checkpoints" / "step_00000001" / "train_state.json").read_text())
    assert state["progress"]["global_step"] == 1  # still step 1's state: no later step was saved over it
    assert not (stopped / "hf_model").exists()

    skipped = tmp_path / "skipped"
    run = pooled([*flags, "--on_nonfinite", "skip", "--epochs", "2", "--output_dir", str(skipped)])
    assert run.returncode == 0, run.describe()

    def refuse(constant):
        raise ValueError(f"metrics.jsonl holds {constant}, which is not JSON")

    lines = (skipped / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=refuse) for line in lines]
    steps = [r for r in records if r["type"] == "step"]
    assert [r.get("skipped", False) for r in steps] == [False] + [True] * 11, steps
    assert all(r["grad_norm"] is None for r in steps[1:])
    epochs = [r for r in records if r["type"] == "epoch"]
    assert epochs[0]["train_loss"] == pytest.approx(steps[0]["loss"], rel=1e-12)
    assert epochs[1]["train_loss"] is None
    assert "step 12: NaN or infinite loss or gradient norm, skipped" in run.output


@pytest.mark.parametrize(
    "value, best, better",
    [(1.0, None, True), (1.0, 2.0, True), (3.0, 2.0, False), (math.nan, None, False), (math.inf, 2.0, False),
     (5.0, math.nan, True)],
)  # fmt: skip
def test_a_non_finite_metric_is_never_the_best(value, best, better):
    assert SEQ2SEQ.is_better("val_loss", value, best) is better


def test_a_restored_optimizer_keeps_its_own_kernel():
    """A checkpoint of a for-each AdamW restored into a fused one (--on_nonfinite skip): the fused flag is
    written into the loaded groups before loading, since torch places the step counters by it (on the GPU
    for fused; docs/pitfalls.md #31)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from utils.checkpoint.state_dicts import set_optimizer_state

    model = torch.nn.Linear(3, 2)
    saving = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    saving.step()
    state = get_optimizer_state_dict(model, saving)
    assert state["param_groups"][0]["fused"] is None
    running = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    set_optimizer_state(model, running, state, full=False)
    assert state["param_groups"][0]["fused"] is True and running.param_groups[0]["fused"] is True
    assert torch.equal(running.state[model.weight]["exp_avg"], saving.state[model.weight]["exp_avg"])


@pytest.mark.parametrize(
    "device, on_nonfinite, scaler, fused",
    [("cuda", "stop", False, True), ("cuda", "skip", False, True), ("cuda", "stop", True, False),
     ("cpu", "stop", False, False), ("cpu", "skip", False, True), ("cpu", "skip", True, False)],
)  # fmt: skip
def test_adamw_is_fused_on_gpus_and_for_skip_but_not_with_the_fp16_scaler(device, on_nonfinite, scaler, fused):
    from utils.train.optim import uses_fused_adamw

    assert uses_fused_adamw(device, on_nonfinite, has_grad_scaler=scaler) is fused
