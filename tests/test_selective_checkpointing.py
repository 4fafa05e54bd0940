"""--activation_checkpointing_scope ops (policies/activation_checkpointing_functions.py): per-op selective
checkpointing of the stack layers. On CPU in fp32, its losses and gradients equal those of no checkpointing and of
whole-block checkpointing (T5 and a tiny Llama, dropout on, LoRA); what it keeps for backward lies between the
two (SavedTensorCounter); FSDP1 and FSDP2 on 2 ranks train as the unsharded model does."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

from configs.errors import ConfigError
from configs.fsdp import FSDPConfig
from configs.lora import LoraConfig
from configs.paths import EMBEDDED_MODEL_DIR
from configs.validate import check_activation_checkpointing, check_settings
from policies.activation_checkpointing_functions import (
    ATTENTION_DROPOUT_POSITION,
    apply_fsdp_checkpointing,
    keeps_output,
    kept_outputs_seen_by,
    per_op_contexts,
)
from policies.private_api import state_dict_name
from policies.wrapping import layer_classes
from tests.dist_harness import run_ranks
from tests.dist_workers import VOCAB, causal_batch, fsdp_run, make_batch, reference_run
from tests.run_configs import run_config
from utils.model.lora import apply_lora
from utils.observe.flops import CausalFlops, recomputes_blocks
from utils.observe.memory import SavedTensorCounter
from utils.spec import CAUSAL, SEQ2SEQ

aten = torch.ops.aten
SCOPES = (None, "blocks", "ops")  # None: no checkpointing


def t5(dropout: float) -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    return T5ForConditionalGeneration(
        T5Config.from_pretrained(EMBEDDED_MODEL_DIR, dropout_rate=dropout, use_cache=False)
    )


def llama(dropout: float) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_dropout=dropout, use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


FAMILIES = {"t5": (t5, SEQ2SEQ, make_batch), "llama": (llama, CAUSAL, causal_batch)}


def one_step(family: str, scope: str | None, dropout: float, lora: bool = False) -> dict:
    """The loss, the gradients (by state-dict name) and the bytes kept for backward of one forward and backward
    of `family` checkpointed with `scope`, dropout masks drawn from the same seed."""
    build, spec, batches = FAMILIES[family]
    model = build(dropout).train()
    if lora:
        adapters = LoraConfig(peft="lora", lora_r=4, lora_alpha=8, lora_dropout=dropout)
        model = apply_lora(model, adapters, "base", spec)
    if scope is not None:
        apply_fsdp_checkpointing(model, layer_classes(model), scope)
    torch.manual_seed(1)
    with SavedTensorCounter() as counter:
        token_losses, labels = spec.token_losses(model, batches(0, rows=4))
    loss = token_losses.sum() / (labels != -100).sum()
    loss.backward()
    grads = {state_dict_name(name): p.grad for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads, "saved": counter.bytes}


# Each family with and without dropout (on CPU, SDPA with dropout runs as matmuls, softmax and dropout; without,
# as one kernel, which is kept), and with LoRA.
CASES = {
    "t5 dropout": ("t5", 0.1, False),
    "t5 lora": ("t5", 0.0, True),
    "llama": ("llama", 0.0, False),
    "llama dropout lora": ("llama", 0.1, True),
}


@pytest.mark.parametrize("case", CASES)
def test_per_op_checkpointing_computes_what_no_checkpointing_and_blocks_compute(case):
    family, dropout, lora = CASES[case]
    runs = {scope: one_step(family, scope, dropout, lora) for scope in SCOPES}
    plain = runs[None]
    assert plain["grads"], "nothing trained"
    for scope in ("blocks", "ops"):
        assert torch.equal(runs[scope]["loss"], plain["loss"]), scope
        assert runs[scope]["grads"].keys() == plain["grads"].keys(), scope
        for name, grad in plain["grads"].items():
            assert torch.equal(runs[scope]["grads"][name], grad), (scope, name)
    saved = {scope: run["saved"] for scope, run in runs.items()}
    # A frozen layer's backward needs few of its activations: with LoRA, keeping every matmul's output may keep
    # more than no checkpointing does (docs/memory.md).
    assert (lora or saved[None] > saved["ops"]) and saved["ops"] > saved["blocks"] > 0, saved


def test_an_attention_kernel_is_kept_only_without_dropout():
    q = torch.zeros(1, 1, 2, 4)
    for kernel, position in ATTENTION_DROPOUT_POSITION.items():
        assert kernel._schema.arguments[position].name == "dropout_p", kernel
        without = (q, q, q, *[None] * (position - 3), 0.0)
        assert keeps_output(kernel, (q, q, q), {}) and keeps_output(kernel, without, {}), kernel
        assert not keeps_output(kernel, (q, q, q), {"dropout_p": 0.1}), kernel
        assert not keeps_output(kernel, (*without[:-1], 0.1), {}), kernel
    assert keeps_output(aten.mm.default, (q, q), {}) and not keeps_output(aten.relu.default, (q,), {})


def flex_attention_seen(rank: int, world_size: int) -> bool:  # noqa: ARG001 - run_ranks' signature
    """Whether the counter's mode saw FlexAttention's output (forward only: it has no backward on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 16, 8)
    seen = []
    with kept_outputs_seen_by(seen.append):
        forward, _ = per_op_contexts()
        with forward:
            out = flex_attention(q, q, q)
    return any(tensor is out for tensor in seen)


def test_flexattentions_output_is_kept_and_counted():
    """FlexAttention, a higher-order op, passes the counter's mode. In a worker of its own: eager FlexAttention
    warns once per process, which tests/test_t5_attention.py waits for."""
    assert run_ranks(flex_attention_seen, world_size=1, replace_after=True) == [True]


@pytest.mark.parametrize("inside", [{"peft": "lora"}, {"wrap_policy": "size_based"}], ids=["lora", "size_based"])
def test_ops_with_fsdp1_units_inside_the_layers_is_refused(inside):
    ops = {"activation_checkpointing_scope": "ops"}
    with pytest.raises(ConfigError, match="FSDP1 makes units inside the checkpointed layers"):
        check_settings(run_config(**ops, **inside), 2, "cpu")
    check_settings(run_config(**inside), 2, "cpu")  # whole blocks
    check_settings(run_config(**ops, peft=inside.get("peft", "none"), fsdp_version=2), 2, "cpu")


def test_ops_without_checkpointing_or_with_compile_is_refused():
    ops = FSDPConfig(fsdp_activation_checkpointing=True, activation_checkpointing_scope="ops")
    with pytest.raises(ConfigError, match="--fsdp_activation_checkpointing false turns it off"):
        check_activation_checkpointing(dataclasses.replace(ops, fsdp_activation_checkpointing=False))
    with pytest.raises(ConfigError, match="--compile true with --activation_checkpointing_scope ops"):
        check_activation_checkpointing(dataclasses.replace(ops, compile=True))
    check_activation_checkpointing(ops)
    check_activation_checkpointing(FSDPConfig(fsdp_activation_checkpointing=False))
    check_activation_checkpointing(FSDPConfig(compile=True))


def test_hardware_flops_count_no_recompute_per_op():
    """The hardware FLOPs beyond the model FLOPs (utils/observe/flops.py: recomputes_blocks) are a forward of the
    blocks for whole blocks, and nothing per op, where torch's own counter sees backward compute no more than
    without checkpointing (the matmuls' outputs kept) and for whole blocks more."""
    batch = causal_batch(0)
    counted, measured = {}, {}
    for scope in SCOPES:
        model = llama(0.0).train()
        if scope is not None:
            apply_fsdp_checkpointing(model, layer_classes(model), scope)
        with FlopCounterMode(display=False) as counter:
            token_losses, _ = CAUSAL.token_losses(model, batch)
            token_losses.sum().backward()
        measured[scope] = counter.get_total_flops()
        fsdp = FSDPConfig(
            fsdp_activation_checkpointing=scope is not None, activation_checkpointing_scope=scope or "blocks"
        )
        model_flops, hardware = CausalFlops.from_config(model.config).training(batch, recomputes_blocks(fsdp))
        counted[scope] = (hardware - model_flops).item()
    assert measured["ops"] == measured[None] < measured["blocks"], measured
    assert counted["ops"] == counted[None] == 0 < counted["blocks"], counted


STEPS = 2
BACKENDS = {"FSDP1": {}, "FSDP2": {"fsdp_version": 2}}


def sharded_ops_worker(rank: int, world_size: int) -> dict:
    """Both backends, each stack layer checkpointed per op; the unsharded reference on rank 0."""
    base = FSDPConfig(
        mixed_precision=False, fsdp_activation_checkpointing=True, activation_checkpointing_scope="ops"
    )
    out = {"reference": reference_run(STEPS, world_size) if rank == 0 else None}
    for name, overrides in BACKENDS.items():
        out[name] = fsdp_run(dataclasses.replace(base, **overrides), rank, world_size, STEPS)
    return out


def test_fsdp1_and_fsdp2_checkpointed_per_op_train_as_the_unsharded_model():
    rank0 = run_ranks(sharded_ops_worker)[0]
    reference_losses, reference_state = rank0["reference"]
    for name in BACKENDS:
        losses, state = rank0[name]
        assert losses == pytest.approx(reference_losses, rel=1e-5), name
        diff = max((state[key] - value).abs().max().item() for key, value in reference_state.items())
        assert diff < 1e-5, (name, diff)
