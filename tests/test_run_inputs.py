"""What a resume reads is what its run read: paths resolved once and compared as paths (configs/cli.py), and the
data files and model folder fingerprinted in every checkpoint and checked at a resume
(utils/checkpoint/inputs.py). Units of both, then whole runs on the pooled ranks: one run started with relative
paths (tests/cwd_entry.py resumes it from another working directory), copied for each case."""

import json
import logging
import os
import random
import shutil
from pathlib import Path

import pytest
import xxhash

from configs.cli import config_to_dict, continue_run, parse_args
from configs.errors import ConfigError
from configs.paths import EMBEDDED_MODEL_DIR, REPO_ROOT
from tests.launch import pooled, program_tracebacks
from tests.reference_run import checkpoint_dir, complete_checkpoint_steps, step_lrs
from tests.run_configs import run_config
from tests.test_resume import copy_run, resumed_from, snapshot
from utils.base import layout
from utils.checkpoint.inputs import checked_inputs, data_differences, model_differences, model_fingerprint
from utils.checkpoint.start import StartPoint

WORDS = (
    "the a to and it of in for is pour flour into bowl add water knead ten minutes put oven wait enjoy mix bake "
    "loaf zebra hay every morning give feed pick ripe apples look branch easily come off"
).split()
OTHER_WORDS = "sun moon star river stone tree leaf wind rain snow cloud bird fish wolf fox deer".split()


def write_rows(path: Path, rows: int, words: list[str], seed: int) -> Path:
    """A CSV of `rows` short texts and summaries (the issue's train file: 57 rows, replaced by 40 others)."""
    rng = random.Random(seed)
    lines = ["text,summary"] + [
        " ".join(rng.choices(words, k=rng.randint(10, 30))) + "," + " ".join(rng.choices(words, k=4))
        for _ in range(rows)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def digest(path: Path) -> str:
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


# ----------------------------------------------------------------------------------- paths, read as paths


@pytest.fixture
def inputs_elsewhere(tmp_path, monkeypatch) -> Path:
    """A model folder and a train file under tmp_path/w, and tmp_path/run as the working directory."""
    shutil.copytree(EMBEDDED_MODEL_DIR, tmp_path / "w" / "m_b")
    write_rows(tmp_path / "w" / "train.csv", 57, WORDS, seed=0)
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    return tmp_path


def test_paths_are_made_absolute_once_and_a_hub_name_stays_a_name(inputs_elsewhere):
    config = parse_args(["--model_name", "../w/m_b", "--train_file", "../w/train.csv", "--cache_dir", "c"])
    assert config.train.model_name == str(inputs_elsewhere / "w" / "m_b")
    assert config.data.train_file == str(inputs_elsewhere / "w" / "train.csv")
    assert config.data.cache_dir == str(inputs_elsewhere / "run" / "c")  # a folder the run will make
    # The control: a hub name, and a name that is no folder here, stay as given; empty stays empty.
    config = parse_args(["--model_name", "t5-base", "--dataset_name", "cnn_dailymail"])
    assert (config.train.model_name, config.data.dataset_name, config.data.validation_file) == (
        "t5-base", "cnn_dailymail", ""
    )  # fmt: skip


def test_a_resume_from_another_folder_reads_the_recorded_paths_and_another_spelling_is_no_change(
    inputs_elsewhere, monkeypatch
):
    record = config_to_dict(parse_args(["--model_name", "../w/m_b", "--train_file", "../w/train.csv"]))
    monkeypatch.chdir(inputs_elsewhere / "w")  # a SLURM job submitted from another folder
    config, changes = continue_run(["--resume", "true"], record, "out/config.json")
    assert config.train.model_name == str(inputs_elsewhere / "w" / "m_b") and changes == []
    (inputs_elsewhere / "link").symlink_to(inputs_elsewhere / "w")
    spellings = ["--model_name", "./m_b/", "--train_file", str(inputs_elsewhere / "link" / "train.csv")]
    assert continue_run(spellings, record, "out/config.json")[1] == []
    # The control: another folder is another path, taken to be checked against the checkpoint's fingerprint...
    shutil.copytree(inputs_elsewhere / "w" / "m_b", inputs_elsewhere / "w" / "copy")
    changes = continue_run(["--model_name", "copy"], record, "out/config.json", inputs_recorded=True)[1]
    work = inputs_elsewhere / "w"
    assert changes == [f"--model_name {work / 'copy'} (the run had {work / 'm_b'})"]
    # ... where the checkpoint records its inputs; one written before that holds the run to its path, as it did.
    with pytest.raises(ConfigError, match="--model_name .*/copy: the run being resumed .* cannot be checked"):
        continue_run(["--model_name", "copy"], record, "out/config.json")
    # A file the run did not read is not another path of its input: refused, as before.
    with pytest.raises(ConfigError, match="--test_file .*: the run being resumed was trained with --test_file  "):
        continue_run(["--test_file", str(work / "train.csv")], record, "out/config.json")
    # ... and a hub name is refused as another model, as before.
    with pytest.raises(ConfigError, match="--model_name t5-base: the run being resumed was trained with"):
        continue_run(["--model_name", "t5-base"], record, "out/config.json")


def test_a_recorded_path_that_is_gone_is_said_with_how_to_name_it_anew(inputs_elsewhere):
    record = config_to_dict(parse_args(["--model_name", "../w/m_b"]))
    assert continue_run([], record, "out/config.json")[0].train.model_name.endswith("m_b")  # the control
    (inputs_elsewhere / "w" / "m_b").rename(inputs_elsewhere / "w" / "moved")
    with pytest.raises(ConfigError) as refused:
        continue_run([], record, "out/config.json", inputs_recorded=True)
    assert str(refused.value).startswith(
        f"--model_name {inputs_elsewhere / 'w' / 'm_b'}: the run being resumed read it (out/config.json), and it "
        "is not there. If it moved, name it anew: --model_name NEW_PATH"
    )
    with pytest.raises(ConfigError, match="not there. If it moved, put it back there .its checkpoint was written"):
        continue_run([], record, "out/config.json")  # a checkpoint that cannot check another path
    # A record written before paths were made absolute: the message says what its relative path is relative to.
    record["train_config"]["model_name"] = str(inputs_elsewhere / "w" / "moved")
    record["data_config"]["train_file"] = "w/train.csv"
    with pytest.raises(
        ConfigError, match="--train_file .*/run/w/train.csv: .* relative to the folder the run started"
    ):
        continue_run([], record, "out/config.json")


# ------------------------------------------------------------------------------- fingerprints, compared


def inputs_of(tmp_path: Path, model: Path, train_file: Path, lora: bool = False) -> dict:
    """What a run of `model` on `train_file` records (a new run: nothing to check)."""
    data = run_config(train_file=str(train_file), cache_dir=str(tmp_path / "cache")).data
    return checked_inputs(StartPoint(), data=data, model_name=str(model), lora=lora, accept_changed=False)


def test_a_copied_data_file_and_a_moved_model_folder_are_the_same_inputs(inputs_elsewhere):
    work = inputs_elsewhere / "w"
    recorded = inputs_of(inputs_elsewhere, work / "m_b", work / "train.csv")
    assert recorded["data"]["train"]["bytes"] == (work / "train.csv").stat().st_size
    assert "model.safetensors" not in recorded["model"]["files"]  # the weights are not read (no LoRA)
    shutil.copy(work / "train.csv", inputs_elsewhere / "copied.csv")  # a new modification time, the same bytes
    shutil.move(work / "m_b", inputs_elsewhere / "moved")
    now = inputs_of(inputs_elsewhere, inputs_elsewhere / "moved", inputs_elsewhere / "copied.csv")
    assert data_differences(recorded["data"], now["data"]) == (
        [], [f"{inputs_elsewhere / 'copied.csv'} (the run read {work / 'train.csv'})"]
    )  # fmt: skip
    assert model_differences(recorded["model"], now["model"]) == (
        [], [f"the model folder {inputs_elsewhere / 'moved'} (the run's was {work / 'm_b'})"]
    )  # fmt: skip
    # The control: the same paths, nothing to say.
    assert data_differences(recorded["data"], recorded["data"]) == ([], [])
    assert model_differences(recorded["model"], recorded["model"]) == ([], [])


def test_a_changed_file_is_named_with_what_changed(inputs_elsewhere):
    work = inputs_elsewhere / "w"
    recorded = inputs_of(inputs_elsewhere, work / "m_b", work / "train.csv", lora=True)
    assert "header_xxh3_128" in recorded["model"]["files"]["model.safetensors"]  # LoRA's base weights: headers
    write_rows(work / "train.csv", 40, OTHER_WORDS, seed=5)
    config_file = work / "m_b" / "tokenizer_config.json"
    text = config_file.read_text()
    config_file.write_text(text.replace('"', "'", 1))  # the same size
    now = inputs_of(inputs_elsewhere, work / "m_b", work / "train.csv", lora=True)
    size = (work / "train.csv").stat().st_size
    assert data_differences(recorded["data"], now["data"]) == (
        [f"{work / 'train.csv'} changed: {size:,} bytes, the run read {recorded['data']['train']['bytes']:,}"], []
    )  # fmt: skip
    same_size = f"{config_file} changed: the run's {len(text):,} bytes, other content"
    assert model_differences(recorded["model"], now["model"]) == (
        [f"the model folder {work / 'm_b'}: {same_size}"],
        [],
    )


def test_other_weights_under_lora_are_another_base(inputs_elsewhere):
    model = inputs_elsewhere / "w" / "m_b"
    recorded = model_fingerprint(str(model), lora=True)
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    header_length = int.from_bytes(data[:8], "little")
    data[-4:] = b"\0\0\0\0"  # other values, the same tensors: not a header's business (never read in full)
    weights.write_bytes(bytes(data))
    assert model_fingerprint(str(model), lora=True) == recorded
    header = data[8 : 8 + header_length].replace(b'"F32"', b'"F16"', 1)  # other tensors, the same size
    weights.write_bytes(bytes(data[:8] + header + data[8 + header_length :]))
    assert model_differences(recorded, model_fingerprint(str(model), lora=True))[0] == [
        f"the model folder {model}: {weights} changed: the run's {len(data):,} bytes, other tensors in them"
    ]


def checkpoint_of(folder: Path, inputs: dict | None) -> StartPoint:
    """A checkpoint's train_state.json as the manager writes it (without `inputs`: as before they were kept)."""
    folder.mkdir(parents=True)
    state = {"format_version": layout.FORMAT_VERSION, "checkpoint_type": layout.FULL, "has_optimizer": True,
             "world_size": 2, "progress": {"epoch": 1, "samples_consumed": 32, "global_step": 4}}  # fmt: skip
    if inputs is not None:
        state["inputs"] = inputs
    (folder / layout.STATE_FILE).write_text(json.dumps(state))
    return StartPoint(str(folder), layout.FULL)


def test_a_resume_refuses_changed_inputs_unless_told_and_a_checkpoint_before_fingerprints_is_not_checked(
    inputs_elsewhere, log_records
):
    work = inputs_elsewhere / "w"
    recorded = inputs_of(inputs_elsewhere, work / "m_b", work / "train.csv")
    data = run_config(train_file=str(work / "train.csv"), cache_dir=str(inputs_elsewhere / "cache")).data

    def resume(start: StartPoint, accept_changed: bool) -> dict:
        return checked_inputs(
            start, data=data, model_name=str(work / "m_b"), lora=False, accept_changed=accept_changed
        )

    checkpoint = checkpoint_of(inputs_elsewhere / "step_4", recorded)
    assert resume(checkpoint, accept_changed=False) == recorded  # the control: unchanged, nothing said
    assert not log_records
    write_rows(work / "train.csv", 40, OTHER_WORDS, seed=5)
    with pytest.raises(
        ConfigError, match=r"was trained on other inputs than this resume reads: .*train.csv changed"
    ):
        resume(checkpoint, accept_changed=False)
    now = resume(checkpoint, accept_changed=True)
    assert now["data"]["train"]["xxh3_128"] == digest(work / "train.csv")  # what later checkpoints record
    [line] = [record.getMessage() for record in log_records]
    assert line.startswith("--accept_changed_inputs true: continuing on other inputs than checkpoint")
    assert "the epoch goes on after the first 32 samples of the new rows' shuffled order" in line
    log_records.clear()
    assert resume(checkpoint_of(inputs_elsewhere / "old", None), accept_changed=False) == now
    [line] = [(record.levelno, record.getMessage()) for record in log_records]
    assert line[0] == logging.WARNING and "were not checked against what it trained on" in line[1]


# ---------------------------------------------------------------------------------------- whole runs

# 57 rows: 55 train, 2 held out; 2 ranks of 4: 7 steps an epoch, a checkpoint every 2 steps and at epoch ends;
# a linear LR schedule, which a resume on other rows spreads over the steps they leave.
RUN = ["--epochs", "2", "--max_source_length", "64", "--max_target_length", "16", "--eval_rouge", "false",
       "--mixed_precision", "false", "--save_every_n_steps", "2", "--keep_last_n", "10",
       "--lr_scheduler", "linear"]  # fmt: skip
STOP = 4  # the checkpoint resumed: epoch 1, 32 samples into it
NOT_CHECKED = "were not checked against what it trained on"


@pytest.fixture(scope="module")
def started_with_relative_paths(tmp_path_factory) -> Path:
    """A finished run of a copy of the tiny T5 on a 57-row train file, both named by paths relative to the
    working directory it started in (the repository)."""
    base = tmp_path_factory.mktemp("relative")
    shutil.copytree(EMBEDDED_MODEL_DIR, base / "w" / "m_b")
    write_rows(base / "w" / "train.csv", 57, WORDS, seed=0)
    relative = {name: os.path.relpath(base / "w" / name, REPO_ROOT) for name in ("m_b", "train.csv")}
    run = pooled([*RUN, "--model_name", relative["m_b"], "--train_file", relative["train.csv"],
                  "--output_dir", str(base / "out")])  # fmt: skip
    assert run.returncode == 0, run.describe()
    assert STOP in complete_checkpoint_steps(base / "out")
    return base


def resume_from(cwd: Path, args: list[str]):
    """T5_training.py args, run from the folder `cwd` (tests/cwd_entry.py)."""
    return pooled(args, script="tests/cwd_entry.py", env={"RUN_CWD": str(cwd)})


def one_line(run, phrase: str) -> str:
    lines = [line for line in run.output.splitlines() if phrase in line]
    assert len(lines) == 1, f"{phrase!r} printed {len(lines)} times, expected once\n{run.describe()}"
    return lines[0]


@pytest.mark.slow
def test_a_rewritten_train_file_is_refused_at_resume_and_continued_on_only_when_asked(
    started_with_relative_paths, tmp_path
):
    base = started_with_relative_paths
    out, train_file = copy_run(base / "out", tmp_path / "out"), base / "w" / "train.csv"
    resume = ["--output_dir", str(out), "--resume", str(checkpoint_dir(out, STOP))]
    saved = train_file.read_bytes()
    write_rows(train_file, 40, OTHER_WORDS, seed=5)
    try:
        before = snapshot(out)
        refused = pooled(resume)
        assert refused.returncode != 0, refused.describe()
        line = one_line(refused, "was trained on other inputs than this resume reads")
        assert f"{train_file} changed: {train_file.stat().st_size:,} bytes, the run read {len(saved):,}" in line
        assert "(epoch 1, 32 samples into it, step 4)" in line and "--accept_changed_inputs true" in line
        assert not program_tracebacks(refused.output) and "resumed from" not in refused.output
        assert snapshot(out) == before  # nothing of the run was changed

        continued = pooled([*resume, "--accept_changed_inputs", "true"])
        assert continued.returncode == 0, continued.describe()
        one_line(continued, "--accept_changed_inputs true: continuing on other inputs than checkpoint")
        assert resumed_from(continued) == (checkpoint_dir(out, STOP), 1, STOP)
        assert "rows: train 38 (all)" in continued.output  # the new file's rows, 2 held out
        newest_file = checkpoint_dir(out, complete_checkpoint_steps(out)[-1]) / layout.STATE_FILE
        newest = json.loads(newest_file.read_text())
        assert newest["inputs"]["data"]["train"]["xxh3_128"] == digest(train_file)
        # 6 steps left on the new rows where the schedule had 10: its rest spread over them, down to 0 at the end.
        one_line(continued, "6 steps left where the schedule had 10 (the run's shape or data changed)")
        rates = [rate for _, rate in sorted(step_lrs(out).items())]
        assert len(rates) == STOP + 6 and all(b < a for a, b in zip(rates, rates[1:], strict=False)), rates
        assert newest["scheduler"]["_last_lr"] == [0.0]
    finally:
        train_file.write_bytes(saved)
    # The control: the file as the run read it resumes as before, saying nothing of its inputs, from another
    # working directory (the run started with relative paths), naming the model folder by another spelling.
    other = tmp_path / "elsewhere"
    other.mkdir()
    control_out = copy_run(base / "out", tmp_path / "control")
    spelling = os.path.relpath(base / "w" / "m_b", other)
    run = resume_from(other, ["--output_dir", str(control_out), "--resume", str(checkpoint_dir(control_out, STOP)),
                              "--model_name", spelling])  # fmt: skip
    assert run.returncode == 0, run.describe()
    assert resumed_from(run) == (checkpoint_dir(control_out, STOP), 1, STOP)
    for said in ("changed here", "other inputs", "read at other paths", NOT_CHECKED):
        assert said not in run.output, run.describe()
    assert "rows: train 55 (all)" in run.output


@pytest.mark.slow
def test_a_moved_model_folder_is_named_anew_and_taken_where_its_content_matches(
    started_with_relative_paths, tmp_path
):
    base = started_with_relative_paths
    out = copy_run(base / "out", tmp_path / "out")
    model, moved = base / "w" / "m_b", tmp_path / "moved" / "m_b"
    resume = ["--output_dir", str(out), "--resume", str(checkpoint_dir(out, STOP))]
    moved.parent.mkdir()
    shutil.move(model, moved)
    try:
        gone = pooled(resume)  # the record's folder is not there: said before anything is imported
        assert gone.returncode != 0, gone.describe()
        assert f"--model_name {model}: the run being resumed read it" in one_line(gone, "name it anew")

        tokenizer_config = moved / "tokenizer_config.json"
        saved = tokenizer_config.read_bytes()
        tokenizer_config.write_bytes(saved + b"\n")
        other = pooled([*resume, "--model_name", str(moved)])
        assert other.returncode != 0, other.describe()
        line = one_line(other, "was trained on other inputs than this resume reads")
        assert f"the model folder {moved} (the run's was {model}): {tokenizer_config} changed" in line
        tokenizer_config.write_bytes(saved)

        taken = pooled([*resume, "--model_name", str(moved)])
        assert taken.returncode == 0, taken.describe()
        assert f"the model folder {moved} (the run's was {model})" in one_line(taken, "read at other paths")
        assert resumed_from(taken) == (checkpoint_dir(out, STOP), 1, STOP)
    finally:
        shutil.move(moved, model)


@pytest.mark.slow
def test_a_checkpoint_written_before_fingerprints_resumes_with_one_line(started_with_relative_paths, tmp_path):
    out = copy_run(started_with_relative_paths / "out", tmp_path / "out")
    state_file = checkpoint_dir(out, complete_checkpoint_steps(out)[-1]) / layout.STATE_FILE
    state = json.loads(state_file.read_text())
    assert "inputs" in state  # the control: a checkpoint of this version records them
    del state["inputs"]
    state_file.write_text(json.dumps(state))
    run = pooled(["--output_dir", str(out), "--resume", "true"])  # a finished run: it changes nothing
    assert run.returncode == 0, run.describe()
    assert str(state_file.parent) in one_line(run, NOT_CHECKED)
    assert "had finished" in run.output
