"""The whole program on 2 ranks (gloo on CPU, the pooled rank processes), the embedded tiny T5 and sample data.

One shared training run (module scope) feeds the tests of the run record, the checkpoint and the log;
each bad input is its own short run that must fail fast, once, with a clear message (one of them through
torchrun, whose closing report must name that message as the cause).
"""

from __future__ import annotations

import json
import math
import platform
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import transformers
from transformers import T5Config, T5ForConditionalGeneration

from configs.cli import format_value, parse_args
from configs.fsdp import FSDPConfig
from configs.paths import EMBEDDED_MODEL_DIR as EMBEDDED_MODEL
from configs.run import RECORD_KEYS, RunConfig
from configs.training import TrainConfig
from tests.launch import Run, pooled, program_tracebacks, torchrun

NPROC = 2
EPOCHS = 2
NUM_TRAIN = 96
NUM_VAL = 24
NUM_EVAL = 12  # articles ROUGE scores after each epoch
# Steps per epoch: each rank gets ceil(96 / 2) samples, in batches of the default batch_size_training.
STEPS_PER_EPOCH = math.ceil(math.ceil(NUM_TRAIN / NPROC) / TrainConfig().batch_size_training)
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH  # 24

FLOP_KEYS = {"model_tflops_per_s", "hardware_tflops_per_s", "mfu"}  # mfu: where a peak is known (CPU: probed)
STEP_KEYS = {"type", "epoch", "step", "loss", "lr", "grad_norm", "seconds", "tokens", *FLOP_KEYS}
EPOCH_KEYS = {
    "type",
    "epoch",
    "train_loss",
    "val_loss",
    "epoch_seconds",
    "samples_per_s",
    "tokens_per_s",
    *FLOP_KEYS,
    "peak_memory_bytes",
    "compiled_graphs",
}
CUDA_ONLY_EPOCH_KEYS = {"peak_memory_reserved_bytes"}
EVAL_KEYS = {"type", "epoch", "step", "split", "rouge1", "rouge2", "rougeL", "rougeLsum", "gen_len", "num_samples",
             "seconds", "baselines"}  # fmt: skip
MEMORY_KEYS = {
    "type",
    "rank",
    "step",
    "load_rss_delta_bytes",
    "param_numel_local",
    "param_numel_total",
    "optim_state_numel_local",
    "peak_rss_bytes",
    "cuda_peak_allocated_bytes",
    "saved_activation_bytes",
    "saved_activation_batch",
}

FAIL_FAST_S = 60  # a user error must end every rank within this


# ----------------------------------------------------------------------------------------- training run


@pytest.fixture(scope="module")
def training(tmp_path_factory) -> tuple[Run, Path]:
    output_dir = tmp_path_factory.mktemp("e2e_run") / "out"  # does not exist yet: rank 0 creates it
    run = pooled(
        ["--epochs", str(EPOCHS), "--num_train_samples", str(NUM_TRAIN), "--num_val_samples", str(NUM_VAL),
         "--eval_num_samples", str(NUM_EVAL), "--max_new_tokens", "16",
         "--save_model", "true", "--log_every_n_steps", "5", "--tensorboard", "true",
         "--output_dir", str(output_dir)],
        timeout=300,
    )  # fmt: skip
    return run, output_dir


@pytest.fixture(scope="module")
def finished(training) -> tuple[Run, Path]:
    """The training run, which must have succeeded for its outputs to be checked."""
    run, output_dir = training
    assert run.returncode == 0, run.describe()
    return run, output_dir


@pytest.fixture(scope="module")
def records(finished) -> list[dict]:
    _, output_dir = finished
    lines = (output_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert lines, "metrics.jsonl is empty"
    parsed = []
    for number, line in enumerate(lines, 1):
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError as err:
            pytest.fail(f"metrics.jsonl line {number} is not JSON ({err}): {line!r}")
    return parsed


@pytest.fixture(scope="module")
def run_config(finished) -> dict:
    _, output_dir = finished
    return json.loads((output_dir / "config.json").read_text(encoding="utf-8"))


def steps_of(records: list[dict]) -> list[dict]:
    return [r for r in records if r["type"] == "step"]


def epochs_of(records: list[dict]) -> list[dict]:
    return [r for r in records if r["type"] == "epoch"]


def is_finite_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.slow
def test_training_exits_zero(training):
    run, output_dir = training
    assert run.returncode == 0, run.describe()
    assert (output_dir / "metrics.jsonl").is_file()
    assert (output_dir / "config.json").is_file()


@pytest.mark.slow
def test_metrics_records_have_exactly_the_documented_keys(records, run_config):
    on_cuda = str(run_config.get("device", "")).startswith("cuda")
    for record in records:
        assert record.get("type") in ("step", "epoch", "memory", "eval"), record
        if record["type"] == "step":
            assert set(record) == STEP_KEYS, record
        elif record["type"] == "eval":
            assert set(record) == EVAL_KEYS and record["num_samples"] == NUM_EVAL, record
            assert set(record["baselines"]) == {"lead_steps", "lead3"}, record
        elif record["type"] == "memory":
            assert set(record) == MEMORY_KEYS, record
        else:
            extra = set(record) - EPOCH_KEYS
            assert EPOCH_KEYS <= set(record), record
            assert extra <= (CUDA_ONLY_EPOCH_KEYS if on_cuda else set()), record


@pytest.mark.slow
def test_memory_account_has_one_record_per_rank_and_full_shard_halves_the_state(records):
    memory = [r for r in records if r["type"] == "memory"]
    assert [r["rank"] for r in memory] == list(range(NPROC)) and {r["step"] for r in memory} == {1}
    for record in memory:
        total = record["param_numel_total"]
        # FULL_SHARD on 2 ranks: half the parameters and half of AdamW's two moments (plus padding).
        assert 0.49 <= record["param_numel_local"] / total <= 0.51, record
        assert 0.49 <= record["optim_state_numel_local"] / (2 * total) <= 0.51, record
        assert record["load_rss_delta_bytes"] >= 0 and record["peak_rss_bytes"] > 0
        assert record["cuda_peak_allocated_bytes"] is None


@pytest.mark.slow
def test_memory_planner_predicts_the_measured_state_and_activations(records, run_config):
    """The planner, given the run's settings and the shape of the micro-batch the account counted, predicts
    the state held and the bytes autograd kept for backward through FSDP (the run's precision: bf16 where the
    CPU computes it natively, else fp32; checkpointing, sdpa)."""
    from scripts.estimate_memory import estimate, load_shape

    recipe, fsdp = run_config["recipe_config"], run_config["fsdp_config"]
    assert recipe["dropout_rate"] in (None, "NONE")
    for record in (r for r in records if r["type"] == "memory"):
        rows, source_length, target_length = record["saved_activation_batch"]
        predicted = estimate(
            load_shape(str(EMBEDDED_MODEL)),
            nproc=NPROC,
            sharding_strategy=fsdp["sharding_strategy"],
            mixed_precision="fp32" if run_config["mixed_precision_policy"] == "fp32_policy" else "bf16",
            activation_checkpointing=fsdp["fsdp_activation_checkpointing"],
            batch_size=rows,
            max_source_length=source_length,
            max_target_length=target_length,
            device="cpu",
            attn_implementation=recipe["attn_implementation"],
            dropout_rate=T5Config.from_pretrained(EMBEDDED_MODEL).dropout_rate,  # the run keeps the model's
        )
        assert record["param_numel_total"] == predicted.param_numel_total
        assert abs(record["param_numel_local"] / predicted.param_numel_local - 1) < 0.15
        assert abs(record["optim_state_numel_local"] / (2 * predicted.param_numel_local) - 1) < 0.15
        assert predicted.activations_bytes == pytest.approx(record["saved_activation_bytes"], rel=0.01), record


@pytest.mark.slow
def test_tensorboard_holds_the_metrics_records(records, finished):
    """--tensorboard true: the run's event files carry the step, epoch, ROUGE and memory figures."""
    from tests.test_tensorboard import read_scalars

    _, output_dir = finished
    scalars = read_scalars(output_dir / "tensorboard")
    steps = [(r["step"], r["loss"]) for r in steps_of(records)]
    assert [(step, pytest.approx(loss)) for step, loss in steps] == scalars["train/loss"]
    assert [value for _, value in scalars["epoch/val_loss"]] == pytest.approx(
        [r["val_loss"] for r in epochs_of(records)]
    )
    for tag in ("train/lr", "train/grad_norm", "train/mfu", "epoch/tokens_per_s", "rouge/validation/rougeL",
                "memory/peak_rss_mib", "memory/saved_activation_mib"):  # fmt: skip
        assert tag in scalars, (tag, sorted(scalars))


@pytest.mark.slow
def test_step_numbers_are_global_and_consecutive(records):
    steps = steps_of(records)
    assert [r["step"] for r in steps] == list(range(1, TOTAL_STEPS + 1))
    assert [r["epoch"] for r in steps] == [1] * STEPS_PER_EPOCH + [2] * STEPS_PER_EPOCH


@pytest.mark.slow
def test_records_are_in_order(records):
    # Each epoch's steps come before its epoch record, which comes before the next epoch's steps.
    order = [(r["epoch"], 0 if r["type"] == "step" else 1) for r in records if r["type"] in ("step", "epoch")]
    assert order == sorted(order)
    assert [r["epoch"] for r in epochs_of(records)] == list(range(1, EPOCHS + 1))


@pytest.mark.slow
def test_lr_steps_once_per_epoch(records):
    lr, gamma = TrainConfig().lr, TrainConfig().gamma
    for record in steps_of(records):
        expected = lr * gamma ** (record["epoch"] - 1)
        assert record["lr"] == pytest.approx(expected, rel=1e-9), record


@pytest.mark.slow
def test_step_losses_and_times_are_finite(records):
    for record in steps_of(records):
        assert is_finite_number(record["loss"]) and record["loss"] > 0, record
        assert is_finite_number(record["seconds"]) and record["seconds"] > 0, record


@pytest.mark.slow
def test_epoch_records(records):
    epochs = epochs_of(records)
    assert len(epochs) == EPOCHS
    for record in epochs:
        for key in ("train_loss", "val_loss", "epoch_seconds", "samples_per_s", "tokens_per_s"):
            assert is_finite_number(record[key]) and record[key] > 0, (key, record)
        peaks = record["peak_memory_bytes"]
        assert isinstance(peaks, list) and len(peaks) == NPROC, record
        assert all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in peaks), record
    # The tiny model learns on the sample: a second epoch of training lowers the validation loss.
    assert epochs[1]["val_loss"] < epochs[0]["val_loss"], epochs


@pytest.mark.slow
def test_each_epoch_is_evaluated_with_rouge_and_its_predictions_kept(records, finished):
    _, output_dir = finished
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["epoch"] for r in evals] == list(range(1, EPOCHS + 1))
    assert [r["step"] for r in evals] == [STEPS_PER_EPOCH * e for e in range(1, EPOCHS + 1)]
    for record in evals:
        path = output_dir / "predictions" / f"validation_step_{record['step']:08d}.jsonl"
        assert len(path.read_text(encoding="utf-8").splitlines()) == NUM_EVAL
        assert 0 <= record["rougeL"] <= 100 and record["gen_len"] > 0
    # The extractive baselines depend only on the articles: the same at every evaluation.
    assert evals[0]["baselines"] == evals[-1]["baselines"]


@pytest.mark.slow
def test_config_json(run_config, finished):
    _, output_dir = finished
    # One key per config section, each with exactly that section's fields.
    for section in fields(RunConfig):
        assert set(run_config[RECORD_KEYS[section.name]]) == {f.name for f in fields(section.default_factory)}
    assert set(run_config["train_config"]) == {f.name for f in fields(TrainConfig)}
    assert set(run_config["fsdp_config"]) == {f.name for f in fields(FSDPConfig)}
    assert run_config["world_size"] == NPROC
    assert run_config["backend"] == "gloo"
    versions = run_config["versions"]
    assert versions["python"] == platform.python_version()
    assert versions["torch"] == torch.__version__
    assert versions["transformers"] == transformers.__version__

    train, data = run_config["train_config"], run_config["data_config"]
    assert train["epochs"] == EPOCHS
    assert data["num_train_samples"] == NUM_TRAIN
    assert data["num_val_samples"] == NUM_VAL
    assert run_config["evaluation_config"]["eval_num_samples"] == NUM_EVAL
    assert train["save_model"] is True
    assert run_config["observability_config"]["log_every_n_steps"] == 5
    assert run_config["observability_config"]["tensorboard"] is True
    assert Path(train["output_dir"]) == output_dir


@pytest.mark.slow
def test_config_json_parses_back_to_the_run_configs(run_config):
    # The record uses the CLI's spelling: feeding it back as flags reproduces the run's configs.
    argv = []
    for section in RECORD_KEYS.values():
        for name, value in run_config[section].items():
            argv += [f"--{name}", format_value(value)]
    config = parse_args(argv)
    assert config.train.epochs == EPOCHS and config.train.save_model is True
    assert config.fsdp == FSDPConfig()
    assert config.data.num_train_samples == NUM_TRAIN and config.evaluation.eval_num_samples == NUM_EVAL


@pytest.mark.slow
def test_checkpoint_loads_into_a_fresh_unwrapped_model(finished):
    _, output_dir = finished
    checkpoints = sorted(output_dir.glob("*.pt"), key=lambda p: p.stat().st_mtime)
    assert checkpoints, f"no .pt in {output_dir}: {sorted(p.name for p in output_dir.iterdir())}"
    for path in checkpoints:
        assert "epoch" in path.name, path.name
    assert not list(output_dir.glob("*.tmp")), "a temporary file of an atomic save was left behind"
    newest = checkpoints[-1]
    # Validation improved in epoch 2 (test_epoch_records), so the newest best model is epoch 2's.
    assert re.search(r"epoch[_-]?0*2(?!\d)", newest.name), newest.name

    state = torch.load(newest, map_location="cpu", weights_only=True)
    assert isinstance(state, dict)
    model = T5ForConditionalGeneration(T5Config.from_pretrained(EMBEDDED_MODEL))
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, strict=True)
    for key, value in model.state_dict().items():
        assert value.dtype == fresh[key].dtype, key
        assert torch.equal(value, state[key]), key
        assert torch.isfinite(value).all(), key

    # The tied embedding stays tied: one tensor for the input embeddings and the LM head.
    assert model.config.tie_word_embeddings
    shared = model.shared.weight
    assert model.lm_head.weight.data_ptr() == shared.data_ptr()
    assert model.encoder.embed_tokens.weight.data_ptr() == shared.data_ptr()
    assert model.decoder.embed_tokens.weight.data_ptr() == shared.data_ptr()
    if "lm_head.weight" in state:
        assert torch.equal(state["lm_head.weight"], state["shared.weight"])

    # Trained weights, not the initial ones.
    pretrained = T5ForConditionalGeneration.from_pretrained(EMBEDDED_MODEL).state_dict()
    assert not torch.equal(state["shared.weight"], pretrained["shared.weight"])


@pytest.mark.slow
def test_progress_is_logged_by_rank_zero_only_once(finished):
    run, _ = finished
    for epoch in range(1, EPOCHS + 1):
        assert run.stdout.count(f"INFO epoch {epoch}: train_loss") == 1, run.describe()
    assert "[rank 1] INFO" not in run.output
    assert "Traceback" not in run.output, run.describe()


@pytest.mark.slow
def test_console_has_no_library_noise_and_progress_lines_show_rates_and_time_left(finished):
    run, _ = finished
    warnings = [line for line in run.output.splitlines() if "Warning" in line]
    assert not warnings, warnings
    # transformers' weight-loading bar: not in a log (bars are drawn on rank 0 at a terminal only).
    assert "Loading weights" not in run.output, run.describe()
    # The end of loading, which scripts/checkpoint_costs.py waits for.
    assert f"INFO training steps 1-{EPOCHS * 12}, from epoch 1 of {EPOCHS}" in run.stdout, run.stdout[-3000:]
    # Not a terminal: no bar (its redrawn lines would fill the log), a progress line per step-log flush.
    assert "Training epoch" not in run.stderr, run.stderr[-2000:]
    line = (
        r"step (\d+)/(\d+) \(epoch \d\) \| loss \d+\.\d{3} \| samples/s [\d.]+ \| tokens/s \d+ \| mfu [\d.]+% \|"
    )
    progress = re.findall(line + r" epoch left \d+:\d\d \| run left (\d+):(\d\d)", run.stdout)
    assert progress, run.stdout[-3000:]
    steps = [int(found[0]) for found in progress]
    assert steps == sorted(steps) and {int(found[1]) for found in progress} == {EPOCHS * 12}, progress
    assert steps[-1] == EPOCHS * 12 and progress[-1][2:] == ("0", "00")  # the last: no time left
    # The closing line: how long, how far, the best metric, where the model and the metrics are.
    closing = re.findall(
        r"run finished in \d+:\d\d: step (\d+), best val_loss [\d.]+ \(epoch (\d)\); model: (\S+);", run.stdout
    )
    assert closing and closing[0][0] == str(EPOCHS * 12) and closing[0][2].endswith("hf_model"), run.stdout[-2000:]


# ------------------------------------------------------------------------------------------ bad inputs


CAUSE = "the cause is the [rank 0] ERROR line above this report"


def check_user_error(run: Run, phrase: str) -> str:
    """A fast non-zero exit, the message once (the line containing `phrase`), no program traceback, and rank 0's
    error file (torchrun's closing report shows it) naming that line."""
    assert run.returncode != 0, run.describe()
    assert run.seconds < FAIL_FAST_S, run.describe()
    lines = [line for line in run.output.splitlines() if phrase in line]
    assert len(lines) == 1, f"{phrase!r} printed {len(lines)} times, expected once\n{run.describe()}"
    tracebacks = program_tracebacks(run.output)
    assert not tracebacks, f"traceback for a user error:\n{tracebacks[0]}\n{run.describe()}"
    # torchrun's closing report names that line as the cause (utils/distributed/process_group.py): a real
    # torchrun shows it; a pooled run has rank 0's error file, which torchrun would read.
    if run.error_files is not None:
        assert 0 in run.error_files and json.loads(run.error_files[0])["message"] == CAUSE, run.error_files
    else:
        assert f"traceback : {CAUSE}" in run.output, run.describe()
    # Nothing that looks like training ran.
    assert "epoch 1:" not in run.output
    return lines[0]


def test_a_refusal_of_a_rank_other_than_0_reaches_torchruns_report(tmp_path, monkeypatch, log_records):
    """An input error of one rank alone (a folder missing on its node, a GPU its LOCAL_RANK does not have):
    that rank logs nothing (the usual error is rank 0's to say, once) and writes it, with its rank, to its
    torchrun error file, which torchrun's closing report shows for the rank that failed first; rank 0's file
    points at its ERROR line."""
    import T5_training
    from configs.errors import DataFileNotFoundError

    monkeypatch.setattr(T5_training, "RANK0_MESSAGE_GRACE_S", 0.0)
    err = DataFileNotFoundError("data/train.csv does not exist on this node: copy it, or share the folder")
    reports = {}
    for rank in (0, 1):
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error{rank}.json"))
        assert T5_training.refusal(err, rank) == 1
        reports[rank] = json.loads((tmp_path / f"error{rank}.json").read_text())["message"]
    assert reports == {0: CAUSE, 1: f"[rank 1] {err}"}
    assert [record.getMessage() for record in log_records if record.levelname == "ERROR"] == [str(err)]


def test_missing_data(tmp_path):
    empty = tmp_path / "empty_data"
    empty.mkdir()
    run = pooled(["--data_dir", str(empty), "--output_dir", str(tmp_path / "out")], timeout=90)
    line = check_user_error(run, "download_wikihow")
    assert "wikihowAll.csv" in line, run.describe()


def test_model_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "does-not-exist"
    run = pooled(["--model_name", str(missing), "--output_dir", str(tmp_path / "out")], timeout=90)
    line = check_user_error(run, "does not exist")
    assert str(missing) in line, run.describe()


def test_weights_that_do_not_fit_their_config_with_rank0_only_loading(tmp_path):
    """FSDP1's rank-0-only loading, where rank 0 alone reads the weights into the other ranks' collectives: a
    config.json whose d_ff is not its weights' ends both ranks with rank 0's one message (tests/test_models.py
    has every path's message, and the unedited folder's load)."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(EMBEDDED_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "d_ff": 128}))
    run = pooled(["--model_name", str(folder), "--cpu_ram_efficient_loading", "true", "--fsdp_version", "1",
                  "--num_train_samples", "8", "--num_val_samples", "4", "--output_dir", str(tmp_path / "out")],
                 timeout=90)  # fmt: skip
    line = check_user_error(run, "do not fit its config.json")
    assert "DenseReluDense.wi.weight is [256, 64] in model.safetensors, and [128, 64]" in line, line
    assert not (tmp_path / "out").exists(), run.describe()


def test_output_dir_not_writable(tmp_path):
    regular_file = tmp_path / "a_file"
    regular_file.write_text("not a folder")
    run = pooled(["--output_dir", str(regular_file / "out")], timeout=90)
    line = check_user_error(run, "not writable")
    assert "output_dir" in line, run.describe()
    assert regular_file.read_text() == "not a folder"


@pytest.mark.slow
def test_refused_combination_stops_before_anything_is_set_up(tmp_path):
    # One refusal of validate.check_settings through torchrun (every rank ends, one message); each rule's
    # message is tested in tests/test_validate.py, each parse error's in tests/test_cli.py.
    run = torchrun(["--fsdp_version", "2", "--wrap_policy", "size_based", "--output_dir", str(tmp_path / "out")],
                   timeout=90)  # fmt: skip
    check_user_error(run, "--wrap_policy size_based has no FSDP2")
    # Refused right after parsing: no process group, no model read, nothing written.
    assert "process group:" not in run.output and "parameters, vocab" not in run.output, run.describe()
    assert not (tmp_path / "out").exists()
