"""configs/validate.py: every cross-field rule, each refused with a message that names the flags and the fix,
and the defaults (and the nearest valid neighbours) accepted."""

import pytest

from configs.errors import ConfigError
from configs.run import RunConfig
from configs.validate import check_settings
from tests.run_configs import run_config

HYBRID = "HYBRID_SHARD"
ZERO2_HYBRID = "_HYBRID_SHARD_ZERO2"

# (overrides of the other sections' fields, fsdp overrides, world size, device type, phrase of the message)
REFUSED = {
    "fp16 without mixed precision": (
        {},
        {"use_fp16": True, "mixed_precision": False},
        2,
        "cuda",
        "--mixed_precision true",
    ),
    "fp16 on CPU": ({}, {"use_fp16": True}, 2, "cpu", "needs a CUDA GPU"),
    "bf16 reduction of fp32 training": (
        {},
        {"mixed_precision": False, "reduce_dtype": "bf16"},
        2,
        "cpu",
        "leave --reduce_dtype auto",
    ),
    "fp32 reduction of fp16 training": (
        {},
        {"use_fp16": True, "reduce_dtype": "fp32"},
        2,
        "cuda",
        "leave --reduce_dtype auto",
    ),
    "emulated bf16 for fp32 training": (
        {},
        {"mixed_precision": False, "allow_emulated_bf16": True},
        2,
        "cpu",
        "--allow_emulated_bf16 true applies to bf16 training",
    ),
    "emulated bf16 for fp16 training": (
        {},
        {"use_fp16": True, "allow_emulated_bf16": True},
        2,
        "cuda",
        "leave it false for fp32 or fp16",
    ),
    "fp32 reduction with bfSixteen_working": (
        {},
        {"bf16_policy": "bfSixteen_working", "reduce_dtype": "fp32"},
        2,
        "cpu",
        "--mixed_precision false",
    ),
    "CPU offload on CPU": ({}, {"fsdp_cpu_offload": True}, 2, "cpu", "needs GPUs"),
    "flex attention on CPU": ({"attn_implementation": "flex_attention"}, {}, 2, "cpu", "no backward on CPU"),
    "FSDP1 compile with flat parameters": ({}, {"compile": True}, 2, "cpu", "--use_orig_params true"),
    "FSDP1 sync_module_states on CPU": ({}, {"sync_module_states": True}, 2, "cpu", "--cpu_ram_efficient_loading"),
    "FSDP2 size_based wrap": ({}, {"fsdp_version": 2, "wrap_policy": "size_based"}, 2, "cuda", "size_based"),
    "FSDP2 BACKWARD_POST": (
        {},
        {"fsdp_version": 2, "backward_prefetch": "BACKWARD_POST"},
        2,
        "cuda",
        "BACKWARD_POST",
    ),
    "FSDP2 limit_all_gathers false": (
        {},
        {"fsdp_version": 2, "limit_all_gathers": False},
        2,
        "cuda",
        "--limit_all_gathers",
    ),
    "FSDP2 sync_module_states": (
        {},
        {"fsdp_version": 2, "sync_module_states": True},
        2,
        "cuda",
        "--cpu_ram_efficient_loading",
    ),
    "hybrid group not dividing the world": (
        {},
        {"sharding_strategy": HYBRID, "hybrid_shard_group_size": 3},
        4,
        "cpu",
        "does not divide the world size 4",
    ),
    "FSDP1 hybrid with one-rank groups": (
        {},
        {"sharding_strategy": HYBRID, "hybrid_shard_group_size": 1},
        2,
        "cpu",
        "silently stop synchronising gradients",
    ),
    "FSDP1 ZeRO-2 hybrid with one-rank groups": (
        {},
        {"sharding_strategy": ZERO2_HYBRID, "hybrid_shard_group_size": 1},
        2,
        "cpu",
        "--hybrid_shard_group_size",
    ),
    "best by ROUGE without ROUGE": (
        {"eval_rouge": False, "metric_for_best": "rougeL"},
        {},
        2,
        "cpu",
        "--eval_rouge true",
    ),
    "evaluate-only without ROUGE": ({"eval_rouge": False, "evaluate_only": True}, {}, 2, "cpu", "--evaluate_only"),
    "periodic evaluation with nothing to evaluate": (
        {"eval_rouge": False, "run_validation": False, "eval_every_n_steps": 5},
        {},
        2,
        "cpu",
        "--eval_every_n_steps",
    ),
    # --run_validation false switches all evaluation off, ROUGE included.
    "periodic ROUGE with all evaluation off": (
        {"run_validation": False, "eval_every_n_steps": 5},
        {},
        2,
        "cpu",
        "--run_validation true",
    ),
    "best by ROUGE with all evaluation off": (
        {"run_validation": False, "metric_for_best": "rouge2"},
        {},
        2,
        "cpu",
        "--run_validation true",
    ),
    "warmup with the per-epoch schedule": ({"warmup_steps": 5}, {}, 2, "cpu", "--lr_scheduler constant"),
    "two warmups": ({"lr_scheduler": "cosine", "warmup_steps": 5, "warmup_ratio": 0.1}, {}, 2, "cpu", "not both"),
    "FSDP1 weight decay without original parameters": (
        {"weight_decay": 0.01},
        {},
        2,
        "cpu",
        "--use_orig_params true",
    ),
    "periodic checkpoints but none kept": (
        {"save_every_n_steps": 5, "keep_last_n": 0},
        {},
        2,
        "cpu",
        "--keep_last_n 1",
    ),
}

ACCEPTED = {
    "defaults on CPU": ({}, {}, 2, "cpu"),
    "defaults on GPU": ({}, {}, 8, "cuda"),
    "fp16 with mixed precision on GPU": ({}, {"use_fp16": True}, 2, "cuda"),
    "the tutorial's all-bf16 policy": ({}, {"reduce_dtype": "bf16"}, 2, "cpu"),
    "bf16 compute, fp32 reduction": ({}, {"reduce_dtype": "fp32"}, 2, "cpu"),
    "bfSixteen_working by default": ({}, {"bf16_policy": "bfSixteen_working"}, 2, "cpu"),
    "emulated bf16 allowed": ({}, {"allow_emulated_bf16": True}, 2, "cpu"),
    "CPU offload on GPU": ({}, {"fsdp_cpu_offload": True}, 2, "cuda"),
    "flex attention on GPU": ({"attn_implementation": "flex_attention"}, {}, 2, "cuda"),
    "FSDP1 compile with original parameters": ({}, {"compile": True, "use_orig_params": True}, 2, "cpu"),
    "FSDP2 compile": ({}, {"compile": True, "fsdp_version": 2}, 2, "cpu"),
    "FSDP1 sync_module_states on GPU": ({}, {"sync_module_states": True}, 2, "cuda"),
    "rank-0-only loading, FSDP1 on CPU": ({}, {"cpu_ram_efficient_loading": True}, 2, "cpu"),
    "FSDP2 defaults": ({}, {"fsdp_version": 2}, 2, "cpu"),
    "FSDP2 without prefetch": ({}, {"fsdp_version": 2, "backward_prefetch": None}, 2, "cpu"),
    "FSDP1 hybrid 2x2": ({}, {"sharding_strategy": HYBRID, "hybrid_shard_group_size": 2}, 4, "cpu"),
    "FSDP2 hybrid 4x1": (
        {},
        {"fsdp_version": 2, "sharding_strategy": HYBRID, "hybrid_shard_group_size": 1},
        4,
        "cpu",
    ),
    "size_based with FSDP1": ({}, {"wrap_policy": "size_based"}, 2, "cpu"),
    "no checkpoints at all": ({"keep_last_n": 0}, {}, 2, "cpu"),
    "FSDP1 weight decay with original parameters": ({"weight_decay": 0.01}, {"use_orig_params": True}, 2, "cpu"),
    "FSDP2 weight decay": ({"weight_decay": 0.01}, {"fsdp_version": 2}, 2, "cpu"),
    "periodic validation loss without ROUGE": ({"eval_rouge": False, "eval_every_n_steps": 5}, {}, 2, "cpu"),
    "no evaluation at all": ({"run_validation": False}, {}, 2, "cpu"),
    "best by ROUGE": ({"metric_for_best": "rougeLsum"}, {}, 2, "cpu"),
    "evaluate-only needs ROUGE alone": ({"evaluate_only": True, "run_validation": False}, {}, 2, "cpu"),
    "cosine with warmup ratio": ({"lr_scheduler": "cosine", "warmup_ratio": 0.1}, {}, 2, "cpu"),
}


def configs(other_overrides: dict, fsdp_overrides: dict) -> RunConfig:
    config = run_config(**other_overrides, **fsdp_overrides)
    assert set(fsdp_overrides) == {
        name for name in [*other_overrides, *fsdp_overrides] if hasattr(config.fsdp, name)
    }, "an FSDP field among the other sections' overrides, or the reverse"
    return config


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_combinations(case):
    other_overrides, fsdp_overrides, world_size, device_type, phrase = REFUSED[case]
    with pytest.raises(ConfigError, match=phrase):
        check_settings(configs(other_overrides, fsdp_overrides), world_size, device_type)


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_accepted_combinations(case):
    other_overrides, fsdp_overrides, world_size, device_type = ACCEPTED[case]
    check_settings(configs(other_overrides, fsdp_overrides), world_size, device_type)


def test_hybrid_group_defaults_to_the_ranks_of_one_node(monkeypatch):
    config = configs({}, {"sharding_strategy": HYBRID})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank per node: one-rank shard groups
    with pytest.raises(ConfigError, match="shard group of 1 rank"):
        check_settings(config, 2, "cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_settings(config, 4, "cpu")


@pytest.mark.parametrize(
    "argv", [["--num_beams", "0"], ["--max_new_tokens", "-1"], ["--no_repeat_ngram_size", "-2"]]
)
def test_bad_generation_settings_are_refused(argv):
    from configs.cli import parse_args

    with pytest.raises(ConfigError, match=argv[0]):
        parse_args(argv)


WEIGHT_DECAY_NOTE = (
    "--use_orig_params true, for --weight_decay 0.01: FSDP1 spares the layer norms the decay only with the "
    "original parameters (accelerate's default fsdp_use_orig_params: true too)"
)


def test_weight_decay_under_fsdp1_turns_the_original_parameters_on_unless_they_are_given_false(tmp_path):
    """HF's --weight_decay 0.01 under the default FSDP1 trains, as under HF's Trainer and accelerate, with one
    line; the controls: without decay, or under FSDP2, nothing changes and nothing is said; --use_orig_params
    false given (a flag, a --config file) is kept, and the decay refused as before."""
    from configs.cli import implied_notes, parse_args

    config = parse_args(["--weight_decay", "0.01"])
    assert config.fsdp.use_orig_params and config == parse_args(["--weight_decay", "0.01", "--use_orig_params"])
    check_settings(config, 2, "cpu")
    assert implied_notes(["--weight_decay", "0.01"]) == [WEIGHT_DECAY_NOTE]
    for argv in ([], ["--weight_decay", "0"], ["--weight_decay", "0.01", "--fsdp_version", "2"]):
        assert not parse_args(argv).fsdp.use_orig_params and implied_notes(argv) == [], argv
    path = tmp_path / "settings.yaml"
    path.write_text("use_orig_params: false\n", encoding="utf-8")
    for given in (["--use_orig_params", "false"], ["--config", str(path)]):
        argv = ["--weight_decay", "0.01", *given]
        config = parse_args(argv)
        assert not config.fsdp.use_orig_params and implied_notes(argv) == [], argv
        with pytest.raises(ConfigError, match="only with --use_orig_params true"):
            check_settings(config, 2, "cpu")


def test_the_run_says_the_original_parameters_were_turned_on_once(log_records):
    import T5_training

    config, _ = T5_training.read_settings(["--weight_decay", "0.01"])
    said = [record.getMessage() for record in log_records]
    assert config.fsdp.use_orig_params and said.count(WEIGHT_DECAY_NOTE) == 1
    log_records.clear()
    T5_training.read_settings(["--weight_decay", "0.01", "--use_orig_params", "true"])  # given: nothing to say
    assert WEIGHT_DECAY_NOTE not in [record.getMessage() for record in log_records]


def test_a_resume_keeps_the_original_parameters_its_run_had():
    """The record decides: a run that decayed under FSDP1 resumes with them on; one trained under FSDP2 (its
    record: false) that gives --weight_decay again gets no change it did not ask for."""
    from configs.cli import config_to_dict, continue_run, parse_args

    for argv in (["--weight_decay", "0.01"], ["--weight_decay", "0.01", "--fsdp_version", "2"]):
        config = parse_args(argv)
        resumed, changes = continue_run(
            ["--resume", "true", "--weight_decay", "0.01"], config_to_dict(config), "r"
        )
        assert resumed.fsdp.use_orig_params == config.fsdp.use_orig_params and changes == [], (argv, changes)
