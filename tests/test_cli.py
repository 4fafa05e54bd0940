"""The command line: every config field is a `--field value` flag, the tutorial's flags are aliases.

In-process and fast: parse_args/build_parser only, no process group. One subprocess checks that
`python T5_training.py --help` works before any distributed setup.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import typing
from dataclasses import fields, replace

import pytest
import yaml
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

from configs import config_file
from configs.checkpointing import CheckpointConfig
from configs.cli import (
    ALIASES,
    NO_CUDA_FLAG,
    build_parser,
    choices_of,
    config_to_dict,
    field_specs,
    format_value,
    parse_args,
)
from configs.config_file import RUN_RECORD_KEYS
from configs.data import DataConfig
from configs.errors import ConfigError, UserError
from configs.evaluation import EvalConfig
from configs.fsdp import FSDPConfig
from configs.lora import LoraConfig
from configs.observability import ObserveConfig
from configs.paths import REPO_ROOT
from configs.recipe import RecipeConfig
from configs.run import RECORD_KEYS, RunConfig
from configs.training import TrainConfig

# The sections of a RunConfig, in order: (attribute, dataclass, key in config.json).
SECTIONS = [
    ("train", TrainConfig, "train_config"),
    ("fsdp", FSDPConfig, "fsdp_config"),
    ("data", DataConfig, "data_config"),
    ("recipe", RecipeConfig, "recipe_config"),
    ("evaluation", EvalConfig, "evaluation_config"),
    ("checkpointing", CheckpointConfig, "checkpointing_config"),
    ("lora", LoraConfig, "lora_config"),
    ("observe", ObserveConfig, "observability_config"),
]

# The names the issue fixes (the README, the tutorial's flags and the run record use them).
REQUIRED_FIELDS = [
    "model_name",
    "data_dir",
    "output_dir",
    "epochs",
    "batch_size_training",
    "val_batch_size",
    "lr",
    "gamma",
    "seed",
    "num_train_samples",
    "num_val_samples",
    "max_source_length",
    "max_target_length",
    "run_validation",
    "save_model",
    "track_memory",
    "mixed_precision",
    "use_fp16",
    "sharding_strategy",
    "backward_prefetch",
    "fsdp_activation_checkpointing",
    "limit_all_gathers",
]

# The tutorial's flags: (argv, section, field, expected value).
TUTORIAL_FLAGS = [
    (["--batch-size", "8"], "train", "batch_size_training", 8),
    (["--test-batch-size", "16"], "train", "val_batch_size", 16),
    (["--epochs", "3"], "train", "epochs", 3),
    (["--lr", "0.01"], "train", "lr", 0.01),
    (["--gamma", "0.7"], "train", "gamma", 0.7),
    (["--seed", "42"], "train", "seed", 42),
    (["--track_memory", "false"], "train", "track_memory", False),
    (["--run_validation", "false"], "train", "run_validation", False),
    (["--save-model"], "train", "save_model", True),
    (["--save-model", "false"], "train", "save_model", False),
    ([NO_CUDA_FLAG], "train", "device", "cpu"),
]


def all_fields() -> list[tuple[str, str]]:
    """(section, name) of every field of every config section, in RunConfig's order."""
    return [(section, f.name) for section, cls, _ in SECTIONS for f in fields(cls)]


def value_of(config: RunConfig, section: str, name: str):
    return getattr(getattr(config, section), name)


def with_field(config: RunConfig, section: str, name: str, value) -> RunConfig:
    """`config` with one field of one section changed."""
    return replace(config, **{section: replace(getattr(config, section), **{name: value})})


def expect_config_error(argv: list[str]) -> str:
    """parse_args(argv) must raise ConfigError (never SystemExit); returns the message."""
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    assert isinstance(info.value, UserError)
    return str(info.value)


def squash(text: str) -> str:
    """Text without any whitespace: immune to argparse's line wrapping."""
    return "".join(text.split())


def help_of(parser, flag: str) -> str:
    """The help string of the action that owns `flag`."""
    for action in parser._actions:
        if flag in action.option_strings:
            return action.help or ""
    raise AssertionError(f"no action owns {flag}")


def non_default_value(spec, default):
    """A valid value of the field's type that differs from its default."""
    hint = spec.type_hint
    if hint is bool:
        return not default
    choices = choices_of(hint)
    if choices is not None:
        for text in choices:
            value = parse_args([f"--{spec.name}", text])
            value = value_of(value, spec.section, spec.name)
            if value != default:
                return value
        raise AssertionError(f"{spec.name}: no choice other than the default")
    if hint is int:
        return default + 1
    if hint is float:
        wider = default * 2 + 1
        return wider if spec.maximum is None or wider <= spec.maximum else (default + spec.maximum) / 2
    if hint is str and spec.path == "path":
        return "/elsewhere/other"  # absolute: a path is read so (configs/cli.py: absolute_path)
    if hint is str:
        return default + "_other"
    if hint == float | None:
        return 0.5 if default is None else None
    if hint == int | None:
        return max(5, spec.minimum or 0) if default is None else None  # within its bounds (--max_seq_len: 8)
    raise AssertionError(f"{spec.name}: unexpected type {hint!r}")


# --------------------------------------------------------------------------------------------- defaults


def test_no_arguments_give_the_dataclass_defaults():
    config = parse_args([])
    assert isinstance(config, RunConfig)
    assert config == RunConfig()
    assert [f.name for f in fields(RunConfig)] == [section for section, _, _ in SECTIONS]
    for section, cls, _ in SECTIONS:
        assert getattr(config, section) == cls()


def test_the_issue_field_names_exist():
    names = {name for _, name in all_fields()}
    missing = [name for name in REQUIRED_FIELDS if name not in names]
    assert not missing, f"config fields missing: {missing}"


def test_field_names_are_unique_across_sections():
    names = [name for _, name in all_fields()]
    assert len(names) == len(set(names))


def test_field_specs_cover_every_field_with_help():
    specs = field_specs()
    assert [(s.section, s.name) for s in specs] == all_fields()
    for spec in specs:
        assert spec.help.strip(), f"{spec.name} has no help text"


def test_every_field_is_a_flag_in_help():
    text = build_parser().format_help()
    for _, name in all_fields():
        assert f"--{name}" in text, f"--{name} missing from --help"


@pytest.mark.parametrize("section,name", all_fields())
def test_every_field_is_accepted_as_a_flag(section, name):
    spec = next(s for s in field_specs() if s.name == name)
    assert spec.section == section
    defaults = RunConfig()
    default = value_of(defaults, section, name)

    # Its default, spelled as the CLI spells it, changes nothing.
    assert parse_args([f"--{name}", format_value(default)]) == defaults

    # Another value changes that field and nothing else, but for what it implies (configs/validate.py:
    # implied_settings).
    other = non_default_value(spec, default)
    parsed = parse_args([f"--{name}", format_value(other)])
    expected = with_field(defaults, section, name, other)
    for implied_section, implied, value in IMPLIED.get(name, ()):
        expected = with_field(expected, implied_section, implied, value)
    assert parsed == expected


# {field: (section, field, value) it implies at a value other than its default}
IMPLIED = {"weight_decay": [("fsdp", "use_orig_params", True)]}  # FSDP1 (the default) decays with them


# ------------------------------------------------------------------------------------------------ types


def test_int_and_float_values_are_typed():
    config = parse_args(
        ["--epochs", "3", "--lr", "1", "--gamma", "5e-1", "--seed", "-5", "--min_num_params", "2000"]
    )
    assert config.train.epochs == 3 and type(config.train.epochs) is int
    assert config.train.lr == 1.0 and type(config.train.lr) is float
    assert config.train.gamma == 0.5
    assert config.train.seed == -5  # a negative number is a value, not a flag
    assert config.fsdp.min_num_params == 2000 and type(config.fsdp.min_num_params) is int


def test_str_values_are_kept_verbatim():
    config = parse_args(["--model_name", "t5-base", "--source_prefix", "summarize: "])
    assert config.train.model_name == "t5-base"
    assert config.data.source_prefix == "summarize: "


@pytest.mark.parametrize(
    "text,expected",
    [("true", True), ("false", False), ("True", True), ("FALSE", False)],
)
def test_bool_words(text, expected):
    config = parse_args(["--save_model", text, "--mixed_precision", text])
    assert config.train.save_model is expected
    # use_fp16 stays false, so mixed_precision false is a valid combination.
    assert config.fsdp.mixed_precision is expected


def test_bare_bool_flag_means_true():
    config = parse_args(["--save_model", "--epochs", "3", "--limit_all_gathers"])
    assert config.train.save_model is True
    assert config.train.epochs == 3  # the next flag is not eaten as the bool's value
    assert config.fsdp.limit_all_gathers is True

    config = parse_args(["--track_memory", "false", "--print_text"])
    assert config.train.track_memory is False
    assert config.data.print_text is True


def test_bool_false_turns_a_true_default_off():
    config = parse_args(["--run_validation", "false", "--fsdp_activation_checkpointing", "false"])
    assert TrainConfig().run_validation is True and config.train.run_validation is False
    assert FSDPConfig().fsdp_activation_checkpointing is True
    assert config.fsdp.fsdp_activation_checkpointing is False


def test_flag_equals_value_form():
    config = parse_args(
        [
            "--epochs=4",
            "--lr=0.5",
            "--save_model=true",
            "--run_validation=false",
            "--backward_prefetch=NONE",
            "--sharding_strategy=NO_SHARD",
            "--device=cpu",
            "--source_prefix=--not-a-flag",
        ]
    )
    assert config.train.epochs == 4
    assert config.train.lr == 0.5
    assert config.train.save_model is True
    assert config.train.run_validation is False
    assert config.fsdp.backward_prefetch is None
    assert config.fsdp.sharding_strategy == "NO_SHARD"
    assert config.train.device == "cpu"
    assert config.data.source_prefix == "--not-a-flag"


@pytest.mark.parametrize("member", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_sharding_strategy_by_name(member):
    """The config holds the member's name; utils/fsdp/shard.py hands FSDP the member itself."""
    assert parse_args(["--sharding_strategy", member]).fsdp.sharding_strategy == ShardingStrategy[member].name


@pytest.mark.parametrize(
    "text,expected",
    [
        ("BACKWARD_PRE", BackwardPrefetch.BACKWARD_PRE.name),
        ("BACKWARD_POST", BackwardPrefetch.BACKWARD_POST.name),
        ("NONE", None),
    ],
)
def test_optional_choice_backward_prefetch(text, expected):
    assert parse_args(["--backward_prefetch", text]).fsdp.backward_prefetch == expected


def test_literal_fields():
    config = parse_args(["--device", "cuda", "--bf16_policy", "bfSixteen_working", "--wrap_policy", "size_based"])
    # Parsing does not check that CUDA exists: that is resolved at run time.
    assert config.train.device == "cuda"
    assert config.fsdp.bf16_policy == "bfSixteen_working"
    assert config.fsdp.wrap_policy == "size_based"


def test_last_occurrence_wins():
    assert parse_args(["--epochs", "3", "--epochs", "5"]).train.epochs == 5


# ---------------------------------------------------------------------------------------------- aliases


@pytest.mark.parametrize("argv,section,name,expected", TUTORIAL_FLAGS, ids=lambda x: str(x))
def test_tutorial_flags(argv, section, name, expected):
    config = parse_args(argv)
    assert value_of(config, section, name) == expected
    # Nothing else changes.
    defaults = RunConfig()
    for other_section, other_name in all_fields():
        if (other_section, other_name) != (section, name):
            assert value_of(config, other_section, other_name) == value_of(defaults, other_section, other_name)


def test_alias_and_field_name_set_the_same_field():
    assert parse_args(["--batch-size", "8"]) == parse_args(["--batch_size_training", "8"])
    assert parse_args(["--test-batch-size", "8"]) == parse_args(["--val_batch_size", "8"])
    assert parse_args(["--save-model", "true"]) == parse_args(["--save_model", "true"])
    assert parse_args([NO_CUDA_FLAG]) == parse_args(["--device", "cpu"])


def test_alias_values_are_checked_like_the_field():
    message = expect_config_error(["--batch-size", "0"])
    assert "batch_size_training" in message and ">= 1" in message
    message = expect_config_error(["--save-model", "maybe"])
    assert "true or false" in message


def test_help_states_the_meaning_of_each_alias():
    parser = build_parser()
    help_text = squash(parser.format_help())
    for name, aliases in ALIASES.items():
        for alias in aliases:
            assert alias in help_text
            owner_help = help_of(parser, alias)
            assert help_of(parser, f"--{name}") == owner_help, f"{alias} is not an alias of --{name}"
            assert alias in owner_help and "tutorial" in owner_help
    # The tutorial's store_false booleans now mean "on" when given alone: --help must say so.
    for flag in ("--save-model", "--track_memory", "--run_validation"):
        assert "Given alone: true" in help_of(parser, flag)
    for flag in ("--epochs", "--lr", "--gamma", "--seed"):
        assert flag in help_text
    assert "gamma" in help_of(parser, "--gamma") and "epoch" in help_of(parser, "--gamma")
    no_cuda_help = help_of(parser, NO_CUDA_FLAG)
    assert "cpu" in no_cuda_help.lower() and "--device" in no_cuda_help


def test_no_cuda_means_device_cpu():
    assert parse_args([NO_CUDA_FLAG]).train.device == "cpu"


# ----------------------------------------------------------------------------------------------- errors


def test_unknown_flag_suggests_the_close_ones_and_leaves_the_list_to_help():
    message = expect_config_error(["--batch_size", "8"])
    assert "unknown argument" in message
    assert "--batch_size" in message
    assert "did you mean" in message and "--batch-size" in message.split("did you mean", 1)[1].splitlines()[0]
    assert "--help lists every flag" in message
    listed = [name for _, name in all_fields() if f"--{name}" in message]
    assert len(listed) <= 3, f"the valid flags are listed: {listed}"


def test_unknown_flag_equals_form_and_no_abbreviations():
    message = expect_config_error(["--epoch=3"])
    assert "--epoch=3" in message and "--epochs" in message
    # Abbreviations are not accepted: --epoch is not --epochs.
    message = expect_config_error(["--epoch", "3"])
    assert "unknown argument" in message


def test_unknown_field():
    message = expect_config_error(["--no_such_field", "1"])
    assert "unknown argument" in message and "--no_such_field" in message


def test_positional_junk():
    message = expect_config_error(["junk"])
    assert "junk" in message and "unknown argument" in message
    message = expect_config_error(["--epochs", "3", "4"])
    assert "4" in message and "unknown argument" in message


def test_missing_value():
    message = expect_config_error(["--epochs"])
    assert "--epochs" in message


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--epochs", "two"], ["--epochs", "integer", "two"]),
        (["--epochs", "2.5"], ["--epochs", "integer", "2.5"]),
        (["--min_num_params", "1e6"], ["--min_num_params", "integer"]),
        (["--lr", "fast"], ["--lr", "number", "fast"]),
        (["--gamma", ""], ["--gamma", "number"]),
    ],
)
def test_bad_numbers(argv, words):
    message = expect_config_error(argv)
    for word in words:
        assert word in message


@pytest.mark.parametrize("text", ["yes", "1", "on", ""])
def test_bad_bool(text):
    message = expect_config_error(["--save_model", text])
    assert "--save_model" in message and "true or false" in message


@pytest.mark.parametrize(
    "argv,flag,choices",
    [
        (["--sharding_strategy", "ZERO3"], "--sharding_strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]),
        (["--sharding_strategy", "full_shard"], "--sharding_strategy", ["FULL_SHARD"]),
        (["--backward_prefetch", "none"], "--backward_prefetch", ["BACKWARD_PRE", "BACKWARD_POST", "NONE"]),
        (["--device", "tpu"], "--device", ["auto", "cuda", "cpu"]),
        (["--bf16_policy", "fp16"], "--bf16_policy", ["bfSixteen", "bfSixteen_working"]),
        (["--wrap_policy", "auto"], "--wrap_policy", ["transformer", "size_based"]),
    ],
)
def test_value_not_in_choices_lists_the_choices(argv, flag, choices):
    message = expect_config_error(argv)
    assert flag in message and repr(argv[1]) in message
    for choice in choices:
        assert choice in message


def test_the_strategy_and_prefetch_choices_are_torchs_member_names():
    """The configs spell them as names (no torch import while the settings are read): exactly torch's."""
    specs = {spec.name: spec for spec in field_specs()}
    assert choices_of(specs["sharding_strategy"].type_hint) == list(ShardingStrategy.__members__)
    assert choices_of(specs["backward_prefetch"].type_hint) == [*BackwardPrefetch.__members__, "NONE"]


def test_a_choice_without_none_does_not_accept_none():
    message = expect_config_error(["--sharding_strategy", "NONE"])
    assert "FULL_SHARD" in message


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--epochs", "0"], "--epochs"),
        (["--batch_size_training", "0"], "--batch_size_training"),
        (["--val_batch_size", "0"], "--val_batch_size"),
        (["--lr", "0"], "--lr"),
        (["--lr", "-1"], "--lr"),
        (["--gamma", "0"], "--gamma"),
        (["--weight_decay", "-0.1"], "--weight_decay"),
        (["--num_train_samples", "-1"], "--num_train_samples"),
        (["--max_source_length", "1"], "--max_source_length"),
        (["--log_every_n_steps", "0"], "--log_every_n_steps"),
        (["--dist_timeout_s", "0"], "--dist_timeout_s"),
        (["--min_num_params", "0"], "--min_num_params"),
    ],
)
def test_bounds(argv, flag):
    message = expect_config_error(argv)
    assert flag in message and argv[1].lstrip("-") in message
    assert ">" in message  # states the bound


def test_bounds_allow_the_edge_values():
    config = parse_args(["--epochs", "1", "--num_train_samples", "0", "--weight_decay", "0"])
    assert config.train.epochs == 1 and config.data.num_train_samples == 0 and config.train.weight_decay == 0.0


@pytest.mark.parametrize(
    "argv",
    [["--lr", "nan"], ["--lr", "inf"], ["--gamma", "inf"], ["--weight_decay", "nan"]],
)
def test_non_finite_numbers_are_rejected(argv):
    # A NaN passes `value > 0` and `value >= 0` checks unnoticed; it would turn every weight into NaN.
    message = expect_config_error(argv)
    assert argv[0] in message


# ------------------------------------------------------------------------------- formatting, round trip


def test_format_value():
    assert format_value(True) == "true"
    assert format_value(False) == "false"
    assert format_value(None) == "NONE"
    assert format_value("SHARD_GRAD_OP") == "SHARD_GRAD_OP"
    assert format_value(3) == "3"
    assert float(format_value(0.002)) == 0.002
    assert format_value("t5-base") == "t5-base"


NON_DEFAULT_ARGV = [
    "--model_name", "t5-small",
    "--data_dir", "/somewhere/data",
    "--output_dir", "runs/one",
    "--device", "cpu",
    "--epochs", "7",
    "--batch-size", "3",
    "--test-batch-size", "5",
    "--lr", "1e-05",
    "--gamma", "0.1",
    "--seed", "-3",
    "--num_train_samples", "0",
    "--source_prefix", "summarize: ",
    "--pad_to_max_length",
    "--run_validation", "false",
    "--save-model",
    "--track_memory", "false",
    "--mixed_precision", "true",
    "--use_fp16", "true",
    "--bf16_policy", "bfSixteen_working",
    "--sharding_strategy", "SHARD_GRAD_OP",
    "--backward_prefetch", "NONE",
    "--fsdp_activation_checkpointing", "false",
    "--limit_all_gathers", "false",
    "--wrap_policy", "size_based",
    "--min_num_params", "12345",
]  # fmt: skip


@pytest.mark.parametrize("argv", [[], NON_DEFAULT_ARGV], ids=["defaults", "non_default"])
def test_config_to_dict_is_json_and_round_trips(argv):
    config = parse_args(argv)
    as_dict = config_to_dict(config)
    # One key per section, as output_dir/config.json has them.
    assert list(as_dict) == [key for _, _, key in SECTIONS]
    assert RECORD_KEYS == {section: key for section, _, key in SECTIONS}
    for section, _, key in SECTIONS:
        assert list(as_dict[key]) == [f.name for f in fields(getattr(config, section))]
        for name, value in as_dict[key].items():
            assert isinstance(value, str | int | float | bool), f"{name} is not JSON-ready: {value!r}"
    dicts = list(json.loads(json.dumps(as_dict)).values())  # raises if not serialisable

    # Every value back to CLI text, parsed again: the same configs.
    for form in ("space", "equals"):
        rebuilt = []
        for section_dict in dicts:
            for name, value in section_dict.items():
                text = format_value(value)
                rebuilt += [f"--{name}={text}"] if form == "equals" else [f"--{name}", text]
        assert parse_args(rebuilt) == config, form


def test_config_to_dict_spells_choices_and_none_as_the_cli_does():
    config = parse_args(["--backward_prefetch", "NONE", "--sharding_strategy", "NO_SHARD"])
    as_dict = config_to_dict(config)["fsdp_config"]
    assert as_dict["backward_prefetch"] == "NONE"
    assert as_dict["sharding_strategy"] == "NO_SHARD"
    assert as_dict["mixed_precision"] is True


def test_format_value_round_trips_every_field():
    for config in (RunConfig(), parse_args(NON_DEFAULT_ARGV)):
        for spec in field_specs():
            value = value_of(config, spec.section, spec.name)
            parsed = value_of(parse_args([f"--{spec.name}", format_value(value)]), spec.section, spec.name)
            if isinstance(value, float):
                assert parsed == value and not math.isnan(parsed)
            else:
                assert parsed == value and type(parsed) is type(value)


def test_type_hints_are_all_supported():
    # parse_value knows bool, int, float, str, Literals, optional Literals and optional numbers: nothing
    # else may appear.
    for spec in field_specs():
        hint = spec.type_hint
        known = hint in (bool, int, float, str, int | None, float | None)
        assert known or choices_of(hint) is not None, (spec.name, hint)
        if typing.get_origin(hint) is typing.Literal:
            assert all(isinstance(a, str) for a in typing.get_args(hint))


# ------------------------------------------------------------------------------------------------- help


def test_help_exits_zero_and_prints_every_field(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code in (0, None)
    out = capsys.readouterr().out
    for spec in field_specs():
        assert f"--{spec.name}" in out
        # The first words of each field's documentation are shown.
        first_words = squash(" ".join(spec.help.split()[:3]))
        assert first_words in squash(out), f"help of --{spec.name} not shown"
    assert "Default:" in out


def test_help_shows_defaults_in_cli_spelling():
    text = squash(build_parser().format_help())
    assert "Default:FULL_SHARD." in text
    assert "Default:BACKWARD_PRE." in text
    assert "Default:true." in text and "Default:false." in text


def test_script_help_in_subprocess():
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "T5_training.py", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stdout + result.stderr
    assert elapsed < 60, f"--help took {elapsed:.1f} s"
    for spec in field_specs():
        assert f"--{spec.name}" in result.stdout
    assert "Traceback" not in result.stderr
    # --help must not start a process group or load a model.
    assert "process group" not in result.stdout


def test_optional_number_takes_none_or_a_bounded_number():
    assert parse_args(["--dropout_rate", "0"]).recipe.dropout_rate == 0.0
    assert parse_args(["--dropout_rate", "NONE"]).recipe.dropout_rate is None
    assert format_value(None) == "NONE"
    for text, words in (("2", "<= 1"), ("x", "a number")):
        with pytest.raises(ConfigError, match=words):
            parse_args(["--dropout_rate", text])


# ------------------------------------------------------------------------------------------ --config FILE


def test_config_file_fills_the_sections_under_the_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "train:\n  epochs: 3\n  lr: 0.01\nfsdp_config:\n  sharding_strategy: SHARD_GRAD_OP\n"
        "batch_size_training: 2\nrecipe:\n  dropout_rate: null\n"
    )
    config = parse_args(["--config", str(path), "--epochs", "5"])
    assert config.train.epochs == 5  # the flag wins
    assert config.train.lr == 0.01 and config.train.batch_size_training == 2  # a section; the top level
    assert config.fsdp.sharding_strategy == "SHARD_GRAD_OP"  # config.json's section key
    assert config.recipe.dropout_rate is None  # null: the flag's NONE
    json_path = tmp_path / "run.json"
    json_path.write_text(json.dumps({"train": {"epochs": 4, "run_validation": False}}))
    config = parse_args([f"--config={json_path}"])
    assert config.train.epochs == 4 and config.train.run_validation is False


def test_a_run_record_replays_its_settings_but_not_where_it_wrote_or_started(tmp_path):
    ran = parse_args(["--epochs", "3", "--lr", "0.02", "--output_dir", "elsewhere", "--resume", "true"])
    record = {**config_to_dict(ran), "world_size": 2, "versions": {"torch": "2.13.0"}, "command": ["x"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(record))
    replay = parse_args(["--config", str(path)])
    launch_defaults = {"output_dir": TrainConfig().output_dir, "resume": CheckpointConfig().resume}
    expected = replace(
        ran,
        train=replace(ran.train, output_dir=launch_defaults["output_dir"]),
        checkpointing=replace(ran.checkpointing, resume=launch_defaults["resume"]),
    )
    assert config_to_dict(replay) == config_to_dict(expected)
    assert replay.train.lr == 0.02 and replay.train.epochs == 3


def test_the_example_config_files_parse_and_pass_the_checks():
    from configs.validate import check_settings

    examples = sorted((REPO_ROOT / "configs" / "examples").glob("*.yaml"))
    assert [p.name for p in examples] == ["lora.yaml", "t5_3b_8gpu.yaml", "your_data.yaml"]
    for path in examples:
        config = parse_args(["--config", str(path)])
        check_settings(config, world_size=8, device_type="cuda")
        assert config.train.model_name != TrainConfig().model_name, path  # each names a real model
    assert parse_args(["--config", str(examples[0])]).lora.peft == "lora"


def test_a_record_of_another_version_replays_what_this_version_knows(tmp_path):
    from types import SimpleNamespace

    from utils.observe.run_record import run_record

    ran = parse_args(["--epochs", "3", "--device", "cpu"])
    info = SimpleNamespace(world_size=2, backend="gloo", device="cpu")
    record = run_record(
        config=ran,
        from_accelerate={},
        info=info,
        precision=SimpleNamespace(name="fp32", tf32=False),
        throughput=SimpleNamespace(peak_flops=0, peak_source="-"),
    )
    record["resumed_from"] = None
    # Every key a record holds is a section or a key config files know to skip.
    assert set(record) <= {*RECORD_KEYS.values(), *RUN_RECORD_KEYS}, set(record) - set(RECORD_KEYS.values())
    record["train_config"]["a_removed_field"] = 1  # an older version's field, and a newer version's key
    record["git_commit"] = "abc"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(record))
    assert config_to_dict(parse_args(["--config", str(path)])) == config_to_dict(ran)
    # A key mistyped in a record (close to one of this version's) is refused as in any file, not skipped
    for section, typo, meant in (
        ("train_config", "epoch", "epochs"),
        ("train_config", "learning_rat", "learning_rate"),
    ):
        edited = json.loads(json.dumps(record))
        edited[section][typo] = 5
        path.write_text(json.dumps(edited))
        with pytest.raises(ConfigError, match=f"unknown key '{typo}': did you mean {meant}"):
            parse_args(["--config", str(path)])


def test_a_file_of_ones_own_with_a_record_key_is_checked_as_ones_own(tmp_path):
    """Only a run record (its versions and command) has its other versions' keys skipped: a hand-written file
    that uses one of a record's keys (backend) has it refused, as its typos and its other unknown keys, not
    its every unknown key skipped and its output_dir dropped as a record's."""
    path = tmp_path / "run.yaml"
    path.write_text("backend: nccl\ntrain:\n  output_dir: runs/x\n  epochs: 5\n")
    with pytest.raises(ConfigError, match="unknown key 'backend'"):
        parse_args(["--config", str(path)])
    path.write_text("train:\n  output_dir: runs/x\n  epochs: 5\n")
    config = parse_args(["--config", str(path)])
    assert config.train.output_dir == "runs/x" and config.train.epochs == 5


def test_a_top_level_device_is_the_setting_in_a_file_of_your_own(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("device: cpu\noutput_dir: runs/mine\nfsdp:\n")  # an empty section: its fields commented out
    config = parse_args(["--config", str(path)])
    assert config.train.device == "cpu" and config.train.output_dir == "runs/mine"


def test_config_file_errors_name_the_file_and_the_fix(tmp_path):
    path = tmp_path / "run.yaml"
    cases = {
        "train:\n  epoch: 3\n": "unknown key 'epoch': did you mean epochs?",
        "fsdp:\n  lr: 0.1\n": "lr is a field of section train, not fsdp",
        "train:\n  lr: fast\n": "--lr takes a number, not 'fast'. Fix the file, or give --lr on the command line.",
        "trian:\n  lr: 0.1\n": "unknown key 'trian': did you mean train?",
        "train: [1, 2]\n": "train is a section and takes fields",
        "train:\n  lr: [0.1\n": "is not valid YAML",
        "data:\n  source_prefix: null\n": 'source_prefix takes no null \\(an empty text is ""\\)',
        "lora:\n  lora_target_modules: [q, v]\n": "not a list \\(a comma-separated list is one text: q,v\\)",
        "train:\n  model_name: 2024-01-01\n": "quote it",
        # a key twice: YAML and JSON parsers keep the last, and a section given twice would lose its first fields
        "train:\n  epochs: 3\n  lr: 0.1\n  epochs: 4\n": (
            "'epochs' is given twice in one mapping \\(lines 2 and 4\\); keep one"
        ),
        "train:\n  epochs: 3\nfsdp:\n  compile: true\ntrain:\n  lr: 0.1\n": (
            "'train' is given twice in one mapping \\(lines 1 and 5\\)"
        ),
        # the same field in two places: by section name and config.json key, or at the top level too
        "train:\n  epochs: 3\ntrain_config:\n  epochs: 4\n": (
            "epochs is given twice, under train and under train_config"
        ),
        "epochs: 3\ntrain:\n  epochs: 4\n": "epochs is given twice, at the top level and under train; keep one",
        "learning_rate: 0.1\ntrain:\n  learning_rate: 0.2\n": (
            "learning_rate is given twice, at the top level and under train; keep one"
        ),
    }
    for text, message in cases.items():
        path.write_text(text)
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("?", r"\?")):
            parse_args(["--config", str(path)])
    with pytest.raises(ConfigError, match="no such file"):
        parse_args(["--config", str(tmp_path / "missing.yaml")])
    path.write_bytes('data:\n  source_prefix: "r\u00e9sum\u00e9: "\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text \\(it holds the byte 0xe9\\): save it as UTF-8"):
        parse_args(["--config", str(path)])
    bom = tmp_path / "run.json"
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"train": {"epochs": 3}}')  # a byte-order mark, as some editors write
    assert parse_args(["--config", str(bom)]).train.epochs == 3
    # A YAML merge's key overridden is no key given twice, however the merges nest and anchors are reused
    # (PyYAML rewrites a merged mapping in place, merged keys beside its own).
    merged = tmp_path / "merged.yaml"
    for text in (
        "train: {<<: &tuned {<<: &base {epochs: 3, lr: 0.1}, lr: 0.2}}\n",
        "d: {base: &b {lr: 1}, big: &g {<<: *b, lr: 2}}\ntrain: {<<: *g}\n",
        "b: &b {lr: 1}\ntrain: {<<: &g {<<: *b, lr: 2}}\nfsdp: *g\n",
    ):
        merged.write_text(text)
        assert config_file._load(str(merged)) == yaml.safe_load(text), text
    merged.write_text("train: {<<: &tuned {<<: &base {epochs: 3, lr: 0.1}, lr: 0.2}}\n")
    from_merge = parse_args(["--config", str(merged)]).train
    assert (from_merge.epochs, from_merge.lr) == (3, 0.2)
    bom.write_text('{"train": {"epochs": 3, "lr": 0.1, "epochs": 4}}')
    with pytest.raises(ConfigError, match="'epochs' is given twice in one object; keep one"):
        parse_args(["--config", str(bom)])
