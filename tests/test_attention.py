"""--attn_implementation: the kernel reaches the model, and the kernels train alike in fp32."""

import pytest
import torch

from configs.paths import EMBEDDED_MODEL_DIR
from configs.recipe import RecipeConfig
from tests.dist_workers import make_batch
from utils.model.loading import load_model_for_run, load_tokenizer, model_config_overrides
from utils.spec import SEQ2SEQ

KERNELS = ["eager", "sdpa"]  # flex_attention has no backward on CPU (refused there by configs/validate.py)


def train_losses(attn_implementation: str, steps: int = 3) -> list[float]:
    """fp32 token-mean losses of AdamW steps on padded random batches, dropout off."""
    config = RecipeConfig(attn_implementation=attn_implementation, dropout_rate=0.0)
    tokenizer = load_tokenizer(EMBEDDED_MODEL_DIR)
    loaded = load_model_for_run(EMBEDDED_MODEL_DIR, False, None, model_config_overrides(config), tokenizer)
    assert loaded.model.config._attn_implementation == attn_implementation
    optimizer = torch.optim.AdamW(loaded.model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        token_losses, labels = SEQ2SEQ.token_losses(loaded.model, make_batch(step, rows=4, src_len=24, tgt_len=9))
        loss = token_losses.sum() / (labels != -100).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def losses() -> dict:  # one per kernel
    return {kernel: train_losses(kernel) for kernel in KERNELS}


def test_sdpa_trains_like_eager_in_fp32(losses):
    """Padding masks and T5's position bias enter both kernels: a wrong mask would move the loss by far
    more than 1e-4."""
    for step, (got, want) in enumerate(zip(losses["sdpa"], losses["eager"], strict=True)):
        assert got == pytest.approx(want, rel=1e-4), f"step {step + 1}: sdpa {got} vs eager {want}"
