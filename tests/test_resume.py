"""Resumable checkpoints, on the embedded tiny T5 and sample (2 CPU processes, gloo): through torchrun where a
kill, a signal or a restart is the point, else on the pooled ranks (tests/launch.py: pooled).

One uninterrupted SHARDED_STATE_DICT run (tests/reference_run.py, trained once per session) is the
reference: runs with a rank SIGKILLed under torchrun --max_restarts, for both checkpoint types, both
backends and two agents, must reproduce its per-step losses; its checkpoints are the material of the
world-size, interrupted-save and bad-input tests. A 2-rank gloo group (tests/dist_harness.py) checks
the optimizer state's round trip through CheckpointManager.save / CheckpointManager.load directly.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration, T5Tokenizer

from configs.checkpointing import CheckpointConfig
from configs.fsdp import FSDPConfig
from configs.paths import EMBEDDED_MODEL_DIR as EMBEDDED_MODEL
from configs.recipe import RecipeConfig
from configs.training import TrainConfig
from policies.mixed_precision import Precision
from scripts.compare_step_losses import step_losses
from scripts.convert_checkpoint_to_hf import main as convert_checkpoint_main
from tests.dist_harness import run_ranks
from tests.hf_folders import folder_tensors
from tests.launch import Background, Run, pooled, program_tracebacks, torchrun
from tests.reference_run import (
    BATCH,
    EPOCHS,
    FULL,
    NPROC,
    NUM_TRAIN,
    RESTART_CASES,
    SAVE_EVERY,
    SHARDED,
    SMALL_RUN,
    TOTAL_STEPS,
    checkpoint_dir,
    complete_checkpoint_steps,
    logged_steps,
    read_records,
    restart_run,
    step_lrs,
)
from utils.base.layout import MODEL_FILE
from utils.checkpoint.manager import CheckpointManager
from utils.checkpoint.progress import TrainProgress
from utils.checkpoint.start import StartPoint, resolve_start
from utils.distributed.process_group import DistInfo
from utils.fsdp.parallelism import parallelism_for
from utils.spec import SEQ2SEQ
from utils.train import optim
from utils.train.step import StepSettings, train_step

RTOL = 1e-5
RUN_TIMEOUT_S = 240
FAIL_FAST_S = 90  # a user error must end every rank within this
RESUMED_FROM = re.compile(r"resumed from (\S+): epoch (\d+), step (\d+)")


# ------------------------------------------------------------------------------------------ launching


def processes_of(output_dir: Path) -> list[int]:
    """Pids of processes whose command line names output_dir (a check that no rank outlived torchrun)."""
    found = subprocess.run(["pgrep", "-f", str(output_dir)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


# ------------------------------------------------------------------------------------- reading outputs


def epoch_records(output_dir: Path) -> list[dict]:
    return [r for r in read_records(output_dir) if r["type"] == "epoch"]


def resumed_from(run: Run) -> tuple[Path, int, int]:
    """(checkpoint, epoch, step) of the run's 'resumed from' line, which must appear exactly once."""
    matches = RESUMED_FROM.findall(run.output)
    assert len(matches) == 1, f"expected one 'resumed from' line, found {matches}\n{run.describe()}"
    path, epoch, step = matches[0]
    return Path(path), int(epoch), int(step)


def world_size_warnings(run: Run, saved: int, now: int) -> list[str]:
    """Rank 0's warnings that name the checkpoint's world size and then this run's."""
    prefix = "[rank 0] WARNING"
    pattern = re.compile(rf"\b{saved}\b.*\b{now}\b")
    return [
        line
        for line in run.output.splitlines()
        if line.startswith(prefix) and "rank" in line[len(prefix) :] and pattern.search(line[len(prefix) :])
    ]


def assert_losses_match(output_dir: Path, reference_dir: Path, steps=None) -> None:
    losses, reference = step_losses(str(output_dir)), step_losses(str(reference_dir))
    if steps is None:
        assert sorted(losses) == sorted(reference), (sorted(losses), sorted(reference))
        steps = sorted(reference)
    for step in steps:
        assert losses[step] == pytest.approx(reference[step], rel=RTOL), (step, losses[step], reference[step])


def assert_finite_run(output_dir: Path, first_step: int, n_steps: int) -> None:
    records = read_records(output_dir)
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(first_step, first_step + n_steps)), [r["step"] for r in steps]
    for record in steps:
        assert math.isfinite(record["loss"]) and record["loss"] > 0, record
    for record in (r for r in records if r["type"] == "epoch"):
        assert math.isfinite(record["train_loss"]) and math.isfinite(record["val_loss"]), record


def snapshot(output_dir: Path) -> dict:
    """Every file under checkpoints/ (hidden ones too) with size and mtime; metrics.jsonl's and config.json's
    bytes."""
    files = {}
    root = output_dir / "checkpoints"
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            stat = path.stat()
            files[str(path.relative_to(output_dir))] = (stat.st_size, stat.st_mtime_ns)
    for name in ("metrics.jsonl", "config.json"):
        path = output_dir / name
        files[f"{name} bytes"] = path.read_bytes() if path.is_file() else None
    return files


def with_overrides(args: list[str], overrides: list[str]) -> list[str]:
    """`args` (flag, value pairs) with the flags of `overrides` replaced by theirs."""
    replaced = set(overrides[::2])
    pairs = [args[i : i + 2] for i in range(0, len(args), 2)]
    return [item for pair in pairs if pair[0] not in replaced for item in pair] + overrides


def copy_run(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination, symlinks=True)
    return destination


def remaining_steps(samples: int, consumed: int, world_size: int) -> int:
    """Steps of the rest of an epoch: the unconsumed samples of the padded order, dealt to the ranks (none once
    every real sample was consumed)."""
    if consumed >= samples:
        return 0
    total = math.ceil(samples / world_size) * world_size
    per_rank = math.ceil((total - consumed) / world_size)
    return math.ceil(per_rank / BATCH)


# ------------------------------------------------------------------------------- shared training runs


@dataclass
class Resumed:
    output_dir: Path
    steps_at_kill: list[int]
    checkpoints_at_kill: list[int]
    killed: Run
    resumed: Run


def kill_and_resume(
    tmp_path_factory, checkpoint_type: str, extra: tuple[str, ...] = (), fresh_resume: bool = False
) -> Resumed:
    """The run SIGKILLed (every rank and torchrun) once its first checkpoint is complete, then resumed with
    `--resume true` alone: through torchrun where `fresh_resume` (a new process per rank), else pooled."""
    base = tmp_path_factory.mktemp(f"killed_{checkpoint_type}")
    output_dir = base / "out"
    args = [*SMALL_RUN, *extra, "--checkpoint_type", checkpoint_type, "--output_dir", str(output_dir)]
    background = Background(args, base / "killed.log")
    first = checkpoint_dir(output_dir, SAVE_EVERY) / "train_state.json"
    try:
        background.wait_for(first.is_file, f"checkpoint {first.parent}")
    finally:
        background.kill()
        killed = background.finish(timeout=60)
    steps_at_kill = logged_steps(output_dir)
    checkpoints_at_kill = complete_checkpoint_steps(output_dir)
    # The resume repeats none of the run's settings: they come from its record (config.json).
    resumed = (torchrun if fresh_resume else pooled)(["--output_dir", str(output_dir), "--resume", "true"])
    return Resumed(output_dir, steps_at_kill, checkpoints_at_kill, killed, resumed)


# ----------------------------------------------------------------------- 1. kill, resume, same losses

RECIPE = ("--lr_scheduler", "cosine", "--warmup_steps", "5", "--gradient_accumulation_steps", "2",
          "--max_grad_norm", "1.0", "--group_by_length", "true")  # fmt: skip


# The whole job SIGKILLed after its first checkpoint, then resumed by hand (--resume true), with the recipe
# that touches most state: accumulation, clipping, a per-step cosine schedule with warmup, length grouping.
# FULL_STATE_DICT's and FSDP2's exact resume are tested through torchrun's own restart
# (test_a_killed_rank_restarts_the_group_which_continues_exactly).
@pytest.mark.slow
def test_kill_and_resume_with_accumulation_clipping_a_cosine_schedule_and_length_grouping(tmp_path_factory):
    reference = tmp_path_factory.mktemp("recipe_reference") / "out"
    run = pooled([*SMALL_RUN, *RECIPE, "--checkpoint_type", SHARDED, "--output_dir", str(reference)])
    assert run.returncode == 0, run.describe()
    result = kill_and_resume(tmp_path_factory, SHARDED, RECIPE)
    steps = TOTAL_STEPS // 2  # two micro-batches per optimizer step
    output_dir = result.output_dir

    # The kill hit the run in its first epoch, after a checkpoint, and left no final model.
    assert result.killed.returncode != 0, result.killed.describe()
    assert SAVE_EVERY <= len(result.steps_at_kill) < steps, result.steps_at_kill
    assert result.checkpoints_at_kill and result.checkpoints_at_kill[-1] <= steps // 2, result.checkpoints_at_kill
    assert "epoch 2:" not in result.killed.output

    run = result.resumed
    assert run.returncode == 0, run.describe()
    assert f"resuming with the settings of {output_dir / 'config.json'}\n" in run.output, run.describe()
    # The killed run's lock is taken over, with one line naming it.
    assert run.output.count("ended without releasing it (killed?): taking it over") == 1, run.describe()
    path, epoch, step = resumed_from(run)
    assert path == checkpoint_dir(output_dir, result.checkpoints_at_kill[-1]), run.describe()
    assert step == result.checkpoints_at_kill[-1], run.describe()
    assert epoch == (1 if step < steps // 2 else 2), run.describe()  # the epoch's end (step 6) starts epoch 2
    state = json.loads((checkpoint_dir(output_dir, steps) / "train_state.json").read_text())
    assert state["checkpoint_type"] == SHARDED

    # Each step exactly once, in order, with the uninterrupted run's losses, learning rates and epochs.
    assert logged_steps(output_dir) == logged_steps(reference) == list(range(1, steps + 1))
    assert_losses_match(output_dir, reference)
    assert step_lrs(output_dir) == step_lrs(reference)  # the schedule continues exactly
    lrs = step_lrs(reference)
    assert lrs[1] < lrs[5] and lrs[6] > lrs[steps], lrs  # warmup, then the cosine decay
    epochs, reference_epochs = epoch_records(output_dir), epoch_records(reference)
    assert [r["epoch"] for r in epochs] == list(range(1, EPOCHS + 1)), epochs
    for got, expected in zip(epochs, reference_epochs, strict=True):
        for key in ("train_loss", "val_loss"):
            assert got[key] == pytest.approx(expected[key], rel=RTOL), (key, got, expected)
    assert (output_dir / "hf_model" / "model.safetensors").is_file()


# --------------------------------------------------------------------------- 2. another world size


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_type", [SHARDED, FULL])
def test_a_checkpoint_of_two_ranks_resumes_on_one(tmp_path, request, checkpoint_type):
    # The step-20 checkpoints of the reference run (SHARDED) and of the restarted FSDP1 FULL_STATE_DICT run.
    two_ranks = request.getfixturevalue("reference" if checkpoint_type == SHARDED else "restarted_full")
    source = checkpoint_dir(two_ranks, 20)
    state = json.loads((source / "train_state.json").read_text())
    assert state["world_size"] == 2 and state["progress"]["epoch"] == 2
    assert state["checkpoint_type"] == checkpoint_type
    consumed = state["progress"]["samples_consumed"]
    output_dir = tmp_path / "out"
    run = pooled([*SMALL_RUN, "--checkpoint_type", checkpoint_type, "--output_dir", str(output_dir),
                  "--resume", str(source)], nproc=1)  # fmt: skip
    assert run.returncode == 0, run.describe()
    assert resumed_from(run) == (source, 2, 20)
    assert world_size_warnings(run, saved=2, now=1), run.describe()
    assert "Warning" not in run.output, run.describe()  # torch's about one rank's NO_SHARD: ignored, loading too
    assert_finite_run(output_dir, 21, remaining_steps(NUM_TRAIN, consumed, 1))
    assert [r["epoch"] for r in epoch_records(output_dir)] == [2]
    assert (output_dir / "hf_model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_sharded_checkpoint_of_one_rank_resumes_on_two(tmp_path):
    samples = 48
    overrides = ["--num_train_samples", str(samples), "--checkpoint_type", SHARDED, "--keep_last_n", "10",
                 "--max_steps", str(SAVE_EVERY)]  # fmt: skip
    args = with_overrides(SMALL_RUN, overrides)
    single = tmp_path / "single"
    run = pooled([*args, "--output_dir", str(single)], nproc=1)
    assert run.returncode == 0, run.describe()
    assert logged_steps(single) == list(range(1, SAVE_EVERY + 1))
    # One rank: FSDP1 runs NO_SHARD whatever it is asked; the log says so, and torch's warnings about it
    # (at wrapping, at every state dict) do not reach the console.
    assert re.search(r"INFO FSDP1: \d+ units \(root \+ \d+ T5Block\), NO_SHARD,", run.output), run.describe()
    assert "Warning" not in run.output, run.describe()
    source = checkpoint_dir(single, SAVE_EVERY)
    state = json.loads((source / "train_state.json").read_text())
    assert state["world_size"] == 1 and state["progress"]["global_step"] == SAVE_EVERY

    output_dir = tmp_path / "out"
    run = pooled([*with_overrides(args, ["--max_steps", "0"]), "--output_dir", str(output_dir),
                  "--resume", str(source)], nproc=2)  # fmt: skip
    assert run.returncode == 0, run.describe()
    assert resumed_from(run) == (source, 1, SAVE_EVERY)
    assert world_size_warnings(run, saved=1, now=2), run.describe()
    rest = remaining_steps(samples, state["progress"]["samples_consumed"], 2)
    assert_finite_run(output_dir, SAVE_EVERY + 1, rest + remaining_steps(samples, 0, 2))
    assert [r["epoch"] for r in epoch_records(output_dir)] == [1, 2]  # and a whole epoch on 2 ranks


@pytest.mark.slow
def test_a_resume_on_one_rank_spreads_the_rest_of_the_lr_schedule_over_its_steps(tmp_path):
    """2 ranks -> 1 halves the global batch, so the run has twice the steps left: its linear schedule (warmup 3)
    goes on from the rate it had reached at step 5, decays in steps of half the size, never rises, and is 0
    after the last step; the start line says so. (On the code before, step 8's rate rose above step 7's.)"""
    samples = 48  # 6 steps an epoch on 2 ranks, 12 on one
    schedule = ["--lr_scheduler", "linear", "--warmup_steps", "3", "--eval_rouge", "false"]
    args = with_overrides(SMALL_RUN, ["--num_train_samples", str(samples), "--keep_last_n", "10"]) + schedule
    two_ranks = tmp_path / "two"
    run = pooled([*args, "--output_dir", str(two_ranks)])
    assert run.returncode == 0, run.describe()
    uninterrupted = step_lrs(two_ranks)
    source = checkpoint_dir(two_ranks, SAVE_EVERY)
    consumed = json.loads((source / "train_state.json").read_text())["progress"]["samples_consumed"]
    left = remaining_steps(samples, consumed, 1) + remaining_steps(samples, 0, 1)  # 2 + 12

    output_dir = tmp_path / "one"
    run = pooled([*args, "--output_dir", str(output_dir), "--resume", str(source)], nproc=1)
    assert run.returncode == 0, run.describe()
    changed = f"{left} steps left where the schedule had {len(uninterrupted) - SAVE_EVERY}"
    assert changed in run.output, run.describe()
    lrs = step_lrs(output_dir)
    assert sorted(lrs) == list(range(SAVE_EVERY + 1, SAVE_EVERY + left + 1)), lrs
    rates = [lrs[step] for step in sorted(lrs)]
    assert rates[0] == uninterrupted[SAVE_EVERY + 1], (rates, uninterrupted)  # continuous at the resume
    assert all(later < earlier for earlier, later in zip(rates, rates[1:], strict=False)), rates
    halved = (uninterrupted[SAVE_EVERY + 1] - uninterrupted[SAVE_EVERY + 2]) / 2
    assert rates[0] - rates[1] == pytest.approx(halved) and rates[-1] == pytest.approx(halved), rates
    final = json.loads((checkpoint_dir(output_dir, SAVE_EVERY + left) / "train_state.json").read_text())
    assert final["scheduler"]["_last_lr"] == [0.0]  # the rate after the last step

    # More epochs after the decay has ended would train at a rate of 0: refused, the run's record untouched.
    record = (output_dir / "config.json").read_bytes()
    run = pooled(["--output_dir", str(output_dir), "--resume", "true", "--epochs", "3"], nproc=1)
    assert run.returncode == 2 and "schedule ended at step 19" in run.output, run.describe()
    assert (output_dir / "config.json").read_bytes() == record and "Traceback" not in run.output


# ---------------------------------------------------------------- 3. a save interrupted half-way
# tests/test_async_checkpoint.py: a SIGKILL during a background write, then --resume true.


# ------------------------------------------------------------------- 4. Ctrl-C and SIGTERM: save, then stop


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_the_run_resumes(tmp_path):
    """Ctrl-C in a terminal: SIGINT to torchrun's process group; torchrun forwards it to every rank (each in a
    session of its own), which save within two optimizer steps and stop with one line. (SIGTERM, the
    scheduler's signal, takes the same path: test_sigterm_to_torchrun_during_the_rouge_evaluation...)"""
    # Long enough that Ctrl-C, sent once 4 steps are logged, arrives well before the end; no periodic saves.
    epochs, samples = 1, 120
    last_step = epochs * math.ceil(math.ceil(samples / NPROC) / BATCH)  # 15
    output_dir = tmp_path / "out"
    args = with_overrides(SMALL_RUN, [
        "--epochs", str(epochs),
        "--num_train_samples", str(samples),
        "--save_every_n_steps", "1000",
        "--log_every_n_steps", "2",
        "--checkpoint_type", SHARDED,
        "--output_dir", str(output_dir),
    ])  # fmt: skip
    background = Background(args, tmp_path / "ctrl_c.log")
    try:
        background.wait_for(lambda: len(logged_steps(output_dir)) >= 4, "4 logged steps")
        assert len(background.workers()) == NPROC, background.workers()
        os.killpg(background.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: torchrun's group
        stopped = background.finish(timeout=120)
    finally:
        if background.proc.poll() is None:
            background.kill()
    # The ranks stop cleanly; torchrun, which the signal reached first, reports it with its own traceback
    # (SignalException) and exits non-zero: that part is torchrun's.
    assert "KeyboardInterrupt" not in stopped.output, stopped.describe()
    assert [t for t in program_tracebacks(stopped.output) if "SignalException" not in t] == [], stopped.describe()
    assert stopped.output.count("received SIGINT: saving a checkpoint") == 1, stopped.describe()
    match = re.findall(r"stopped at step (\d+) on SIGINT; continue with --resume true", stopped.output)
    assert len(match) == 1, stopped.describe()
    stop_step = int(match[0])
    assert complete_checkpoint_steps(output_dir) == [stop_step], stopped.describe()
    assert 4 <= stop_step < last_step
    # Every step the checkpoint holds is in metrics.jsonl, and no later one.
    assert logged_steps(output_dir) == list(range(1, stop_step + 1))
    assert not (output_dir / "hf_model").exists()

    run = pooled([*args, "--resume", "true"])
    assert run.returncode == 0, run.describe()
    assert resumed_from(run)[2] == stop_step
    assert logged_steps(output_dir) == list(range(1, last_step + 1))
    assert [r["epoch"] for r in epoch_records(output_dir)] == list(range(1, epochs + 1))
    assert (output_dir / "hf_model" / "model.safetensors").is_file()


# One epoch of 4 steps; ROUGE of 60 articles one by one (about 1 s a batch) at its end, or also after step 2
# (--eval_every_n_steps). torchrun's own SIGTERM (as SLURM or Kubernetes send it) arrives after the first
# ROUGE batches; the resumed run scores 4 articles (the evaluation redone, not its length, is the point).
ROUGE_BATCH_DONE = re.compile(r"INFO ROUGE evaluation: [1-9]\d*/\d+ batches")  # no terminal: its progress line
ROUGE_STOPS = {  # case: (extra flags, the line of the stop, the checkpoint it leaves)
    "at the epoch end": ([], "stopped during epoch 1's evaluation on SIGTERM", 4),
    "inside the epoch": (["--eval_every_n_steps", "2"], "stopped at step 2 on SIGTERM", 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ROUGE_STOPS))
def test_sigterm_to_torchrun_during_the_rouge_evaluation_saves_and_the_resume_evaluates_once(tmp_path, case):
    extra, stop_line, saved_step = ROUGE_STOPS[case]
    output_dir = tmp_path / "out"
    args = ["--epochs", "1", "--num_train_samples", "32", "--num_val_samples", "8", "--eval_num_samples", "60",
            "--val_batch_size", "1", "--mixed_precision", "false", *extra,
            "--output_dir", str(output_dir)]  # fmt: skip
    log = tmp_path / "first.log"
    background = Background(args, log)
    try:
        background.wait_for(lambda: ROUGE_BATCH_DONE.search(log.read_text()), "a ROUGE batch")
        signalled = time.monotonic()
        background.proc.send_signal(signal.SIGTERM)
        stopped = background.finish(timeout=120)
        seconds = time.monotonic() - signalled
    finally:
        if background.proc.poll() is None:
            background.kill()
    # torchrun SIGKILLs its workers 30 s after forwarding SIGTERM: the line and the complete checkpoint show
    # that the stop came inside that (no bound of its own: the save's time varies with the machine's load).
    assert stop_line in stopped.output, (seconds, stopped.describe())
    assert complete_checkpoint_steps(output_dir) == [saved_step], (seconds, stopped.describe())
    assert logged_steps(output_dir) == list(range(1, saved_step + 1))
    assert not [r for r in read_records(output_dir) if r["type"] in ("eval", "validation", "epoch")]
    saved = json.loads((checkpoint_dir(output_dir, saved_step) / "train_state.json").read_text())
    # Inside the epoch the checkpoint says the evaluation is due; at its end, the position says it (the
    # epoch's batches all consumed: the resumed pass trains nothing and evaluates).
    assert saved["progress"]["evaluation_due"] is bool(extra), saved["progress"]

    run = pooled(with_overrides(args, ["--eval_num_samples", "4"]) + ["--resume", "true"])
    assert run.returncode == 0, run.describe()
    assert resumed_from(run)[1:] == (1, saved_step), run.describe()
    evaluated = [(r["type"], r["step"] if r["type"] != "epoch" else None) for r in read_records(output_dir)
                 if r["type"] in ("eval", "validation", "epoch")]  # fmt: skip
    # Each evaluation once, the abandoned one right after the resume, before the next step.
    midway = [("eval", 2), ("validation", 2)] if extra else []
    assert evaluated == [*midway, ("eval", 4), ("epoch", None)], evaluated
    assert logged_steps(output_dir) == [1, 2, 3, 4]
    state = json.loads((checkpoint_dir(output_dir, 4) / "train_state.json").read_text())
    assert state["progress"]["evaluation_due"] is False


# ------------------------------------------------------------------ 5. optimizer state, round trip


def _tiny_t5(seed: int, on_meta: bool = False) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    config = T5Config.from_pretrained(EMBEDDED_MODEL, dropout_rate=0.0, use_cache=False)
    with torch.device("meta" if on_meta else "cpu"):
        return T5ForConditionalGeneration(config)


def _random_batch(seed: int, rows: int = 3, src_len: int = 12, tgt_len: int = 7) -> dict:
    gen = torch.Generator().manual_seed(seed)
    source_mask = (torch.arange(src_len) < torch.randint(3, src_len + 1, (rows, 1), generator=gen)).long()
    target_mask = (torch.arange(tgt_len) < torch.randint(2, tgt_len + 1, (rows, 1), generator=gen)).long()
    return {
        "source_ids": torch.randint(2, 1100, (rows, src_len), generator=gen) * source_mask,
        "source_mask": source_mask,
        "target_ids": torch.randint(2, 1100, (rows, tgt_len), generator=gen) * target_mask,
        "target_mask": target_mask,
    }


def _full_states(model, optimizer) -> tuple[dict, dict]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(
        model, optimizer, options=options
    )


def _max_diffs(a: dict, b: dict) -> dict:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return {key: (a[key].double() - b[key].double()).abs().max().item() for key in a}


def optimizer_round_trip_worker(rank: int, world_size: int, output_root: str) -> dict:
    """Train 2 steps, save, load into a fresh model and optimizer; compare states and one more step."""
    cpu = torch.device("cpu")
    info = DistInfo(rank, rank, world_size, cpu, "gloo")
    tokenizer = T5Tokenizer.from_pretrained(str(EMBEDDED_MODEL))
    fsdp_config = FSDPConfig(mixed_precision=False, fsdp_activation_checkpointing=False)
    train_config = TrainConfig(lr=1e-3, weight_decay=0.01, gamma=0.5)
    checkpointing = CheckpointConfig(save_every_n_steps=0, keep_last_n=2)

    def checkpointer(plain, checkpoint_type: str, save_optimizer: bool = True) -> CheckpointManager:
        """As T5_training.fsdp_main builds them: the sharded model (from a meta-device skeleton, which the
        checkpoint fills, where `plain` is one), AdamW, its schedule, their manager."""
        fsdp = replace(fsdp_config, checkpoint_type=checkpoint_type, save_optimizer=save_optimizer)
        restores = plain.device.type == "meta"
        parallelism = parallelism_for(fsdp, world_size)
        model = parallelism.wrap(plain, precision=Precision("fp32_policy"), device=cpu, restores=restores)
        parameter_groups = optim.parameter_groups(model, train_config.weight_decay)
        optimizer = torch.optim.AdamW(parameter_groups, lr=train_config.lr)
        scheduler = optim.lr_scheduler(optimizer, train_config.gamma, RecipeConfig(), total_steps=10)
        folder = os.path.join(output_root, f"{checkpoint_type}-{save_optimizer}")
        return CheckpointManager(
            checkpointing=checkpointing,
            fsdp=fsdp,
            output_dir=folder,
            model=model,
            parallelism=parallelism,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=None,
            model_config=plain.config,
            tokenizer=tokenizer,
            info=info,
        )

    def start_of(path: str) -> StartPoint:
        """Where a run resuming from `path` starts (as --resume PATH resolves it)."""
        return resolve_start(path, os.path.dirname(os.path.dirname(path)))

    out = {}
    for checkpoint_type in (SHARDED, FULL):
        saver = checkpointer(_tiny_t5(seed=0), checkpoint_type)
        model, optimizer, scheduler = saver.model, saver.optimizer, saver.scheduler
        settings = StepSettings(saver.parallelism, spec=SEQ2SEQ)
        for step in range(2):
            train_step(model, _random_batch(100 * step + rank), optimizer, None, world_size, settings)
        scheduler.step()  # the saved learning rate differs from a fresh optimizer's
        progress = TrainProgress(epoch=2, samples_consumed=8, global_step=2, best_metric=3.25, best_epoch=1)
        path = saver.save(progress)
        original_model, original_optim = _full_states(model, optimizer)

        # No initial weights at all (an empty skeleton, its shards allocated uninitialised): everything must
        # come from the checkpoint, restored after sharding whatever its type.
        start = start_of(path)
        start_ok = start == StartPoint(path, checkpoint_type) and start.weights_file is None
        loader = checkpointer(_tiny_t5(seed=1, on_meta=True), checkpoint_type)
        loaded_progress = loader.load(start)
        model2, optimizer2, scheduler2 = loader.model, loader.optimizer, loader.scheduler
        reloaded_model, reloaded_optim = _full_states(model2, optimizer2)

        result = {
            "path": path,
            "start_ok": start_ok and start.is_checkpoint,
            "progress_equal": loaded_progress == progress,
            "lr": (optimizer.param_groups[0]["lr"], optimizer2.param_groups[0]["lr"]),
            "scheduler": (scheduler.state_dict(), scheduler2.state_dict()),
            "model_diff": max(_max_diffs(original_model, reloaded_model).values()),
            "optim_params": (sorted(original_optim["state"]), sorted(reloaded_optim["state"])),
            "optim_diff": {
                name: _max_diffs(original_optim["state"][name], reloaded_optim["state"][name])
                for name in original_optim["state"]
                if name in reloaded_optim["state"]
            },
        }
        # One more step on the same batch: equal moments give equal updates.
        batch = _random_batch(999 + rank)
        train_step(model, batch, optimizer, None, world_size, settings)
        train_step(model2, batch, optimizer2, None, world_size, StepSettings(loader.parallelism, spec=SEQ2SEQ))
        after, after2 = _full_states(model, optimizer)[0], _full_states(model2, optimizer2)[0]
        result["model_diff_after_next_step"] = max(_max_diffs(after, after2).values())
        result["next_step_changed_weights"] = max(_max_diffs(original_model, after).values()) > 0

        # Without optimizer state the weights come back and AdamW starts afresh: no state, not even a step.
        without = checkpointer(_tiny_t5(seed=0), checkpoint_type, save_optimizer=False)
        settings = StepSettings(without.parallelism, spec=SEQ2SEQ)
        train_step(without.model, _random_batch(rank), without.optimizer, None, world_size, settings)
        path = without.save(progress)
        start = start_of(path)
        restored = checkpointer(_tiny_t5(seed=1, on_meta=True), checkpoint_type, save_optimizer=False)
        restored.load(start)
        entries = len(restored.optimizer.state)  # before _full_states, which initialises the state
        result["no_optimizer"] = {
            "model_diff": max(_max_diffs(_full_states(without.model, without.optimizer)[0],
                                         _full_states(restored.model, restored.optimizer)[0]).values()),
            "optimizer_state_entries": entries,
        }  # fmt: skip
        # A start that is not a checkpoint (a new run) restores nothing: the progress of a new run.
        result["new_run_progress"] = restored.load(StartPoint()) == TrainProgress()
        out[checkpoint_type] = result
    return out


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("optimizer_round_trip")
    return run_ranks(optimizer_round_trip_worker, str(root), world_size=2, timeout_s=180)


@pytest.mark.parametrize("checkpoint_type", [SHARDED, FULL])
def test_optimizer_state_survives_the_round_trip(round_trip, checkpoint_type):
    for rank, per_type in enumerate(round_trip):
        result = per_type[checkpoint_type]
        where = f"rank {rank}, {checkpoint_type}"
        assert result["start_ok"], where
        assert result["progress_equal"], where
        assert result["lr"][0] == result["lr"][1] == pytest.approx(5e-4), (where, result["lr"])
        assert result["scheduler"][0] == result["scheduler"][1], where
        assert result["model_diff"] == 0, (where, result["model_diff"])
        original, reloaded = result["optim_params"]
        assert original and original == reloaded, (where, original, reloaded)
        for name, diffs in result["optim_diff"].items():
            assert set(diffs) == {"exp_avg", "exp_avg_sq", "step"}, (where, name, diffs)
            assert all(value == 0 for value in diffs.values()), (where, name, diffs)
        assert result["next_step_changed_weights"], where
        assert result["model_diff_after_next_step"] == 0, (where, result["model_diff_after_next_step"])
        assert result["no_optimizer"] == {"model_diff": 0, "optimizer_state_entries": 0}, (where, result)
        assert result["new_run_progress"], where


def test_a_resume_decays_by_this_runs_gamma_from_the_rate_its_schedule_reached():
    """StepLR's saved state holds its gamma: a resume given another --gamma (recorded as changed there) decays
    by it from here on, not by the saved run's. A checkpoint without optimizer state (--save_optimizer false)
    resumes at the rate its schedule had reached, not the base rate (from which the decay started over).
    Another --lr scales the reached rate. Controls: the scheduler's own load and the fresh groups' rate."""
    from torch.optim.lr_scheduler import StepLR

    from utils.checkpoint.manager import restore_schedule

    def schedule(gamma: float, lr: float = 0.002):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
        return optimizer, StepLR(optimizer, step_size=1, gamma=gamma)

    optimizer, scheduler = schedule(0.85)
    for _ in range(2):  # two epochs
        optimizer.step()
        scheduler.step()
    saved = {"scheduler": scheduler.state_dict(), "has_optimizer": False}
    for lr in (0.002, 0.004):
        optimizer, scheduler = schedule(0.5, lr)
        restore_schedule(scheduler, optimizer, saved, [lr])
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr * 0.85**2)
        optimizer.step()
        scheduler.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr * 0.85**2 * 0.5)
    optimizer, scheduler = schedule(0.5)
    scheduler.load_state_dict(saved["scheduler"])
    assert scheduler.gamma == 0.85 and optimizer.param_groups[0]["lr"] == 0.002  # what restore_schedule mends


def test_a_resume_cuts_metrics_back_to_its_checkpoint_memory_records_by_their_step(tmp_path):
    """Each training process writes its memory account after its first step, with that step: a resume from
    step 20 keeps the start's (step 1, and one of an older version without a step) and drops the abandoned
    process's (step 21, after the checkpoint), as it drops its steps; the resumed process then writes its own."""
    from utils.observe.metrics import truncate_metrics_for_resume

    path = tmp_path / "metrics.jsonl"
    records = [
        {"type": "memory", "rank": 0, "step": 1},
        {"type": "memory", "rank": 0},
        {"type": "step", "step": 20},
        {"type": "epoch", "epoch": 1},
        {"type": "memory", "rank": 0, "step": 21},
        {"type": "step", "step": 21},
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    truncate_metrics_for_resume(str(path), last_step=20, next_epoch=2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:4]


# --------------------------------------------------------------------------------- 6. hf_model export


@pytest.mark.slow
def test_hf_model_loads_and_equals_the_last_full_checkpoint(restarted_full):
    folder = restarted_full / "hf_model"
    assert (folder / "model.safetensors").is_file()
    assert not list(folder.glob("*.bin")) and not list(folder.glob("*.pt")), sorted(os.listdir(folder))
    exported, loading = T5ForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    assert not any(loading.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    tokenizer = AutoTokenizer.from_pretrained(folder)

    last = checkpoint_dir(restarted_full, TOTAL_STEPS)
    assert json.loads((last / "train_state.json").read_text())["checkpoint_type"] == FULL
    plain = T5ForConditionalGeneration(T5Config.from_pretrained(EMBEDDED_MODEL))
    plain.load_state_dict(torch.load(last / MODEL_FILE, map_location="cpu", weights_only=True), strict=True)
    pretrained = T5ForConditionalGeneration.from_pretrained(EMBEDDED_MODEL)

    text = "Loosen the chords in a quiet space. Write the sturdy pegs at a slow tempo."
    training_tokenizer = T5Tokenizer.from_pretrained(str(EMBEDDED_MODEL))
    source = tokenizer(text, return_tensors="pt")
    assert source.input_ids.tolist() == training_tokenizer(text, return_tensors="pt").input_ids.tolist()
    labels = tokenizer("Loosen the chords.", return_tensors="pt").input_ids
    logits = {}
    for name, model in (("exported", exported), ("checkpoint", plain), ("pretrained", pretrained)):
        model.eval()
        with torch.no_grad():
            logits[name] = model(**source, labels=labels).logits
    assert torch.allclose(logits["exported"], logits["checkpoint"], rtol=1e-5, atol=1e-5), (
        (logits["exported"] - logits["checkpoint"]).abs().max()
    )
    assert not torch.allclose(logits["exported"], logits["pretrained"], atol=1e-3), "not the trained weights"

    with torch.no_grad():
        generated = exported.generate(**source, max_new_tokens=8)
    assert generated.dtype == torch.long and generated.shape[0] == 1 and 1 < generated.shape[1] <= 9, generated
    assert isinstance(tokenizer.decode(generated[0], skip_special_tokens=True), str)


@pytest.mark.slow
@pytest.mark.parametrize("run_name", ["restarted_full", "reference"])
def test_converted_checkpoint_holds_what_the_run_exported(run_name, request, tmp_path):
    """scripts/convert_checkpoint_to_hf.py on the last checkpoint (FULL_STATE_DICT's model.pt; the DCP
    shards of SHARDED_STATE_DICT) writes, tensor for tensor, what the run's end exported from the shards for
    the same weights, split over several files as --max_file_gb asks."""
    output_dir = request.getfixturevalue(run_name)
    exported = output_dir / ("hf_model_last" if (output_dir / "hf_model_last").is_dir() else "hf_model")
    converted = tmp_path / "converted"
    last = checkpoint_dir(output_dir, TOTAL_STEPS)
    assert convert_checkpoint_main([str(last), "--output", str(converted), "--max_file_gb", "0.0002"]) == 0

    assert len(list(converted.glob("model-*-of-*.safetensors"))) > 1
    written, expected = folder_tensors(converted), folder_tensors(exported)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[name], expected[name]) for name in expected)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((converted / name).read_text()) == json.loads((exported / name).read_text()), name


# ------------------------------------------------------------------------------------ 7. bad inputs


def _damaged_named_checkpoint(tmp_path, out):
    shard = checkpoint_dir(out, TOTAL_STEPS) / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    named = str(checkpoint_dir(out, TOTAL_STEPS))
    return ["--resume", named], "the checkpoint is damaged", [named, "__0_0.distcp has", "--resume true"]


def _another_model(tmp_path, out):
    folder = tmp_path / "wider-t5"
    T5ForConditionalGeneration(T5Config.from_pretrained(EMBEDDED_MODEL, d_ff=128)).save_pretrained(folder)
    for name in ("spiece.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODEL / name, folder / name)
    return (
        ["--model_name", str(folder), "--resume", "true"],
        "was trained on other inputs than this resume reads",
        [f"the model folder {folder} (the run's was {EMBEDDED_MODEL})", f"{folder / 'config.json'} changed"],
    )


# One run per way a bad input is found over an existing run: a resume that would change what the run's
# checkpoints hold (here another model folder, whose config the checkpoint's fingerprint of the run's does not
# match), refused by rank 0's look before anything loads, on every rank (pooled); a damaged checkpoint named with
# --resume, refused by rank 0's look at output_dir, on every rank (through torchrun: no rank outlives it). A
# settings refusal comes before output_dir is touched (tests/test_end_to_end.py: nothing is created). Other
# messages of the same paths are unit-tested (tests/test_cli.py, test_validate.py, test_dataset.py,
# test_torchrun_restarts.py: a new run over a run; test_run_safety.py: each field a resume refuses to change).
BAD_INPUTS = {  # case: (what it changes, launched through torchrun)
    "damaged_named_checkpoint": (_damaged_named_checkpoint, True),
    "another_model": (_another_model, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_stops_every_rank_with_one_message(case, tmp_path, reference):
    # An output_dir that holds a finished run with checkpoints: --resume true would continue it.
    out = copy_run(reference, tmp_path / "out")
    change, through_torchrun = BAD_INPUTS[case]
    extra, phrase, also = change(tmp_path, out)
    before = snapshot(out)
    base = ["--output_dir", str(out), "--resume", "true"]  # the run's other settings come from its record
    run = (torchrun if through_torchrun else pooled)(with_overrides(base, extra), timeout=FAIL_FAST_S + 30)

    assert run.returncode != 0, run.describe()
    assert run.seconds < FAIL_FAST_S, run.describe()
    lines = [line for line in run.output.splitlines() if phrase in line]
    assert len(lines) == 1, f"{phrase!r} printed {len(lines)} times, expected once\n{run.describe()}"
    for word in also:
        assert word in lines[0], f"{word!r} not in the message {lines[0]!r}"
    tracebacks = program_tracebacks(run.output)
    assert not tracebacks, f"traceback for a user error:\n{tracebacks[0]}\n{run.describe()}"
    assert "epoch 1:" not in run.output and "epoch 2:" not in run.output
    if through_torchrun:
        assert not processes_of(out), "a rank outlived torchrun"
    # Nothing of the existing run was deleted or modified.
    after = snapshot(out)
    assert after.keys() == before.keys(), (
        sorted(before.keys() - after.keys()),
        sorted(after.keys() - before.keys()),
    )
    changed = [key for key in before if before[key] != after[key]]
    assert not changed, changed


# --------------------------------------------------------- 8. damaged checkpoints, rollbacks, finished runs


def overwrite_middle(path: Path) -> None:
    """4 KB of other bytes in the middle of a file, its size unchanged (disk or copy damage)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(255 - byte for byte in data[middle : middle + 4096])
    path.write_bytes(bytes(data))


def truncate_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGED = {  # case: (the run to copy, the file of its newest checkpoint (step 24) that is damaged, how)
    "SHARDED, a shard truncated": ("reference", "__1_0.distcp", truncate_half),
    "FULL, optimizer.pt overwritten": ("restarted_full", "optimizer.pt", overwrite_middle),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_continues_exactly_from_the_intact_one(
    case, request, tmp_path
):
    run_name, name, spoil = DAMAGED[case]
    out = copy_run(request.getfixturevalue(run_name), tmp_path / "out")
    spoil(checkpoint_dir(out, TOTAL_STEPS) / name)
    run = pooled(["--output_dir", str(out), "--resume", "true"])
    assert run.returncode == 0, run.describe()
    warnings = [line for line in run.output.splitlines() if "is damaged" in line]
    assert len(warnings) == 1 and str(checkpoint_dir(out, TOTAL_STEPS)) in warnings[0], run.describe()
    assert name in warnings[0] and f"continuing from {checkpoint_dir(out, 20)}" in warnings[0], warnings
    assert resumed_from(run) == (checkpoint_dir(out, 20), 2, 20)
    assert_losses_match(out, request.getfixturevalue("reference"))  # steps 21-24 trained again, exactly
    [aside] = (out / "checkpoints" / "damaged").iterdir()  # kept, not deleted
    assert aside.name.startswith("step_00000024-") and (aside / "train_state.json").is_file()


@pytest.mark.slow
def test_a_rollback_sticks_a_resume_continues_its_branch_and_a_finished_run_changes_nothing(tmp_path, reference):
    """Back to step 20 of a run that reached 24 (as after a loss spike): step 24 is set aside, and the next
    --resume true continues the rollback's branch, here with another --lr; the run, once finished, resumed
    again, says so and changes nothing."""
    out = copy_run(reference, tmp_path / "out")
    rollback = pooled(["--output_dir", str(out), "--resume", str(checkpoint_dir(out, 20)), "--max_steps", "22",
                         "--keep_last_n", "3"])  # fmt: skip
    assert rollback.returncode == 0, rollback.describe()
    assert "changed here: --max_steps 22 (the run had 0), --keep_last_n 3 (the run had 2)" in rollback.output
    [branch] = (out / "checkpoints" / "abandoned").iterdir()
    # The abandoned branch's epoch 2 was a new best: hf_model/ held its model and goes with it; this branch's
    # best is chosen again, and its end (step 22, validated) writes hf_model/ anew.
    assert branch.name.startswith("after_step_00000020-") and sorted(p.name for p in branch.iterdir()) == [
        "hf_model", "step_00000024"
    ]  # fmt: skip
    assert rollback.output.count(f"moved to {branch}") == 1, rollback.describe()
    assert "this branch's best is chosen again from its own evaluations" in rollback.output, rollback.describe()
    assert "new best val_loss" in rollback.output and (out / "hf_model" / "config.json").is_file()
    assert complete_checkpoint_steps(out) == [20, 22]
    assert_losses_match(out, reference, steps=[21, 22])

    resumed = pooled(["--output_dir", str(out), "--resume", "true", "--max_steps", "0", "--lr", "0.004"])
    assert resumed.returncode == 0, resumed.describe()
    assert resumed_from(resumed) == (checkpoint_dir(out, 22), 2, 22)  # not the abandoned step 24
    assert "scaled by 2" in resumed.output, resumed.describe()
    assert_losses_match(out, reference, steps=[23])  # trained from step 22's weights
    lrs, reference_lrs = step_lrs(out), step_lrs(reference)
    assert [lrs[s] for s in (23, 24)] == pytest.approx([2 * reference_lrs[s] for s in (23, 24)], rel=1e-6)
    assert json.loads((out / "config.json").read_text())["train_config"]["lr"] == 0.004

    before = snapshot(out)
    again = pooled(["--output_dir", str(out), "--resume", "true"])
    assert again.returncode == 0, again.describe()
    assert "had finished (all 2 epochs trained; step 24): nothing to do, nothing changed" in again.output
    assert "INFO training steps" not in again.output, again.describe()
    assert snapshot(out) == before


# ------------------------------------------------------- torchrun --max_restarts: a killed rank, a restart
# A rank SIGKILLed mid-run (as by the OOM killer); torchrun restarts the group with the same arguments, and
# the run continues from its newest checkpoint by itself, with the uninterrupted run's per-step losses and
# a metrics.jsonl that reads as if nothing had happened (tests/reference_run.py: restart_run).


@pytest.fixture(scope="module")
def restarts(tmp_path_factory) -> dict:
    """{case: (output_dir, every agent's output)} of one restarted run per case."""
    runs = {}
    for case in RESTART_CASES:
        output_dir = tmp_path_factory.mktemp(case) / "out"
        agents, killed = restart_run(output_dir, case)
        output = "".join(agent.output for agent in agents)
        assert all(agent.returncode == 0 for agent in agents), "\n".join(agent.describe() for agent in agents)
        assert killed, output[-4000:]
        runs[case] = (output_dir, output)
    return runs


@pytest.fixture(scope="module")
def restarted_full(restarts) -> Path:
    return restarts["fsdp1-full"][0]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RESTART_CASES))
def test_a_killed_rank_restarts_the_group_which_continues_exactly(restarts, reference, case):
    output_dir, output = restarts[case]
    checkpoint_type, fsdp_version, _, _ = RESTART_CASES[case]
    restarted = "torchrun restart 1 of this run: continuing from"
    assert restarted in output and "step_00000005" in output, output[-4000:]
    # Each step once, in order, with the uninterrupted run's losses; each epoch once.
    assert logged_steps(output_dir) == list(range(1, TOTAL_STEPS + 1))
    assert_losses_match(output_dir, reference)
    assert [r["epoch"] for r in epoch_records(output_dir)] == [1, 2]
    for got, want in zip(epoch_records(output_dir), epoch_records(reference), strict=True):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=RTOL)
    record = json.loads((output_dir / "config.json").read_text())
    assert record["torchrun_job"] and record["fsdp_config"]["fsdp_version"] == fsdp_version
    state = json.loads((checkpoint_dir(output_dir, TOTAL_STEPS) / "train_state.json").read_text())
    assert state["checkpoint_type"] == checkpoint_type
