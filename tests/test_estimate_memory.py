"""scripts/estimate_memory.py: the memory planner's state figures and its command line."""

import pytest
from transformers import T5ForConditionalGeneration

from scripts.estimate_memory import estimate, load_shape, main
from utils.paths import EMBEDDED_MODEL_DIR

SETTINGS = dict(
    mixed_precision="bf16", activation_checkpointing=True, batch_size=4, max_source_length=64, max_target_length=16
)


def test_parameter_count_from_the_config_equals_the_model():
    real = sum(p.numel() for p in T5ForConditionalGeneration.from_pretrained(EMBEDDED_MODEL_DIR).parameters())
    assert (
        estimate(
            load_shape(str(EMBEDDED_MODEL_DIR)), nproc=2, sharding_strategy="FULL_SHARD", **SETTINGS
        ).param_numel_total
        == real
    )


@pytest.mark.parametrize("name", ["t5-small", "t5-11b", "t5-v1_1-xl", "flan-t5-base"])
def test_parameter_count_of_published_shapes_equals_the_model(name):
    """v1.0 (tied, ReLU, t5-11b included) and v1.1 / FLAN-T5 (gated GELU, untied head, as their checkpoints
    load), built on meta."""
    import torch
    from transformers import T5Config

    from scripts.make_random_t5 import SHAPES, untie_head

    with torch.device("meta"):
        model = T5ForConditionalGeneration(T5Config(vocab_size=32128, **SHAPES[name]))
        if not SHAPES[name]["tie_word_embeddings"]:
            untie_head(model)
    real = sum(p.numel() for p in model.parameters())
    planned = estimate(load_shape(name), nproc=8, sharding_strategy="FULL_SHARD", **SETTINGS).param_numel_total
    assert planned == real, (name, planned, real)


@pytest.mark.parametrize(
    "strategy, group, expected_degree", [("FULL_SHARD", 0, 8), ("NO_SHARD", 0, 1), ("HYBRID_SHARD", 4, 4)]
)
def test_state_is_divided_by_the_shard_degree(strategy, group, expected_degree):
    result = estimate(
        load_shape("t5-base"), nproc=8, sharding_strategy=strategy, shard_group_size=group, **SETTINGS
    )
    assert result.param_numel_local == pytest.approx(result.param_numel_total / expected_degree, rel=1e-4)
    assert result.optimizer_bytes == 2 * result.parameters_bytes == 2 * result.gradients_bytes


def test_zero2_keeps_every_unit_whole_and_checkpointing_saves_activations():
    shape = load_shape("t5-base")
    full = estimate(shape, nproc=8, sharding_strategy="FULL_SHARD", **SETTINGS)
    zero2 = estimate(shape, nproc=8, sharding_strategy="SHARD_GRAD_OP", **SETTINGS)
    assert zero2.largest_unsharded_unit_bytes == 2 * full.param_numel_total  # the whole model in bf16
    # FULL_SHARD gathers one unit at a time; t5-base's biggest is the root: the shared embedding + 2 norms.
    assert full.largest_unsharded_unit_bytes == 2 * (32128 * 768 + 2 * 768)
    without = estimate(
        shape, nproc=8, sharding_strategy="FULL_SHARD", **{**SETTINGS, "activation_checkpointing": False}
    )
    assert without.activations_bytes > full.activations_bytes


def test_command_line_prints_every_component(capsys):
    argv = [
        "--model",
        "t5-3b",
        "--nproc",
        "8",
        "--sharding_strategy",
        "FULL_SHARD",
        "--mixed_precision",
        "bf16",
        "--activation_checkpointing",
        "true",
        "--batch_size",
        "4",
        "--max_source_length",
        "512",
        "--max_target_length",
        "150",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2851.6M parameters" in out
    for part in ("parameters", "gradients", "optimizer", "largest unsharded unit", "activations", "total"):
        assert part in out
