"""--attn_implementation t5_flex (utils/model/t5_attention.py) against transformers' stock T5 attention. On CPU
t5_flex runs its SDPA paths (the float mask for self-attention, the boolean one for cross-attention): the same
losses, gradients and generated tokens in fp32, on one process and under FSDP1 and FSDP2. Its GPU path,
FlexAttention, runs here forward only (torch's reference implementation: no CPU backward), for logits and
generated tokens; its backward is checked on a GPU by scripts/gpu_check.py. And the kernels refused per
family."""

import copy
import pickle

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention
from transformers import BartConfig, GPT2Config, LlamaConfig, T5Config, UMT5Config

from configs.errors import ConfigError
from tests.dist_harness import run_ranks
from tests.dist_workers import CPU, FP32, LR, _fsdp_config, make_batch, sharded, tiny_t5, train_wrapped
from utils.model import t5_attention
from utils.model.loading import check_attention_fits
from utils.spec import SEQ2SEQ, spec_for

STEPS = 3


def padded_batch(seed: int) -> dict:
    """Source and target padding (training passes no decoder mask; the forward test below does)."""
    return make_batch(seed, rows=4, src_len=24, tgt_len=9)


def train(kernel: str, steps: int = STEPS) -> tuple[list[float], list[torch.Tensor], torch.Tensor]:
    """fp32 losses of AdamW steps, the first step's gradients, and greedy then beam-search tokens."""
    t5_attention.register()
    model = tiny_t5(attn_implementation=kernel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, first_grads = [], []
    for step in range(steps):
        batch = padded_batch(step)
        token_losses, labels = SEQ2SEQ.token_losses(model, batch)
        loss = token_losses.sum() / (labels != -100).sum()
        loss.backward()
        if step == 0:
            first_grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    batch = padded_batch(10)
    with torch.no_grad():
        tokens = [generated(model, batch, new_tokens=8, beams=beams) for beams in (1, 2)]
    return losses, first_grads, tokens


def generated(model, batch: dict, new_tokens: int, beams: int = 1) -> torch.Tensor:
    """Greedy (or beam-search) tokens of `batch`, with the KV cache as generation uses it."""
    return model.generate(input_ids=batch["source_ids"], attention_mask=batch["source_mask"], use_cache=True,
                          max_new_tokens=new_tokens, num_beams=beams, do_sample=False)  # fmt: skip


@pytest.fixture(scope="module")
def runs() -> dict:
    return {kernel: train(kernel) for kernel in ("sdpa", t5_attention.NAME)}


def test_t5_flex_trains_as_the_stock_model(runs):
    (stock_losses, stock_grads, _), (losses, grads, _) = runs["sdpa"], runs[t5_attention.NAME]
    for step, (got, want) in enumerate(zip(losses, stock_losses, strict=True)):
        assert got == pytest.approx(want, rel=1e-6), f"step {step + 1}: t5_flex {got} vs sdpa {want}"
    largest = max(g.abs().max().item() for g in stock_grads)
    worst = max((a - b).abs().max().item() for a, b in zip(grads, stock_grads, strict=True))
    assert worst <= 1e-5 * largest, f"gradients differ by {worst:.3g} (largest gradient {largest:.3g})"


def test_t5_flex_generates_the_stock_models_tokens(runs):
    for got, want in zip(runs[t5_attention.NAME][2], runs["sdpa"][2], strict=True):
        assert torch.equal(got, want)


def test_flexattention_forward_matches_the_stock_model(monkeypatch):
    """The GPU path (FlexAttention, bias as score_mod, padding and causality as block masks), forced on CPU for
    every self-attention, run forward by torch's reference FlexAttention: the logits with source and target
    padding, and the tokens of a generation (its one-token decoder steps too)."""
    calls = []

    def reference_flex():
        calls.append(1)
        return flex_attention

    monkeypatch.setattr(t5_attention, "flex_device", lambda query: True)
    monkeypatch.setattr(t5_attention, "FLEX_MIN_LENGTH", 0)
    monkeypatch.setattr(t5_attention, "flex_kernel", reference_flex)
    t5_attention.register()
    batch = padded_batch(3)
    inputs = dict(input_ids=batch["source_ids"], attention_mask=batch["source_mask"],
                  decoder_input_ids=batch["target_ids"], decoder_attention_mask=batch["target_mask"])  # fmt: skip
    stock, flex = (
        tiny_t5(attn_implementation="eager").eval(),
        tiny_t5(attn_implementation=t5_attention.NAME).eval(),
    )
    with torch.no_grad(), pytest.warns(UserWarning, match="without torch.compile"):
        want, got = stock(**inputs).logits, flex(**inputs).logits
        assert len(calls) == 2 * stock.config.num_layers, "every encoder and decoder self-attention"
        assert (got - want).abs().max().item() < 1e-5
        tokens = [generated(model, batch, new_tokens=6) for model in (stock, flex)]
    assert torch.equal(*tokens)


def t5_flex_worker(rank: int, world_size: int, steps: int) -> dict:
    """Per-step losses and final full weights (rank 0) of transformers' sdpa and of t5_flex, under FSDP1 and
    FSDP2 with activation checkpointing (the mask object passes through the checkpointed blocks)."""
    t5_attention.register()
    out = {}
    for version in (1, 2):
        for kernel in ("sdpa", t5_attention.NAME):
            config = _fsdp_config({"fsdp_version": version, "fsdp_activation_checkpointing": True})
            model, parallelism = sharded(tiny_t5(attn_implementation=kernel), config, FP32)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            losses = train_wrapped(model, parallelism, optimizer, rank, world_size, steps)
            out[(version, kernel)] = (losses, parallelism.full_state_dict(model, CPU))
    return out


@pytest.mark.slow  # 12 s: four sharded runs
def test_fsdp_backends_train_alike_with_t5_flex():
    rank0, rank1 = run_ranks(t5_flex_worker, STEPS)
    for version in (1, 2):
        (stock_losses, stock_state), (losses, state) = (
            rank0[(version, "sdpa")],
            rank0[(version, t5_attention.NAME)],
        )
        assert rank1[(version, t5_attention.NAME)][0] == losses
        assert losses == pytest.approx(stock_losses, rel=1e-6), f"FSDP{version}"
        worst = max((state[name] - stock_state[name]).abs().max().item() for name in stock_state)
        assert worst < 1e-6, f"FSDP{version}: weights differ by {worst:.3g} after {STEPS} steps"


@pytest.mark.parametrize(
    ("config", "kernel", "message"),
    [
        (T5Config(), "flex_attention", "wrong scores at batch > 1.*t5_flex"),
        (BartConfig(), "t5_flex", "not for a bart model"),
        (UMT5Config(), "flex_attention", "umt5 model wrong scores at batch > 1"),
        (GPT2Config(), "flex_attention", "no flex_attention kernel for GPT2LMHeadModel. Use sdpa"),
    ],
)
def test_kernels_that_do_not_fit_the_family_are_refused(config, kernel, message):
    with pytest.raises(ConfigError, match=message):
        check_attention_fits(config, spec_for(config), kernel)


def test_kernels_that_fit_are_accepted():
    accepted = [(T5Config(), "t5_flex"), (BartConfig(), "flex_attention"), (T5Config(), "sdpa"),
                (LlamaConfig(), "flex_attention"), (GPT2Config(), "sdpa")]  # fmt: skip
    for config, kernel in accepted:
        check_attention_fits(config, spec_for(config), kernel)


@pytest.mark.parametrize("model_type", ["t5", "mt5"])
def test_fused_norms_compute_t5s_norm(model_type):
    """fuse_norms: every RMS norm of the stacks (a block's two or three, each stack's final one) computed by
    F.rms_norm, with T5's class as its base and its weight names (and a model that pickles); on CPU in float32
    the forward and the gradients equal T5's bit for bit, in bf16 within one rounding (T5 rounds twice);
    mixed dtypes take T5's own forward. (On a GPU the fused kernel sums in another order: gpu_check.)"""
    from transformers import AutoModelForSeq2SeqLM, MT5Config

    config = (MT5Config if model_type == "mt5" else T5Config)(
        vocab_size=64, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2, num_decoder_layers=2
    )
    torch.manual_seed(0)
    stock = AutoModelForSeq2SeqLM.from_config(config)
    fused = copy.deepcopy(stock)
    norm_class = type(stock.encoder.final_layer_norm)
    assert t5_attention.fuse_norms(fused) == 2 * 2 + 2 * 3 + 2
    assert isinstance(fused.encoder.final_layer_norm, norm_class)
    assert list(fused.state_dict()) == list(stock.state_dict())
    assert (
        type(pickle.loads(pickle.dumps(fused.encoder.final_layer_norm))).__name__ == f"Fused{norm_class.__name__}"
    )
    for dtype, tolerance in ((torch.float32, 0.0), (torch.bfloat16, 2**-7)):
        stock_norm, fused_norm = stock.encoder.final_layer_norm.to(dtype), fused.encoder.final_layer_norm.to(dtype)
        hidden = (torch.randn(3, 5, 32) * 4).to(dtype).requires_grad_()
        want, got = stock_norm(hidden), fused_norm(hidden)
        assert got.dtype == want.dtype == dtype
        worst = ((got - want).abs() / want.abs().clamp(min=1)).max().item()
        assert worst <= tolerance, (dtype, worst)
        if dtype == torch.float32:  # the gradients of the weight and of the input, which reaches every layer
            pairs = ((want, stock_norm), (got, fused_norm))
            grads = [torch.autograd.grad(out.square().sum(), (norm.weight, hidden)) for out, norm in pairs]
            assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    mixed = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    fused_norm.float()  # a float32 weight on bf16 inputs: T5's forward, which returns float32
    assert torch.equal(fused_norm(mixed), stock_norm.float()(mixed))
