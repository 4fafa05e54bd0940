"""HF's flag names (configs/hf_names.py): each becomes this package's flag with one line, on the command line
and in a --config file; names with no meaning here are left out with what the package does instead; an
unknown flag's suggestions put HF's names first."""

import os
from pathlib import Path

import pytest

import T5_training
from configs import hf_names
from configs.cli import build_parser, hf_name_notes, own_flags, parse_args
from configs.data import DataConfig
from configs.errors import ConfigError
from tests.test_cli import all_fields

# The 16 flags a user of run_summarization.py / Seq2SeqTrainer types first (issue 46), with what each becomes.
FIRST_FLAGS = {
    ("--per_device_train_batch_size", "4"): ("train", "batch_size_training", 4),
    ("--per_device_eval_batch_size", "8"): ("train", "val_batch_size", 8),
    ("--learning_rate", "3e-4"): ("train", "lr", 3e-4),
    ("--num_train_epochs", "3.0"): ("train", "epochs", 3),
    ("--lr_scheduler_type", "cosine"): ("recipe", "lr_scheduler", "cosine"),
    ("--save_steps", "10"): ("checkpointing", "save_every_n_steps", 10),
    ("--logging_steps", "5"): ("observe", "log_every_n_steps", 5),
    ("--eval_steps", "20"): ("evaluation", "eval_every_n_steps", 20),
    ("--bf16", "False"): ("fsdp", "mixed_precision", False),
    ("--dataloader_num_workers", "3"): ("train", "num_workers_dataloader", 3),
    ("--gradient_checkpointing", "False"): ("fsdp", "fsdp_activation_checkpointing", False),
    ("--warmup_ratio", "0.1"): ("recipe", "warmup_ratio", 0.1),
    ("--model_name_or_path", "data/tiny-t5"): ("train", "model_name", os.path.abspath("data/tiny-t5")),  # a path
    ("--max_train_samples", "64"): ("data", "num_train_samples", 64),
    ("--save_total_limit", "3"): ("checkpointing", "keep_last_n", 3),
    ("--report_to", "tensorboard"): ("observe", "tensorboard", True),
}
LEFT_OUT = ["--do_train", "--do_eval", "--predict_with_generate", "--overwrite_output_dir", "--overwrite_cache"]
# (with --do_train true, --do_eval asks for nothing more than a run does)


def test_each_hf_name_becomes_its_flag_with_one_line():
    argv = [token for flag in FIRST_FLAGS for token in flag]
    config = parse_args(argv)
    for flag, (section, field, want) in FIRST_FLAGS.items():
        assert getattr(getattr(config, section), field) == pytest.approx(want), flag
    notes = hf_name_notes(argv)
    assert "--learning_rate 3e-4 -> --lr 3e-4" in notes
    assert "--bf16 False -> --mixed_precision false" in notes
    assert len(notes) == len(FIRST_FLAGS) - 1  # warmup_ratio is this package's own name too


@pytest.mark.parametrize("name", ["--generation_max_length", "--val_max_target_length"])
def test_hfs_generation_lengths_set_the_generated_tokens_not_training_truncation(name):
    """What a mistyped one was led to before (--max_target_length, which cuts training's targets)."""
    config = parse_args([name, "64"])
    assert (
        config.evaluation.max_new_tokens == 64 and config.data.max_target_length == DataConfig().max_target_length
    )


@pytest.mark.parametrize(
    ("argv", "mixed_precision", "use_fp16"),
    [
        (["--bf16"], True, False),
        (["--fp16"], True, True),
        (["--fp16", "True", "--bf16", "False"], True, True),  # either order: read together, as HF reads them
        (["--bf16", "False", "--fp16", "True"], True, True),
        (["--bf16", "false"], False, False),
        (["--bf16", "True", "--fp16", "True"], None, None),  # refused, as HF refuses it
    ],
)
def test_bf16_and_fp16_are_read_together(argv, mixed_precision, use_fp16):
    if mixed_precision is None:
        with pytest.raises(ConfigError, match="both true"):
            parse_args(argv)
        return
    fsdp = parse_args(argv).fsdp
    assert (fsdp.mixed_precision, fsdp.use_fp16) == (mixed_precision, use_fp16)


@pytest.mark.parametrize(
    ("argv", "evaluate_only", "eval_split"),
    [
        (["--do_train", "--do_eval"], False, "auto"),
        (["--do_eval"], True, "auto"),
        (["--do_predict"], True, "test"),
        (["--do_train", "False", "--do_eval", "True", "--do_predict", "True"], True, "auto"),
    ],
)
def test_do_eval_or_predict_without_training_evaluates_only(argv, evaluate_only, eval_split):
    evaluation = parse_args(argv).evaluation
    assert (evaluation.evaluate_only, evaluation.eval_split) == (evaluate_only, eval_split)


def test_strategies_of_no_switch_the_feature_off():
    config = parse_args(["--eval_strategy", "no", "--save_strategy", "no", "--logging_strategy", "steps"])
    assert (config.train.run_validation, config.checkpointing.keep_last_n) == (False, 0)
    assert parse_args(["--eval_strategy", "epoch"]).train.run_validation


@pytest.mark.parametrize("strategy", ["epoch", "no"])
def test_steps_beside_a_strategy_that_ignores_them_are_left_out_as_hf_leaves_them(strategy):
    """A template's --eval_steps 500 beside --eval_strategy epoch evaluates every epoch only (HF ignores the
    steps then), not also every 500 steps; the same for saves; beside steps, the steps are taken."""
    argv = ["--eval_strategy", strategy, "--eval_steps", "100", "--save_strategy", strategy, "--save_steps", "200"]
    config = parse_args(argv)
    assert (config.evaluation.eval_every_n_steps, config.checkpointing.save_every_n_steps) == (0, 0)
    said = hf_name_notes(argv)
    assert (
        f"--eval_steps 100: left out (--eval_strategy {strategy}: HF ignores it then, and so does this run)"
        in said
    )
    assert (
        f"--save_steps 200: left out (--save_strategy {strategy}: HF ignores it then, and so does this run)"
        in said
    )
    steps = parse_args(["--eval_strategy", "steps", "--eval_steps", "100", "--save_steps", "200"])
    assert (steps.evaluation.eval_every_n_steps, steps.checkpointing.save_every_n_steps) == (100, 200)


def test_a_setting_given_by_its_own_flag_and_by_an_hf_name_is_refused_in_either_order():
    """Which would win depended on nothing the user sees (the HF name, translated last, always did)."""
    for argv, own, hf in (
        (["--lr", "1e-3", "--learning_rate", "3e-4"], "--lr", "--learning_rate"),
        (["--learning_rate=3e-4", "--lr=1e-3"], "--lr", "--learning_rate"),
        (["--mixed_precision", "false", "--bf16"], "--mixed_precision", "--bf16"),
        (["--tensorboard", "true", "--report_to", "wandb"], "--tensorboard", "--report_to"),
        (
            ["--batch-size", "4", "--per_device_train_batch_size", "8"],
            "--batch-size",
            "--per_device_train_batch_size",
        ),
    ):
        with pytest.raises(ConfigError, match=f"{own} given twice, by its own flag and by an HF name \\({hf}\\)"):
            parse_args(argv)
    assert parse_args(["--learning_rate", "3e-4", "--epochs", "3"]).train.lr == 3e-4  # no overlap: both taken


def test_names_with_no_meaning_here_are_left_out_with_what_the_package_does():
    argv = [*LEFT_OUT, "True", "--epochs", "5"]  # HF's boolean with a value, then one of ours
    assert parse_args(argv).train.epochs == 5
    notes = hf_name_notes(argv)
    assert len(notes) == len(LEFT_OUT) and all(": left out (" in note for note in notes), notes
    assert "evaluate_only true" in notes[0] and "--eval_rouge true" in notes[2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num_train_epochs", "1.5"], "whole epochs.*--max_steps"),
        (["--lr_scheduler_type", "polynomial"], "linear, cosine and constant"),
        (["--bf16", "maybe"], "True or False"),
        (["--report_to", "comet_ml"], "comet_ml is not one"),
        (["--learning_rate"], "needs a value"),
        (["--num_train_epochs", "inf"], "whole epochs"),
        (["--save_total_limit", "0"], "keeps every checkpoint then"),
        (["--do_train", "False"], "nothing to do"),
        (["--eval_strategy", "sometimes"], "no, steps and epoch"),
        # two HF names for one setting, given two values: which would win depends on their order alone
        (["--generation_max_length", "64", "--val_max_target_length", "80"], "give --max_new_tokens two values"),
        # HF 5 reads a number below 1 as a share of the run: named with the flag that counts steps here
        (
            ["--eval_steps", "0.1"],
            "--eval_steps 0.1: HF reads a number below 1 as a share.*--eval_every_n_steps N",
        ),
        (
            ["--logging_steps", "0.5"],
            "share of the run's steps; this package counts steps: give --log_every_n_steps",
        ),
        (
            ["--warmup_steps", "0.05"],
            "takes an integer, not '0.05' \\(a share of the run's steps is --warmup_ratio",
        ),
    ],
)
def test_values_this_package_cannot_honour_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)


def test_the_names_work_in_a_config_file(tmp_path):
    path = tmp_path / "hf.yaml"
    path.write_text("learning_rate: 0.001\ntrain:\n  per_device_train_batch_size: 2\nbf16: true\ndo_train: true\n")
    config = parse_args(["--config", str(path)])
    assert (config.train.lr, config.train.batch_size_training, config.fsdp.mixed_precision) == (0.001, 2, True)
    notes = hf_name_notes(["--config", str(path)])
    assert "learning_rate 0.001 -> --lr 0.001" in notes and any(
        n.startswith("do_train true: left out") for n in notes
    )
    assert parse_args(["--config", str(path), "--lr", "0.5"]).train.lr == 0.5  # flags win over the file
    path.write_text("learning_rate: 0.001\nlr: 0.002\n")
    with pytest.raises(ConfigError, match="lr given twice"):
        parse_args(["--config", str(path)])


def test_an_unknown_flag_suggests_hf_names_first():
    with pytest.raises(ConfigError) as refused:
        parse_args(["--learning_rat", "3e-4"])
    first = str(refused.value).split("did you mean ", 1)[1]
    assert first.startswith("--learning_rate (HF's name: --lr)")


def test_no_hf_name_is_one_of_this_packages_flags():
    """A name that were both would mean two things."""
    ours = {name for _, name in all_fields()} | {flag.lstrip("-") for flag in own_flags(build_parser())}
    assert not ours & set(hf_names.HF_NAMES)


def test_the_run_says_each_name_at_start(log_records):
    T5_training.read_settings(["--learning_rate", "3e-4", "--do_train"])
    said = [r.getMessage() for r in log_records]
    assert "HF's name: --learning_rate 3e-4 -> --lr 3e-4" in said
    assert any(line.startswith("HF's name: --do_train: left out") for line in said)


def test_the_docs_table_is_the_codes():
    text = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert hf_names.markdown() in text
