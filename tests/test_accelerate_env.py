"""`accelerate launch --config_file configs/accelerate_fsdp.yaml T5_training.py`: accelerate's settings,
passed as environment variables, become the same configs as the equivalent flags.

The environments are made by accelerate's own code: its launch parser reads the command line and the
config file, `_validate_launch_command` merges them (what `accelerate launch` does first), and
`prepare_multi_gpu_env` builds the environment that torch.distributed.run hands the script (the FSDP
launcher; it needs no GPU). One end-to-end run goes through `accelerate launch` itself on 2 CPU ranks.
"""

import inspect
import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from configs.accelerate_env import (
    CHECKED_VARIABLES,
    ENV_RULES,
    IGNORED_VARIABLES,
    known_variables,
    mapping_markdown,
)
from configs.cli import field_specs, fields_from_accelerate, parse_args
from configs.errors import ConfigError
from configs.paths import REPO_ROOT
from configs.run import RunConfig
from tests.launch import Run, offline_env, program_tracebacks
from utils.distributed.process_group import free_port

accelerate_launch = pytest.importorskip("accelerate.commands.launch")
accelerate_utils_launch = pytest.importorskip("accelerate.utils.launch")

CONFIG_FILE = REPO_ROOT / "configs" / "accelerate_fsdp.yaml"
DEFAULTS = RunConfig()
# Every field the shipped config file sets (its sync_module_states false included).
YAML_FIELDS = {
    "mixed_precision": "ACCELERATE_MIXED_PRECISION",
    "use_fp16": "ACCELERATE_MIXED_PRECISION",
    "fsdp_version": "FSDP_VERSION",
    "sharding_strategy": "FSDP_SHARDING_STRATEGY+FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_cpu_offload": "FSDP_OFFLOAD_PARAMS",
    "wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "backward_prefetch": "FSDP_BACKWARD_PREFETCH",
    "forward_prefetch": "FSDP_FORWARD_PREFETCH",
    "checkpoint_type": "FSDP_STATE_DICT_TYPE",
    "use_orig_params": "FSDP_USE_ORIG_PARAMS",
    "cpu_ram_efficient_loading": "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "sync_module_states": "FSDP_SYNC_MODULE_STATES",
    "fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
}


def config_file(tmp_path, fsdp: dict | None = None, top: dict | None = None):
    """The shipped config file with some keys changed, written to tmp_path."""
    config = yaml.safe_load(CONFIG_FILE.read_text(encoding="utf-8"))
    config["fsdp_config"].update(fsdp or {})
    config.update(top or {})
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def launch_environment(path=CONFIG_FILE, launch_args: tuple = ()) -> dict[str, str]:
    """The environment `accelerate launch --config_file path [launch_args] T5_training.py` gives the script."""
    argv = ["--config_file", str(path), "--main_process_port", "0", *launch_args, "T5_training.py"]
    args = accelerate_launch.launch_command_parser().parse_args(argv)
    args, _, _ = accelerate_launch._validate_launch_command(args)
    assert args.use_fsdp and not args.cpu, "accelerate launch would not take its FSDP launcher"
    return accelerate_utils_launch.prepare_multi_gpu_env(args)


def refusal(argv: list[str], env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as raised:
        parse_args(argv, env)
    return str(raised.value)


def test_the_shipped_config_file_gives_the_defaults():
    env = launch_environment()
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "T5Block"
    assert parse_args([], env) == DEFAULTS
    assert fields_from_accelerate([], env) == YAML_FIELDS


# (fsdp_config keys changed, top-level keys changed, accelerate launch's own flags) -> the equivalent flags
EQUIVALENTS = [
    ({"fsdp_version": 2}, {}, (), ["--fsdp_version", "2"]),
    ({"fsdp_version": 2, "fsdp_reshard_after_forward": False}, {}, (),
     ["--fsdp_version", "2", "--sharding_strategy", "SHARD_GRAD_OP"]),
    ({"fsdp_version": 2, "fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_reshard_after_forward": False}, {}, (),
     ["--fsdp_version", "2", "--sharding_strategy", "_HYBRID_SHARD_ZERO2"]),
    ({"fsdp_sharding_strategy": "SHARD_GRAD_OP"}, {}, (), ["--sharding_strategy", "SHARD_GRAD_OP"]),
    ({"fsdp_sharding_strategy": 3}, {}, (), ["--sharding_strategy", "NO_SHARD"]),
    ({"fsdp_sharding_strategy": "HYBRID_SHARD_ZERO2", "fsdp_reshard_after_forward": "HYBRID_SHARD_ZERO2"}, {}, (),
     ["--sharding_strategy", "_HYBRID_SHARD_ZERO2"]),
    ({"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_reshard_after_forward": False}, {}, (),
     ["--sharding_strategy", "SHARD_GRAD_OP"]),
    ({"fsdp_backward_prefetch": "NO_PREFETCH"}, {}, (), ["--backward_prefetch", "NONE"]),
    ({"fsdp_backward_prefetch": "BACKWARD_POST"}, {}, (), ["--backward_prefetch", "BACKWARD_POST"]),
    ({"fsdp_state_dict_type": "SHARDED_STATE_DICT"}, {}, (), ["--checkpoint_type", "SHARDED_STATE_DICT"]),
    ({"fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": True}, {}, (),
     ["--cpu_ram_efficient_loading", "true"]),
    ({"fsdp_sync_module_states": True}, {}, (), ["--sync_module_states", "true"]),
    ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 5000}, {}, (),
     ["--wrap_policy", "size_based", "--min_num_params", "5000"]),
    ({"fsdp_offload_params": True, "fsdp_forward_prefetch": True, "fsdp_use_orig_params": True,
      "fsdp_activation_checkpointing": False}, {}, (),
     ["--fsdp_cpu_offload", "true", "--forward_prefetch", "true", "--use_orig_params", "true",
      "--fsdp_activation_checkpointing", "false"]),
    ({}, {"mixed_precision": "fp16"}, (), ["--use_fp16", "true"]),
    ({}, {"mixed_precision": "no"}, (), ["--mixed_precision", "false"]),
    ({}, {}, ("--mixed_precision", "fp16"), ["--use_fp16", "true"]),  # accelerate's flag over its file
    ({}, {}, ("--fsdp_state_dict_type", "SHARDED_STATE_DICT"), ["--checkpoint_type", "SHARDED_STATE_DICT"]),
]  # fmt: skip


@pytest.mark.parametrize("fsdp, top, launch_args, flags", EQUIVALENTS)
def test_a_config_file_gives_the_configs_of_the_equivalent_flags(tmp_path, fsdp, top, launch_args, flags):
    env = launch_environment(config_file(tmp_path, fsdp, top), launch_args)
    assert parse_args([], env) == parse_args(flags, {})


def test_keys_left_out_take_accelerate_launchs_defaults_not_the_packages(tmp_path):
    path = tmp_path / "minimal.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_auto_wrap_policy: "
                    "TRANSFORMER_BASED_WRAP\n", encoding="utf-8")  # fmt: skip
    flags = ["--mixed_precision", "false", "--use_orig_params", "true", "--cpu_ram_efficient_loading", "true",
             "--fsdp_activation_checkpointing", "false"]  # fmt: skip
    assert parse_args([], launch_environment(path)) == parse_args(flags, {})


@pytest.mark.parametrize("layers", ["T5Block", "MT5Block", "UMT5Block", "BartEncoderLayer,BartDecoderLayer",
                                    "PegasusEncoderLayer, PegasusDecoderLayer"])  # fmt: skip
def test_each_tested_familys_layer_classes_are_accepted_as_the_units(tmp_path, layers):
    env = launch_environment(config_file(tmp_path, {"fsdp_transformer_layer_cls_to_wrap": layers}, {}))
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == layers
    parse_args([], env)  # accepted: no ConfigError


@pytest.mark.parametrize(
    "fsdp, top, variable",
    [
        ({"fsdp_state_dict_type": "LOCAL_STATE_DICT"}, {}, "FSDP_STATE_DICT_TYPE"),
        ({"fsdp_transformer_layer_cls_to_wrap": "BertLayer"}, {}, "FSDP_TRANSFORMER_CLS_TO_WRAP"),
        ({"fsdp_transformer_layer_cls_to_wrap": "T5Block,T5LayerFF"}, {}, "FSDP_TRANSFORMER_CLS_TO_WRAP"),
        ({"fsdp_auto_wrap_policy": "NO_WRAP"}, {}, "FSDP_AUTO_WRAP_POLICY"),
        ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 0}, {}, "FSDP_MIN_NUM_PARAMS"),
        ({"fsdp_reshard_after_forward": "SHARD_GRAD_OP"}, {}, "FSDP_RESHARD_AFTER_FORWARD"),  # accelerate config's
        ({"fsdp_reshard_after_forward": False}, {}, "FSDP_RESHARD_AFTER_FORWARD"),
        ({"fsdp_version": 2, "fsdp_reshard_after_forward": "FULL_SHARD"}, {}, "FSDP_RESHARD_AFTER_FORWARD"),
        ({"fsdp_version": 2, "fsdp_sharding_strategy": "SHARD_GRAD_OP"}, {}, "FSDP_SHARDING_STRATEGY"),
        ({"fsdp_sharding_strategy": "ZERO3"}, {}, "FSDP_SHARDING_STRATEGY"),
        ({"fsdp_backward_prefetch": "BACKWARD_LATER"}, {}, "FSDP_BACKWARD_PREFETCH"),
        ({"fsdp_offload_params": "maybe"}, {}, "FSDP_OFFLOAD_PARAMS"),
        ({"fsdp_version": 3}, {}, "FSDP_VERSION"),
        ({"fsdp_activation_checkpointing_offload": True}, {}, "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"),
        ({"fsdp_ignored_modules": "shared"}, {}, "FSDP_IGNORED_MODULES"),
        ({}, {"dynamo_config": {"dynamo_backend": "INDUCTOR"}}, "ACCELERATE_DYNAMO_BACKEND"),
    ],
)
def test_a_value_without_a_meaning_here_is_refused_naming_the_variable(tmp_path, fsdp, top, variable):
    env = launch_environment(config_file(tmp_path, fsdp, top))
    message = refusal([], env)
    assert message.startswith(variable) and "accelerate launch" in message, message


@pytest.mark.parametrize(
    "extra, variable",
    [
        ({"ACCELERATE_MIXED_PRECISION": "fp8"}, "ACCELERATE_MIXED_PRECISION"),  # needs fp8 libraries to launch
        ({"FSDP_SOMETHING_NEW": "1"}, "FSDP_SOMETHING_NEW"),
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, "ACCELERATE_USE_DEEPSPEED"),
        ({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "0"}, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
    ],
)
def test_variables_accelerate_would_set_otherwise_are_refused_too(extra, variable):
    message = refusal([], {**launch_environment(), **extra})
    assert message.startswith(variable), message


def test_explicit_flags_win_and_are_not_recorded_as_taken_from_accelerate(tmp_path):
    env = launch_environment(config_file(tmp_path, {"fsdp_state_dict_type": "LOCAL_STATE_DICT"}))
    flags = ["--checkpoint_type", "SHARDED_STATE_DICT", "--fsdp_activation_checkpointing", "false"]
    config = parse_args(flags, env)
    assert config.fsdp.checkpoint_type == "SHARDED_STATE_DICT" and not config.fsdp.fsdp_activation_checkpointing
    assert config == parse_args(flags, {})
    taken = fields_from_accelerate(flags, env)
    assert taken == {
        k: v for k, v in YAML_FIELDS.items() if k not in ("checkpoint_type", "fsdp_activation_checkpointing")
    }

    # fp16 from the file, bf16 from the flag: the two fields are set independently.
    env = launch_environment(config_file(tmp_path, top={"mixed_precision": "fp16"}))
    assert parse_args(["--use_fp16", "false"], env) == DEFAULTS
    assert fields_from_accelerate(["--use_fp16", "false"], env)["mixed_precision"] == "ACCELERATE_MIXED_PRECISION"


def test_the_variables_count_only_in_a_process_accelerate_launched():
    fsdp_only = {k: v for k, v in launch_environment().items() if k.startswith("FSDP_")}
    local = {**fsdp_only, "FSDP_STATE_DICT_TYPE": "LOCAL_STATE_DICT"}
    assert parse_args([], local) == DEFAULTS and fields_from_accelerate([], local) == {}
    # Without ACCELERATE_USE_FSDP true accelerate reads no FSDP_* variable; neither does this package.
    no_fsdp = {**local, "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_FSDP": "false"}
    assert parse_args([], no_fsdp) == parse_args(["--mixed_precision", "false"], {})
    assert fields_from_accelerate([], no_fsdp) == {"mixed_precision": "ACCELERATE_MIXED_PRECISION",
                                                   "use_fp16": "ACCELERATE_MIXED_PRECISION"}  # fmt: skip


def test_every_variable_accelerate_can_set_for_fsdp_is_known():
    source = inspect.getsource(accelerate_utils_launch.prepare_multi_gpu_env)
    launched = set(re.findall(r'current_env\["((?:FSDP|ACCELERATE)_\w+)"\]', source))
    assert {"FSDP_VERSION", "FSDP_STATE_DICT_TYPE", "ACCELERATE_MIXED_PRECISION"} <= launched
    assert launched <= known_variables(), launched - known_variables()


def test_the_mapping_table_names_real_fields_and_every_variable():
    names = {spec.name for spec in field_specs()}
    assert {rule.field for rule in ENV_RULES} <= names
    table = mapping_markdown()
    for variable in known_variables():
        assert f"`{variable}`" in table, variable
    assert len(table.splitlines()) == 2 + len(ENV_RULES) + len(CHECKED_VARIABLES) + len(IGNORED_VARIABLES)


def launched_by(monkeypatch, env: dict[str, str]) -> dict[str, str]:
    """This process's environment as accelerate launch would give it `env`'s settings (its ACCELERATE_* and
    FSDP_* variables): what T5_training.read_settings reads. Returns those variables."""
    variables = {name: value for name, value in env.items() if name.startswith(("ACCELERATE_", "FSDP_"))}
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return variables


# What a refusal caused by accelerate launch's config adds: the keys the user wrote (issue 66).
SHIPPED_CONFIGS_KEYS = (
    "[set by accelerate launch's config: --use_orig_params is its fsdp_use_orig_params: false; --fsdp_version is "
    "its fsdp_version: 1. Change the config file, or give the flag here, which wins]"
)


def test_a_refusal_of_a_setting_from_accelerates_config_names_the_configs_key(monkeypatch, tmp_path):
    """The shipped config's fsdp_use_orig_params: false (a setting given, so kept) with --weight_decay: refused,
    naming the config's keys behind the flags the message names; the controls: the same refusal of a flag typed
    names no key, and the config's key at true trains with the decay."""
    import T5_training

    launched_by(monkeypatch, launch_environment())
    with pytest.raises(ConfigError) as refused:
        T5_training.read_settings(["--weight_decay", "0.01"])
    message = str(refused.value)
    assert message.startswith(
        "--weight_decay 0.01 decays the matrices but not the layer norms"
    ) and message.endswith(SHIPPED_CONFIGS_KEYS)
    for name in [name for name in os.environ if name.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(name)
    with pytest.raises(ConfigError) as refused:
        T5_training.read_settings(["--weight_decay", "0.01", "--use_orig_params", "false"])
    assert "accelerate" not in str(refused.value)
    launched_by(monkeypatch, launch_environment(config_file(tmp_path, {"fsdp_use_orig_params": True})))
    config, from_accelerate = T5_training.read_settings(["--weight_decay", "0.01"])
    assert config.fsdp.use_orig_params and from_accelerate["use_orig_params"] == "FSDP_USE_ORIG_PARAMS"


def test_a_refusal_after_the_imports_names_the_configs_key_too(tmp_path):
    """A rule of the device (checked once torch says what the device is, in T5_training.main): the config's
    fsdp_offload_params: true on a CPU group is refused naming the key; other settings' refusals as they are."""
    from configs.accelerate_env import naming_config_keys
    from configs.validate import check_settings

    env = launch_environment(config_file(tmp_path, {"fsdp_offload_params": True}))
    with pytest.raises(ConfigError) as refused:
        check_settings(parse_args([], env), 2, "cpu")
    named = str(naming_config_keys(refused.value, fields_from_accelerate([], env), env))
    assert named.startswith("--fsdp_cpu_offload true needs GPUs") and (
        "--fsdp_cpu_offload is its fsdp_offload_params: true" in named
    ), named
    unrelated = ConfigError("--warmup_steps/--warmup_ratio need a per-step schedule")
    assert naming_config_keys(unrelated, fields_from_accelerate([], env), env) is unrelated


def accelerate_launch_run(args: list[str], config=CONFIG_FILE, timeout: float = 120) -> Run:
    """`accelerate launch --config_file config --num_processes 2 T5_training.py args` on 2 CPU ranks."""
    port = str(free_port())
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_processes", "2", "--main_process_port", port, "T5_training.py", *args]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=offline_env(), capture_output=True, text=True, timeout=timeout
    )
    return Run(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


# Seed 001's system (the PEFT + accelerate FSDP guide): LoRA on a T5, FinancialPhraseBank's sentences in, their
# labels out as text, scored by accuracy; here on the committed sample in the original format, a tenth of it
# held out for validation, as the guide's script does.
PHRASEBANK = REPO_ROOT / "data" / "financial_phrasebank" / "Sentences_AllAgree.txt"
SEED_001_FLAGS = ["--peft", "lora", "--train_file", str(PHRASEBANK), "--validation_split_percentage", "10",
                  "--eval_metric", "accuracy", "--metric_for_best", "accuracy", "--max_source_length", "64",
                  "--max_target_length", "8", "--lr", "0.01",
                  "--lora_target_modules", "q,k,v,o,wi,wo"]  # fmt: skip


@pytest.mark.slow
def test_accelerate_launch_runs_seed_001_with_the_config_file_settings_and_records_them(tmp_path):
    output_dir = tmp_path / "run"
    flags = [*SEED_001_FLAGS, "--epochs", "1", "--num_train_samples", "96", "--num_val_samples", "0",
             "--eval_num_samples", "0", "--output_dir", str(output_dir),
             "--fsdp_activation_checkpointing", "false"]  # fmt: skip
    run = accelerate_launch_run(flags)
    assert run.returncode == 0, run.describe()
    assert not program_tracebacks(run.output), run.describe()
    record = json.loads((output_dir / "config.json").read_text(encoding="utf-8"))
    assert record["world_size"] == 2 and record["backend"] == "gloo"
    assert parse_args(record["command"][1:], {}) == parse_args(flags, {})
    expected = {k: v for k, v in YAML_FIELDS.items() if k != "fsdp_activation_checkpointing"}
    assert record["from_accelerate"] == expected
    assert "from accelerate launch's environment: --mixed_precision true" in run.output
    # Accuracy in metrics.jsonl, recomputed from the predictions beside it: the 60 held-out sentences.
    (evaluation,) = [json.loads(line) for line in (output_dir / "metrics.jsonl").open() if '"eval"' in line]
    lines = [json.loads(line) for line in (output_dir / "predictions" / "validation_step_00000012.jsonl").open()]
    assert evaluation["num_samples"] == len(lines) == 60 and "rouge1" not in evaluation
    assert {line["reference"] for line in lines} == {"positive", "negative", "neutral"}
    correct = sum(line["prediction"] == line["reference"] for line in lines)
    assert evaluation["accuracy"] == pytest.approx(100 * correct / 60) and correct > 0


@pytest.mark.slow  # a real accelerate launch (4-5 s)
def test_accelerate_launch_with_a_refused_value_stops_with_one_message(tmp_path):
    config = config_file(tmp_path, {"fsdp_state_dict_type": "LOCAL_STATE_DICT"})
    run = accelerate_launch_run(["--output_dir", str(tmp_path / "run")], config=config)
    assert run.returncode != 0
    assert run.output.count("FSDP_STATE_DICT_TYPE='LOCAL_STATE_DICT'") == 1, run.describe()
    assert not program_tracebacks(run.output), run.describe()
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a real accelerate launch (4-5 s)
def test_accelerate_launch_with_a_setting_refused_by_a_flag_names_the_configs_key_once(tmp_path):
    config = config_file(tmp_path, {"fsdp_use_orig_params": False})
    run = accelerate_launch_run(["--weight_decay", "0.01", "--output_dir", str(tmp_path / "run")], config=config)
    assert run.returncode != 0, run.describe()
    assert run.output.count("--use_orig_params is its fsdp_use_orig_params: false") == 1, run.describe()
    assert not program_tracebacks(run.output), run.describe()


def test_a_layer_class_named_for_another_family_is_said_with_the_ones_taken(monkeypatch, log_records):
    """accelerate's config names T5Block; a BART model's own layers are the units, and the run says so (a T5
    model's are the named ones: nothing to say)."""
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    from utils.train.build import log_layer_classes_of_accelerate

    environ = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_FSDP": "true",
               "FSDP_TRANSFORMER_CLS_TO_WRAP": "T5Block"}  # fmt: skip
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    tiny = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=16, decoder_ffn_dim=16,
                encoder_attention_heads=2, decoder_attention_heads=2, vocab_size=64)  # fmt: skip
    log_layer_classes_of_accelerate(BartForConditionalGeneration(BartConfig(**tiny)))
    log_layer_classes_of_accelerate(
        T5ForConditionalGeneration(T5Config(d_model=16, d_ff=16, d_kv=8, num_heads=2, num_layers=1, vocab_size=64))
    )
    said = [record.getMessage() for record in log_records]
    assert said == [
        "accelerate's fsdp_transformer_layer_cls_to_wrap names T5Block; this BartForConditionalGeneration's "
        "layers are BartDecoderLayer, BartEncoderLayer, and those are the FSDP units (the config's value is "
        "checked, not used)"
    ]
