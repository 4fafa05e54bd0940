"""HF's flag names (configs/hf_names.py): each becomes this package's flag with one line, on the command line
and in a --config file; names with no meaning here are left out with what the package does instead; an
unknown flag's suggestions put HF's names first."""

import os
from pathlib import Path

import pytest

import T5_training
from configs import hf_names
from configs.cli import build_parser, field_specs, hf_name_notes, own_flags, parse_args
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


# What a user of the Llama 2 guide's training script or of TRL's SFTTrainer types (issue 66), and what each gets:
# ("becomes", {field: value}, a phrase of its one line); ("left out", a phrase of its line: what the package does
# instead); ("refused", a phrase of the one message); ("own", {field: value}): the package's own flag, no line;
# ("unknown", the flags of its hint): a name with no meaning here is hinted only at a flag it misspells.
GUIDE_AND_TRL_NAMES = {
    ("--use_peft_lora", "True"): ("becomes", {"peft": "lora"}, "--use_peft_lora True -> --peft lora"),
    ("--use_peft_lora", "False"): ("becomes", {"peft": "none"}, "-> --peft none"),
    ("--use_peft",): ("becomes", {"peft": "lora"}, "--use_peft -> --peft lora"),
    ("--max_length", "2048"): ("becomes", {"max_seq_len": 2048}, "--max_length 2048 -> --max_seq_len 2048"),
    ("--max_seq_length", "512"): ("becomes", {"max_seq_len": 512}, "-> --max_seq_len 512"),
    ("--assistant_only_loss", "True"): ("becomes", {"completion_only_loss": True}, "-> --completion_only_loss"),
    ("--assistant_only_loss", "False"): ("left out", "false, TRL's default: as --completion_only_loss says"),
    ("--padding_free", "True"): ("becomes", {"packing": True}, "-> --packing true (documents packing, the nearest "
                                 "equivalent"),
    ("--padding_free", "False"): ("left out", "false: as here"),
    ("--dataset_num_proc", "8"): ("left out", "tokenises a split of 20,000 rows or more in worker processes"),
    ("--use_reentrant", "False"): ("left out", "always non-reentrant"),
    ("--gradient_checkpointing_use_reentrant", "True"): ("left out", "always non-reentrant"),
    ("--dataset_train_split", "train"): ("left out", "the split trained on"),
    ("--dataset_train_split", "train_sft"): ("refused", "cannot choose another by name: give that split's file "
                                             "as --train_file"),
    ("--dataset_test_split", "test"): ("becomes", {"eval_split": "test"}, "-> --eval_split test"),
    ("--dataset_test_split", "validation"): ("becomes", {"eval_split": "validation"}, "-> --eval_split"),
    ("--dataset_test_split", "test_sft"): ("refused", "the splits here are named train, validation, test"),
    ("--dataset_config", "default"): ("becomes", {"dataset_config_name": "default"}, "-> --dataset_config_name"),
    ("--use_4bit_quantization", "False"): ("left out", "the model is not quantized"),
    ("--use_4bit_quantization", "True"): ("refused", "QLoRA .* is not done here"),
    ("--use_8bit_quantization", "True"): ("refused", "QLoRA .* is not done here"),
    ("--load_in_4bit",): ("refused", "QLoRA .* is not done here"),
    ("--load_in_8bit",): ("refused", "QLoRA .* is not done here"),
    ("--use_nested_quant", "True"): ("left out", "beside a quantization switch at true only"),
    ("--use_bnb_nested_quant",): ("left out", "beside a quantization switch at true only"),
    ("--bnb_4bit_compute_dtype", "bfloat16"): ("left out", "beside a quantization switch at true only"),
    ("--bnb_4bit_quant_type", "nf4"): ("left out", "beside a quantization switch at true only"),
    ("--bnb_4bit_quant_storage_dtype", "bfloat16"): ("left out", "beside a quantization switch at true only"),
    ("--save_only_model",): ("becomes", {"save_optimizer": False}, "-> --save_optimizer false"),
    ("--eval_accumulation_steps", "4"): ("left out", "evaluation holds no logits"),
    # the same names as the package's own flags
    ("--dataset_text_field", "content"): ("own", {"dataset_text_field": "content"}),
    ("--packing", "True"): ("own", {"packing": True}),
    ("--completion_only_loss", "false"): ("own", {"completion_only_loss": False}),
    ("--max_seq_len", "2048"): ("own", {"max_seq_len": 2048}),
    ("--lora_r", "16"): ("own", {"lora_r": 16}),
    ("--lora_alpha", "16"): ("own", {"lora_alpha": 16}),
    ("--lora_dropout", "0.05"): ("own", {"lora_dropout": 0.05}),
    ("--lora_target_modules", "all-linear"): ("own", {"lora_target_modules": "all-linear"}),  # test_causal.py
    ("--weight_decay", "1e-4"): ("own", {"weight_decay": 1e-4}),
    ("--neftune_noise_alpha", "5"): ("own", {"neftune_noise_alpha": 5.0}),
    ("--packing_strategy", "bfd"): ("own", {"packing_strategy": "bfd"}),
    ("--eos_token", "<|endoftext|>"): ("own", {"eos_token": "<|endoftext|>"}),
    # no meaning here, and no flag they misspell: no hint (difflib's default cutoff led --use_reentrant to
    # --save_strategy, --padding_free to --learning_rate)
    **{tuple(argv.split()): ("unknown", []) for argv in (
        "--chat_template_format chatml", "--add_special_tokens False", "--append_concat_token False",
        "--splits train,test", "--push_to_hub", "--hub_private_repo True", "--hub_strategy every_save",
        "--log_level info", "--use_unsloth True", "--torch_dtype bfloat16", "--dtype bfloat16",
        "--model_revision main", "--trust_remote_code", "--use_liger_kernel", "--lora_modules_to_save lm_head",
        "--use_dora", "--use_rslora", "--lora_task_type CAUSAL_LM", "--dataset_kwargs {}",
        "--model_init_kwargs {}", "--pad_token <pad>", "--eval_packing false", "--pad_to_multiple_of 8",
        "--activation_offloading", "--dataset_streaming", "--max_prompt_length 512",
        "--chat_template_path x.jinja", "--loss_type nll", "--optim adamw_torch",
        "--ddp_find_unused_parameters False",
    )},
    # a flag they misspell, or whose options they are: that flag
    ("--gradient_checkpointing_kwargs", "{}"): (
        "unknown", ["--gradient_checkpointing", "--use_gradient_checkpointing"]),
    ("--lr_scheduler_kwargs", "{}"): ("unknown", ["--lr_scheduler"]),
    ("--metric_for_best_model", "eval_loss"): ("unknown", ["--metric_for_best"]),
}  # fmt: skip


def field_values(config, wanted: dict) -> dict:
    section_of = {spec.name: spec.section for spec in field_specs()}
    return {name: getattr(getattr(config, section_of[name]), name) for name in wanted}


def hinted(message: str, token: str) -> list[str] | None:
    """The flags an unknown argument's line of `message` suggests ([] for none), None where it has no line."""
    for line in message.splitlines()[1:]:
        if line.strip().startswith(f"{token}: did you mean "):
            return [part.split(" (")[0] for part in line.split("did you mean ", 1)[1].rstrip("?").split(" or ")]
    return None


@pytest.mark.parametrize("argv", list(GUIDE_AND_TRL_NAMES), ids=" ".join)
def test_each_name_a_guide_or_trl_user_types_becomes_a_flag_is_left_out_or_refused_in_one_line(argv):
    argv = list(argv)
    kind, *expected = GUIDE_AND_TRL_NAMES[tuple(argv)]
    if kind == "refused":
        with pytest.raises(ConfigError, match=expected[0]) as refused:
            parse_args(argv)
        assert len(str(refused.value).splitlines()) == 1
        return
    if kind == "unknown":
        with pytest.raises(ConfigError, match="unknown argument") as refused:
            parse_args(argv)
        message = str(refused.value)
        assert (hinted(message, argv[0]) or []) == expected[0], message
        assert all(hinted(message, value) is None for value in argv[1:]), message  # nor its value
        return
    config, notes = parse_args(argv), hf_name_notes(argv)
    if kind == "left out":
        assert config == parse_args([]) and len(notes) == 1, notes
        assert notes[0].startswith(f"{' '.join(argv)}: left out (") and expected[0] in notes[0], notes
        return
    assert field_values(config, expected[0]) == expected[0]
    if kind == "own":
        assert notes == []
        return
    assert len(notes) == 1 and expected[1] in notes[0], notes
    assert config == parse_args([token for field, value in expected[0].items()
                                 for token in (f"--{field}", str(value).lower() if isinstance(value, bool)
                                               else str(value))])  # fmt: skip


def test_qloras_flags_are_refused_once_naming_each():
    """The guide's QLoRA command: one message for its four flags, not one per flag, nor a flag left out."""
    argv = ["--use_4bit_quantization", "True", "--use_nested_quant", "True", "--bnb_4bit_compute_dtype",
            "bfloat16", "--bnb_4bit_quant_storage_dtype", "bfloat16"]  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        parse_args(argv)
    message = str(refused.value)
    assert message.startswith(
        "--use_4bit_quantization true --use_nested_quant true --bnb_4bit_compute_dtype bfloat16 "
        "--bnb_4bit_quant_storage_dtype bfloat16: QLoRA"
    )
    assert "(--peft lora)" in message
    # the control: its switch at false (the guide's LoRA command gives it) leaves every one out
    argv[1] = "False"
    assert parse_args(argv) == parse_args([]) and len(hf_name_notes(argv)) == 4
