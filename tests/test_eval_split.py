"""Splits as the sources give them (--eval_split on training runs): the loaders each setting builds on a folder
of train and test files (and the controls: one with its own validation split, one of train alone), the rows of
train with the held-out ones put back, the refusals, what a checkpoint records and a resume keeps; then whole
runs on the pooled ranks: auto scores the test split once after training and trains bit-identically to the same
folder without it; test evaluates on the test split with every train row, bit-identically to a folder whose
validation file is that test file; a resume with another --eval_split is refused."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from transformers import T5Tokenizer

from configs.data import DataConfig
from configs.errors import ConfigError, DataError
from configs.evaluation import EvalConfig
from configs.paths import EMBEDDED_MODEL_DIR
from configs.run import RunConfig
from configs.training import TrainConfig
from configs.validate import check_evaluation
from scripts.make_tiny_family import make
from summarization_dataset import FORMAT
from tests.launch import pooled
from tests.reference_run import read_records
from tests.test_sources import ONE_CPU_RANK, one_rank_loaders, write_rows
from utils.base import layout
from utils.checkpoint.inputs import checked_splits
from utils.checkpoint.start import StartPoint
from utils.data.loaders import build_loaders
from utils.train.build import log_evaluation_plan


def rows(split: str, count: int) -> list[dict]:
    return [{"id": f"{split}-{i}", "document": f"{split} text number {i}", "summary": f"{split} sum {i}"}
            for i in range(count)]  # fmt: skip


def data_folder(root: Path, **counts: int) -> Path:
    """A folder of <split>.jsonl files, `counts` rows each."""
    for split, count in counts.items():
        write_rows(root / f"{split}.jsonl", rows(split, count))
    return root


@pytest.fixture(scope="module")
def tokenizer():
    return T5Tokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR))


def said(log_records) -> list[str]:
    return [record.getMessage() for record in log_records]


def ids(loader) -> list[str]:
    dataset = loader.dataset
    return [dataset.row_id(i) for i in range(len(dataset))]


def test_auto_scores_the_test_split_after_training_where_validation_is_held_out(tmp_path, tokenizer, log_records):
    """train and test files: 5% of train held out chooses the model (as before), and the test split is loaded
    to be scored once after training, said at start. Controls: a folder with a validation file of its own, and
    one of train alone, build what they built before (no split scored after training)."""
    data = DataConfig(dataset_name=str(data_folder(tmp_path / "tt", train=40, test=5)))
    loaders = one_rank_loaders(tokenizer, data)
    assert (len(loaders.train.dataset), len(loaders.val.dataset)) == (38, 2)
    assert loaders.val.dataset.split == "validation" and set(ids(loaders.val)) <= {f"train-{i}" for i in range(40)}
    assert loaders.final.loader.dataset.split == "test" and ids(loaders.final.loader) == [
        f"test-{i}" for i in range(5)
    ]
    assert loaders.final.evaluation.split == "test" and loaders.final.num_real_samples == 5
    assert (loaders.plan.evaluation, loaders.plan.final, loaders.plan.whole_train) == ("validation", "test", False)
    log_evaluation_plan(RunConfig(data=data), loaders)
    assert "rows: train 38 (all), validation 2 (all), test 5 (all)" in said(log_records)
    assert (
        "evaluation after training: the test split's loss and ROUGE of 5 generated outputs, once, by the last "
        "step's model (hf_model_last/ where an earlier epoch was the best; --eval_split auto: the data has no "
        "validation split of its own, so the 2 rows held out of train choose the best model; --eval_split test "
        "evaluates on it instead)"
    ) in said(log_records)

    own_folder = data_folder(tmp_path / "tvt", train=40, validation=3, test=5)
    own = one_rank_loaders(tokenizer, DataConfig(dataset_name=str(own_folder)))
    alone = one_rank_loaders(tokenizer, DataConfig(dataset_name=str(data_folder(tmp_path / "t", train=40))))
    assert (
        own.final is None
        and ids(own.val) == [f"validation-{i}" for i in range(3)]
        and len(own.train.dataset) == 40
    )
    assert alone.final is None and (len(alone.train.dataset), len(alone.val.dataset)) == (38, 2)
    assert ids(alone.train) == ids(loaders.train)  # the same held-out draw, the same train rows
    assert "rows: train 40 (all), validation 3 (all)" in said(log_records)
    assert sum("evaluation after training" in line for line in said(log_records)) == 1


def test_eval_split_test_evaluates_on_it_with_every_train_row_in_the_files_order(tmp_path, tokenizer, log_records):
    """--eval_split test: the test split is the evaluation split, and train keeps the rows auto holds out, in the
    file's order, tokenised as a source without a held-out split tokenises them. Built first, its 40-row token
    cache does not serve auto's 38 held-out-less rows (another key): both read their own rows."""
    folder = data_folder(tmp_path / "tt", train=40, test=5)
    data = DataConfig(dataset_name=str(folder))
    test = one_rank_loaders(tokenizer, data, EvalConfig(eval_split="test"))
    assert ids(test.train) == [f"train-{i}" for i in range(40)]
    assert test.val.dataset.split == "test" and test.evaluation.split == "test" and test.final is None
    assert (test.plan.evaluation, test.plan.whole_train, test.plan.held_out_rows) == ("test", True, 2)
    assert (
        "rows: train 40 (all; the 2 rows --eval_split auto holds out for validation included), test 5 (all)"
        in said(log_records)
    )
    log_evaluation_plan(RunConfig(data=data, evaluation=EvalConfig(eval_split="test")), test)
    assert (
        "evaluation after each epoch on the test split (--eval_split test: it chooses the best model; val_loss is "
        "its loss): test loss and ROUGE of 5 generated outputs (--eval_rouge false switches it off); "
        "--run_validation false switches all evaluation off"
    ) in said(log_records)

    # The same rows as a source with a validation file of its own, which holds nothing out (another cache).
    unheld = data_folder(tmp_path / "tv", train=40)
    shutil.copy(folder / "test.jsonl", unheld / "validation.jsonl")
    control = one_rank_loaders(tokenizer, DataConfig(dataset_name=str(unheld)))
    for i in range(40):
        assert test.train.dataset[i]["source_ids"].tolist() == control.train.dataset[i]["source_ids"].tolist()
        assert test.train.dataset[i]["target_ids"].tolist() == control.train.dataset[i]["target_ids"].tolist()

    auto = one_rank_loaders(tokenizer, data)  # after the 40-row cache of the same text cache
    fresh = one_rank_loaders(tokenizer, DataConfig(dataset_name=str(folder), cache_dir=str(tmp_path / "fresh")))
    assert ids(auto.train) == ids(fresh.train) and len(ids(auto.train)) == 38
    for i in range(38):
        assert auto.train.dataset[i]["source_ids"].tolist() == fresh.train.dataset[i]["source_ids"].tolist()


def test_eval_split_test_without_a_test_split_and_train_in_training_are_refused(tmp_path, tokenizer):
    data = DataConfig(dataset_name=str(data_folder(tmp_path / "t", train=40)))
    no_test = (
        r"--eval_split test evaluates on the test split, and there is no test split in the files .*: add a test"
    )
    with pytest.raises(DataError, match=no_test + r" file .*; or --eval_split auto"):
        one_rank_loaders(tokenizer, data, EvalConfig(eval_split="test"))
    with pytest.raises(
        ConfigError, match="--eval_split train: training evaluates on a split it does not train on"
    ):
        check_evaluation(EvalConfig(eval_split="train"), TrainConfig())
    check_evaluation(EvalConfig(eval_split="train", evaluate_only=True), TrainConfig())  # scores it


def test_evaluate_only_auto_still_scores_the_test_split_where_validation_is_held_out(tmp_path, tokenizer):
    """The control of --evaluate_only: unchanged (auto scores the test split of a source without validation)."""
    data = DataConfig(dataset_name=str(data_folder(tmp_path / "tt", train=40, test=5)))
    evaluation = EvalConfig(evaluate_only=True, eval_metric="accuracy")
    loaders = build_loaders(tokenizer=tokenizer, data_format=FORMAT, data=data, train=TrainConfig(),
                            evaluation=evaluation, info=ONE_CPU_RANK)  # fmt: skip
    assert loaders.train is None and loaders.final is None and loaders.evaluation.split == "test"


def checkpoint_with(folder: Path, inputs: dict) -> StartPoint:
    """A checkpoint folder whose train_state.json records `inputs` (what _checked_splits reads of it)."""
    folder.mkdir(parents=True)
    progress = {"epoch": 1, "samples_consumed": 8, "global_step": 2}
    state = {"format_version": layout.FORMAT_VERSION, "checkpoint_type": layout.FULL, "progress": progress,
             "inputs": inputs}  # fmt: skip
    (folder / layout.STATE_FILE).write_text(json.dumps(state), encoding="utf-8")
    return StartPoint(str(folder), layout.FULL)


HELD = {"train": "train", "evaluation": "validation"}
WHOLE_TEST = {"train": "train+held_out", "evaluation": "test"}


def test_a_checkpoint_records_its_splits_and_a_resume_keeps_them(tmp_path):
    """A new run records them; a resume on the same ones goes on; on others (--eval_split test over a run that
    held validation out, or back) it is refused, naming the value that resumes. A checkpoint written before
    they were recorded trained on train less its held-out rows and chose by validation, whatever its
    --eval_split said (it changed nothing then): auto resumes it, test does not."""
    assert checked_splits(StartPoint(), {"data": {}}, WHOLE_TEST) == {"data": {}, "splits": WHOLE_TEST}
    recorded = checkpoint_with(tmp_path / "new", {"data": {}, "splits": WHOLE_TEST})
    assert checked_splits(recorded, {"data": {}}, WHOLE_TEST)["splits"] == WHOLE_TEST
    with pytest.raises(ConfigError) as refused:
        checked_splits(recorded, {"data": {}}, HELD)
    assert str(refused.value) == (
        f"checkpoint {recorded.path} trained on every train row, evaluated on the test split; this resume would "
        "train on train less any rows held out for validation, evaluated on the validation split, so its rows and "
        "the split that chooses its best model would change mid-run. Resume with --eval_split test (what the "
        "checkpoint trained with), or start a new run in another --output_dir."
    )
    old = checkpoint_with(tmp_path / "old", {"data": {}})
    assert checked_splits(old, {"data": {}}, HELD)["splits"] == HELD
    with pytest.raises(ConfigError, match=r"Resume with --eval_split auto \(what the checkpoint trained with\)"):
        checked_splits(old, {"data": {}}, WHOLE_TEST)


# ---------------------------------------------------------------------------------------------------
# Whole runs (2 pooled CPU ranks, the embedded tiny T5, fp32)
# ---------------------------------------------------------------------------------------------------

RUN = ["--epochs", "2", "--mixed_precision", "false", "--log_every_n_steps", "1", "--eval_num_samples", "4",
       "--max_new_tokens", "8", "--save_every_n_steps", "1000"]  # fmt: skip


def step_losses(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(output_dir) if r["type"] == "step"}


def of_type(output_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_records(output_dir) if r["type"] == kind]


def train_run(tmp_path: Path, name: str, folder: Path, *flags: str):
    output_dir = tmp_path / name
    run = pooled([*RUN, "--dataset_name", str(folder), *flags, "--output_dir", str(output_dir)])
    assert run.returncode == 0, run.describe()
    return run, output_dir


@pytest.mark.slow
def test_runs_on_a_train_and_test_folder(tmp_path):
    """auto: the test split is scored once, after the last epoch, by the last step's model (a test record, an eval
    record and its predictions), and training is bit-identical to the same folder without test.jsonl (the
    control, which scores nothing after training). test: it is the evaluation split of every epoch, and the run
    is bit-identical to a folder whose validation file is that test file (train whole in both). A resume of the
    test run with --eval_split auto is refused before anything loads."""
    folder = data_folder(tmp_path / "tt", train=40, test=6)
    without_test = data_folder(tmp_path / "t", train=40)
    as_validation = data_folder(tmp_path / "tv", train=40)
    shutil.copy(folder / "test.jsonl", as_validation / "validation.jsonl")

    auto, auto_dir = train_run(tmp_path, "auto", folder)
    control, control_dir = train_run(tmp_path, "control", without_test)
    assert "INFO rows: train 38 (all), validation 2 (all), test 6 (all)" in auto.output, auto.describe()
    assert "INFO evaluation after training: the test split's loss and ROUGE of 4 generated outputs" in auto.output
    assert step_losses(auto_dir) == step_losses(control_dir) and len(step_losses(auto_dir)) == 10
    assert [r["val_loss"] for r in of_type(auto_dir, "epoch")] == [
        r["val_loss"] for r in of_type(control_dir, "epoch")
    ]
    (test_record,) = of_type(auto_dir, "test")
    assert (test_record["epoch"], test_record["step"], test_record["split"]) == (2, 10, "test")
    assert test_record["loss"] > 0
    assert "test split after training (the last step's model, step 10): loss " in auto.output
    assert [(r["split"], r["step"]) for r in of_type(auto_dir, "eval")] == [("validation", 5), ("validation", 10),
                                                                           ("test", 10)]  # fmt: skip
    predicted = (auto_dir / "predictions" / "test_step_00000010.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in predicted] == [f"test-{i}" for i in range(4)]
    assert of_type(control_dir, "test") == [] and "evaluation after training" not in control.output
    assert not (control_dir / "predictions" / "test_step_00000010.jsonl").exists()

    test, test_dir = train_run(tmp_path, "test", folder, "--eval_split", "test")
    same, same_dir = train_run(tmp_path, "same", as_validation)
    assert "INFO rows: train 40 (all; the 2 rows --eval_split auto holds out" in test.output, test.describe()
    assert step_losses(test_dir) == step_losses(same_dir) and len(step_losses(test_dir)) == 10
    assert [r["val_loss"] for r in of_type(test_dir, "epoch")] == [
        r["val_loss"] for r in of_type(same_dir, "epoch")
    ]
    assert {r["split"] for r in of_type(test_dir, "eval")} == {"test"} and of_type(test_dir, "test") == []
    assert step_losses(test_dir) != step_losses(auto_dir)  # 40 train rows against 38: another run

    refused = pooled(["--output_dir", str(test_dir), "--resume", "true", "--eval_split", "auto"])
    assert refused.returncode == 2, refused.describe()
    assert "trained on every train row, evaluated on the test split; this resume would train on train less" in (
        refused.output
    ), refused.describe()


@pytest.mark.slow
def test_a_decoder_only_run_scores_the_test_split_with_its_perplexity(tmp_path):
    """Tiny random GPT-2 (prompt and completion rows): auto's test record holds the loss and its perplexity,
    and training is bit-identical to the control without test.jsonl."""
    gpt2 = tmp_path / "gpt2"
    make("gpt2", str(gpt2))
    folder = data_folder(tmp_path / "tt", train=40, test=6)
    flags = ["--model_name", str(gpt2), "--eval_rouge", "false", "--epochs", "1"]
    auto, auto_dir = train_run(tmp_path, "auto", folder, *flags)
    _, control_dir = train_run(tmp_path, "control", data_folder(tmp_path / "t", train=40), *flags)
    assert step_losses(auto_dir) == step_losses(control_dir) and len(step_losses(auto_dir)) == 5
    (record,) = of_type(auto_dir, "test")
    assert record["perplexity"] == pytest.approx(math.exp(record["loss"]))
    assert f"step 5): loss {record['loss']:.4f} (perplexity {record['perplexity']:.2f})" in auto.output
    assert of_type(control_dir, "test") == []
