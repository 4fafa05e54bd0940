"""scripts/estimate_memory.py: the memory planner's state figures, its activation figure against the bytes
autograd really keeps (counted by the memory account's SavedTensorCounter), and its command line."""

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

from configs.paths import EMBEDDED_MODEL_DIR
from policies.activation_checkpointing_functions import apply_fsdp_checkpointing
from policies.wrapping import layer_classes
from scripts.estimate_memory import T5Shape, estimate, load_shape, main
from scripts.make_random_t5 import SHAPES
from tests.dist_workers import make_batch
from utils.observe.memory import SavedTensorCounter
from utils.spec import CAUSAL, SEQ2SEQ

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
    for part in ("parameters", "gradients", "optimizer", "largest unsharded unit", "activations", "recompute"):
        assert part in out


def saved_and_planned(config: T5Config, lengths: tuple, checkpointing: bool, dtype: torch.dtype) -> tuple:
    """(bytes one CPU training forward keeps for backward, the planner's activation figure for it)."""
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config).train().to(dtype)
    if checkpointing:
        apply_fsdp_checkpointing(model, layer_classes(model))
    with SavedTensorCounter() as counter:
        SEQ2SEQ.token_losses(model, make_batch(0, rows=4, src_len=lengths[0], tgt_len=lengths[1]))
    planned = estimate(
        T5Shape.from_config(config.to_dict()),
        nproc=1,
        sharding_strategy="NO_SHARD",
        mixed_precision="fp32" if dtype == torch.float32 else "bf16",
        activation_checkpointing=checkpointing,
        batch_size=4,
        max_source_length=lengths[0],
        max_target_length=lengths[1],
        device="cpu",
        attn_implementation=config._attn_implementation,
        dropout_rate=config.dropout_rate,
    )
    return counter.bytes, planned.activations_bytes


def shape_config(name: str, attn_implementation: str, **overrides) -> T5Config:
    fields = T5Config.from_pretrained(EMBEDDED_MODEL_DIR).to_dict() if name == "embedded" else SHAPES[name]
    fields = {key: value for key, value in fields.items() if key not in ("is_gated_act", "dense_act_fn")}
    settings = {"use_cache": False, "dropout_rate": 0.1, "decoder_start_token_id": 0, "pad_token_id": 0}
    config = T5Config(**{"vocab_size": 32128, **fields, **settings, **overrides})
    config._attn_implementation = attn_implementation
    return config


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize(
    "name, lengths", [("embedded", (64, 16)), ("embedded", (256, 64)), ("t5-small", (64, 16))]
)
def test_activation_figure_equals_what_autograd_keeps(name, lengths, checkpointing):
    """fp32, the sdpa default and eager: the planner counts every tensor T5's forward saves (a few scalars
    aside), with and without activation checkpointing, at two lengths (the longer, whose attention grows with
    its square, on the embedded shape only: t5-small at 256 tokens took 50 s of the suite for no other
    path)."""
    for attn in ("sdpa", "eager"):
        saved, planned = saved_and_planned(shape_config(name, attn), lengths, checkpointing, torch.float32)
        assert planned == pytest.approx(saved, rel=2e-3, abs=64), (attn, saved, planned)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_activation_figure_in_bf16_with_the_gated_feed_forward(gated, checkpointing):
    """bf16 keeps fp32 copies in the norms; CPU's sdpa keeps its attention in fp32; gated GELU (v1.1,
    flan-t5) keeps more of the feed-forward."""
    overrides = {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False} if gated else {}
    for attn in ("sdpa", "eager"):
        config = shape_config("embedded", attn, **overrides)
        saved, planned = saved_and_planned(config, (64, 16), checkpointing, torch.bfloat16)
        assert planned == pytest.approx(saved, rel=2e-3, abs=64), (attn, saved, planned)


@pytest.fixture(scope="module")
def causal_folders(tmp_path_factory):
    from scripts.make_tiny_family import make

    root = tmp_path_factory.mktemp("planned")
    for family in ("llama", "gpt2"):
        make(family, str(root / family))
    return {family: str(root / family) for family in ("llama", "gpt2")}


def causal_saved(folder: str, attn: str, dtype: torch.dtype, checkpointing: bool, tokens: int, **fields) -> int:
    """Bytes a CPU training forward of the real model keeps for backward: 3 full rows of `tokens`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, use_cache=False, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn).train()
    if checkpointing:
        apply_fsdp_checkpointing(model, layer_classes(model))
    ids = torch.randint(3, config.vocab_size, (3, tokens))
    with SavedTensorCounter() as counter:
        CAUSAL.token_losses(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return counter.bytes


@pytest.mark.slow  # 64 forwards per family (6 s); the fast subset keeps T5's
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_decoder_only_figures_are_the_models_own(causal_folders, family):
    """A decoder-only model's forward run on fake tensors keeps what the real one keeps, byte for byte: Llama
    (RMS norms, RoPE, grouped-query attention, gated MLP) and GPT-2 (Conv1D layers, learned positions, dropout
    masks), fp32 and bf16, sdpa and eager, with and without activation checkpointing, at two lengths; the
    recompute figure is one layer's; the units' parameters are the model's FSDP units'."""
    from transformers import AutoModelForCausalLM

    folder = causal_folders[family]
    shape = load_shape(folder)
    for dtype, precision in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for attn in ("sdpa", "eager"):
            for checkpointing in (False, True):
                for tokens in (32, 96):
                    planned = estimate(shape, nproc=1, sharding_strategy="NO_SHARD", mixed_precision=precision,
                                       activation_checkpointing=checkpointing, batch_size=3, max_seq_len=tokens,
                                       attn_implementation=attn, device="cpu")  # fmt: skip
                    saved = causal_saved(folder, attn, dtype, checkpointing, tokens)
                    assert planned.activations_bytes == saved, (dtype, attn, checkpointing, tokens)
    planned = estimate(shape, nproc=1, sharding_strategy="NO_SHARD", mixed_precision="fp32", batch_size=3,
                       activation_checkpointing=True, max_seq_len=32, device="cpu")  # fmt: skip
    one_layer = causal_saved(folder, "sdpa", torch.float32, False, 32, **{"num_hidden_layers": 1, "n_layer": 1})
    assert planned.recompute_bytes == causal_saved(folder, "sdpa", torch.float32, False, 32) - one_layer > 0
    model = AutoModelForCausalLM.from_pretrained(folder)
    layers = [m for m in model.modules() if type(m) in layer_classes(model)]
    units = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert shape.unit_params() == [sum(p.numel() for p in model.parameters()) - sum(units), *units]


def test_the_dropout_flag_reaches_a_decoder_only_models_fields(causal_folders):
    """--dropout_rate sets GPT-2's dropouts as a run does (no masks kept at 0); by default its own (0.1)."""
    folder = causal_folders["gpt2"]
    settings = dict(nproc=1, sharding_strategy="NO_SHARD", mixed_precision="fp32", activation_checkpointing=False,
                    batch_size=3, max_seq_len=32, device="cpu")  # fmt: skip
    own = estimate(load_shape(folder), **settings).activations_bytes
    none = estimate(load_shape(folder), **settings, dropout_rate=0.0).activations_bytes
    assert own == causal_saved(folder, "sdpa", torch.float32, False, 32)
    fields = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    assert none == causal_saved(folder, "sdpa", torch.float32, False, 32, **fields) < own


@pytest.mark.slow  # fake-tensor forwards of three published shapes (5.5 s)
def test_published_llama_shapes_have_their_parameter_counts_and_seed_004s_plan_prints(capsys):
    """Llama 2's published parameter counts (7B: 6,738,415,616; 70B: 68,976,648,192), and seed 004's 70B on
    16 ranks, bf16, checkpointing, 2048 tokens: every component printed."""
    assert sum(load_shape("llama-2-7b").unit_params()) == 6_738_415_616
    assert sum(load_shape("llama-2-70b").unit_params()) == 68_976_648_192
    with pytest.raises(ValueError, match="a decoder-only model's plan needs max_seq_len"):  # not T5's lengths
        estimate(load_shape("llama-2-7b"), nproc=1, sharding_strategy="NO_SHARD", **SETTINGS)
    argv = ["--model", "llama-2-70b", "--nproc", "16", "--batch_size", "1", "--max_seq_len", "2048"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "68976.6M parameters, 16 ranks, FULL_SHARD, bf16, checkpointing true" in out
    for part in ("parameters", "gradients", "optimizer", "largest unsharded unit", "activations", "recompute"):
        assert part in out


def test_other_kinds_of_model_are_refused_with_one_line_each(tmp_path):
    """An encoder-only model (it writes no text), and an encoder-decoder of another family than T5's (its
    layers are not counted here): each one `error:` line, the second naming the run that measures it."""
    from transformers import BartConfig, BertConfig

    bert = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    bert.save_pretrained(tmp_path / "bert")
    with pytest.raises(SystemExit, match="^error: model .* is a bert model, an encoder only"):
        load_shape(str(tmp_path / "bert"))
    BartConfig(vocab_size=100, d_model=16).save_pretrained(tmp_path / "bart")
    with pytest.raises(SystemExit, match="^error: .* is a bart model; .* records each rank's peak memory"):
        load_shape(str(tmp_path / "bart"))
