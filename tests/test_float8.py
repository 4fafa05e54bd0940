"""--float8 true (utils/model/float8.py): each refusal, one message before anything loads (configs/validate.py);
where torchao is installed, the conversion swaps the Linear layers but the output head and those float8's matmul
cannot take, and the converted model trains close to the original (torch computes float8 matmuls on CPU too,
which lets the conversion and FSDP's float8 all-gather be checked here; the speed is the GPU's)."""

import dataclasses
import importlib.util

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from configs.errors import ConfigError
from configs.fsdp import FSDPConfig
from configs.validate import check_settings
from tests.dist_harness import run_ranks
from tests.dist_workers import FP32, causal_batch, sharded, tiny_t5
from tests.run_configs import run_config
from utils.distributed.process_group import DistInfo
from utils.spec import CAUSAL

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install torchao)")


def torchao_found(monkeypatch, found: bool) -> None:
    """importlib's answer for torchao: installed (`found`) or not, whatever this machine has."""
    find_spec = importlib.util.find_spec

    def answer(name, *args):
        if name != "torchao":
            return find_spec(name, *args)
        return find_spec("os") if found else None

    monkeypatch.setattr(importlib.util, "find_spec", answer)


@pytest.fixture
def torchao_present(monkeypatch):
    """For the refusals that come after the package's."""
    torchao_found(monkeypatch, True)


def test_float8_without_torchao_is_refused_before_the_device_is_known(monkeypatch):
    torchao_found(monkeypatch, False)
    with pytest.raises(ConfigError, match="needs the torchao package: pip install torchao"):
        check_settings(run_config(float8=True), 2)


def test_a_cpu_rank_has_no_compute_capability():
    assert DistInfo(0, 0, 1, torch.device("cpu"), "gloo").compute_capability == (0, 0)


@pytest.mark.usefixtures("torchao_present")
@pytest.mark.parametrize(
    ("device_type", "capability", "phrase"),
    [("cpu", (0, 0), "this run is on CPU"), ("cuda", (8, 0), "this GPU's is 8.0"), ("cuda", (7, 5), "is 7.5")],
)
def test_float8_on_a_device_without_float8_matmuls_is_refused(device_type, capability, phrase):
    with pytest.raises(ConfigError, match=f"compute capability 8.9 or newer .*{phrase}"):
        check_settings(run_config(float8=True), 2, device_type, capability)


@pytest.mark.usefixtures("torchao_present")
@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_float8_on_ada_hopper_and_blackwell_is_accepted(capability):
    for fsdp in ({"fsdp_version": 1}, {"fsdp_version": 2}, {"single_rank_fsdp": False}):
        check_settings(run_config(float8=True, **fsdp), 1, "cuda", capability)


@pytest.mark.usefixtures("torchao_present")
def test_float8_with_lora_is_refused():
    with pytest.raises(ConfigError, match="--float8 true .* --peft lora"):
        check_settings(run_config(float8=True, peft="lora"), 2)


def tiny_llama() -> LlamaForCausalLM:
    """Attention 64 x 64 (converted), an MLP of 72 (not a multiple of 16: left), a head of 64 x 1104 (fits: left
    as the head)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1104, hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def converted_layers(rank: int, world_size: int) -> dict:  # noqa: ARG001 - run_ranks' signature
    """Per model: the Linear layers, those convert_to_float8 swapped, and the class of each afterwards."""
    from utils.model.float8 import convert_to_float8

    out = {}
    for name, model in (("llama", tiny_llama()), ("t5", tiny_t5())):
        linears = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
        converted = convert_to_float8(model, all_gather_in_float8=False)
        classes = {name: type(module).__name__ for name, module in model.named_modules() if name in linears}
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        out[name] = {"linears": linears, "converted": sorted(converted), "classes": classes, "tied": tied}
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=1104, n_embd=64, n_layer=1, n_head=4, n_positions=32))
    try:
        convert_to_float8(gpt2, all_gather_in_float8=False)
    except ConfigError as error:  # its blocks' layers are Conv1D: nothing to convert
        out["gpt2"] = str(error)
    return out


@needs_torchao
def test_conversion_swaps_the_linear_layers_but_the_head_and_those_float8_cannot_take():
    """In a pooled worker, replaced after: importing torchao registers ops and types with torch."""
    out = run_ranks(converted_layers, world_size=1, replace_after=True)[0]
    llama, t5 = out["llama"], out["t5"]
    attention = sorted(f"model.layers.{i}.self_attn.{name}_proj" for i in range(2) for name in "qkvo")
    assert llama["converted"] == attention
    assert {name for name, cls in llama["classes"].items() if cls == "Float8Linear"} == set(attention)
    assert llama["classes"]["lm_head"] == llama["classes"]["model.layers.0.mlp.up_proj"] == "Linear"
    assert t5["converted"] == sorted(name for name in t5["linears"] if name != "lm_head")
    assert t5["classes"]["lm_head"] == "Linear" and t5["tied"]  # the tied head untouched
    assert "none of this model's" in out.get("gpt2", "not refused") and "Leave --float8 false" in out["gpt2"]


def float8_worker(rank: int, world_size: int) -> dict:
    """A tiny Llama's first step under FSDP2 on 2 ranks, in float8 (weights all-gathered in float8) and not: its
    loss and gradient norm, the class of a converted layer, and the full state dict's names and tensor classes
    (rank 0's)."""
    out = {}
    for float8 in (False, True):
        fsdp = dataclasses.replace(FSDPConfig(mixed_precision=False, fsdp_version=2), float8=float8)
        model, parallelism = sharded(tiny_llama(), fsdp, FP32)
        token_losses, labels = CAUSAL.token_losses(model, causal_batch(rank, rows=4, vocab=1104))
        loss = token_losses.sum() / (labels != -100).sum()
        loss.backward()
        state = parallelism.full_state_dict(model, torch.device("cpu"))
        out[float8] = {
            "loss": loss.item(),
            "norm": parallelism.clip_grad_norm(model, 1e9).item(),
            "layer": type(model.model.layers[0].self_attn.q_proj).__name__,
            "names": sorted(state),
            "classes": {type(tensor).__name__ for tensor in state.values()},
        }
    return out


@pytest.mark.slow  # both ranks import torchao (5-10 s) before their step
@needs_torchao
def test_fsdp2_trains_the_float8_layers_gathered_in_float8_close_to_the_model_in_fp32():
    results = run_ranks(float8_worker, replace_after=True)
    for rank, out in enumerate(results):
        plain, float8 = out[False], out[True]
        assert (plain["layer"], float8["layer"]) == ("Linear", "Float8Linear"), rank
        assert float8["loss"] == pytest.approx(plain["loss"], rel=1e-2) and float8["loss"] != plain["loss"], rank
        assert float8["norm"] == pytest.approx(plain["norm"], rel=5e-2), rank
    plain, float8 = results[0][False], results[0][True]
    assert float8["names"] == plain["names"] and float8["classes"] == plain["classes"] == {"Tensor"}
