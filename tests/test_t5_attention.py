"""--attn_implementation t5_flex (utils/model/t5_attention.py) against transformers' stock T5 attention: the
same losses, gradients and generated tokens in fp32, on one process and under FSDP1 and FSDP2; FlexAttention's
forward on CPU (its backward runs on a GPU only: scripts/gpu_check.py); the kernels refused per family."""

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention
from transformers import BartConfig, T5Config

from configs.errors import ConfigError
from tests.dist_harness import run_ranks
from tests.dist_workers import make_batch, t5_flex_worker, tiny_t5
from utils.model import t5_attention
from utils.model.loading import check_attention_fits
from utils.train.step import forward_token_losses

STEPS = 3


def batch_with_decoder_padding(seed: int) -> dict:
    return make_batch(seed, rows=4, src_len=24, tgt_len=9)


def train(kernel: str, steps: int = STEPS) -> tuple[list[float], list[torch.Tensor], torch.Tensor]:
    """fp32 losses of AdamW steps, the first step's gradients, and greedy then beam-search tokens."""
    t5_attention.register()
    model = tiny_t5(attn_implementation=kernel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, first_grads = [], []
    for step in range(steps):
        batch = batch_with_decoder_padding(step)
        token_losses, labels = forward_token_losses(model, batch)
        loss = token_losses.sum() / (labels != -100).sum()
        loss.backward()
        if step == 0:
            first_grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    batch = batch_with_decoder_padding(10)
    with torch.no_grad():
        tokens = [
            model.generate(
                input_ids=batch["source_ids"],
                attention_mask=batch["source_mask"],
                use_cache=True,
                max_new_tokens=8,
                num_beams=beams,
                do_sample=False,
            )  # fmt: skip
            for beams in (1, 2)
        ]
    return losses, first_grads, tokens


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
    """The GPU path (FlexAttention, bias as score_mod, padding and causality as block masks), run forward on
    CPU by torch's reference implementation of FlexAttention."""
    taken = []

    def flex_wherever_allowed(query, key, mask, dropout):
        uses = query.shape[-2] == key.shape[-2] and (mask is None or mask.q_offset == 0) and dropout == 0
        taken.append(uses)
        return uses

    monkeypatch.setattr(t5_attention, "uses_flex", flex_wherever_allowed)
    monkeypatch.setattr(t5_attention, "compiled_flex", lambda: flex_attention)
    t5_attention.register()
    batch = batch_with_decoder_padding(3)
    inputs = dict(input_ids=batch["source_ids"], attention_mask=batch["source_mask"],
                  decoder_input_ids=batch["target_ids"], decoder_attention_mask=batch["target_mask"])  # fmt: skip
    with torch.no_grad(), pytest.warns(UserWarning, match="without torch.compile"):
        want = tiny_t5(attn_implementation="eager").eval()(**inputs).logits
        got = tiny_t5(attn_implementation=t5_attention.NAME).eval()(**inputs).logits
    layers = tiny_t5().config.num_layers
    assert taken.count(True) == 2 * layers, "every encoder and decoder self-attention takes FlexAttention"
    assert (got - want).abs().max().item() < 1e-5


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
        (BartConfig(), "t5_flex", "a bart model has no position bias"),
    ],
)
def test_kernels_that_do_not_fit_the_family_are_refused(config, kernel, message):
    with pytest.raises(ConfigError, match=message):
        check_attention_fits(config, kernel)


def test_kernels_that_fit_are_accepted():
    for config, kernel in [(T5Config(), "t5_flex"), (BartConfig(), "flex_attention"), (T5Config(), "sdpa")]:
        check_attention_fits(config, kernel)
