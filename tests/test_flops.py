"""utils/observe/flops.py: the training FLOPs against a hand count and against torch's own FLOP counter on a
real model of each family, and the peak table."""

import inspect

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    DynamicCache,
    GPT2Config,
    LongT5Config,
    MBartConfig,
    MBartForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
)

from configs.paths import EMBEDDED_MODEL_DIR
from scripts import make_tiny_family
from utils.observe.flops import CausalFlops, Seq2SeqFlops, Throughput, attended_pairs, gpu_peak_flops
from utils.spec import SEQ2SEQ

# The embedded T5 as it is and gated, make_tiny_family's folders, and mBART (BART's matmuls, pre-norm), which
# has no folder of its own: built from BART's tiny shape.
FAMILIES = ("t5", *make_tiny_family.FAMILIES, "mbart")  # t5-v1_1: flan-t5's gated feed-forward


def embedded_config(**overrides) -> T5Config:
    """The embedded model's config with `overrides` applied through the constructor (from_pretrained's
    keyword arguments would skip what __init__ derives from them, such as is_gated_act)."""
    base = T5Config.from_pretrained(EMBEDDED_MODEL_DIR).to_dict()
    derived = ("is_gated_act", "dense_act_fn")  # from feed_forward_proj
    kept = {key: value for key, value in base.items() if key not in derived}
    return T5Config(**{**kept, **overrides})


def test_hand_count_of_a_tiny_config():
    config = T5Config(d_model=4, d_kv=2, num_heads=2, d_ff=8, num_layers=1, num_decoder_layers=1, vocab_size=10)
    flops = Seq2SeqFlops.from_config(config)
    # Encoder block: q, k, v, o (4 x 4x4) + wi, wo (2 x 4x8) = 128; decoder adds cross-attention: 192, of
    # which cross k and v (2 x 4x4 = 32) project the encoder's 3 tokens.
    counts = (flops.encoder_weights, flops.decoder_weights, flops.cross_kv_weights, flops.head_weights)
    assert counts == (128, 192, 32, 40)
    batch = {"source_mask": torch.ones(1, 3), "target_mask": torch.ones(1, 2)}
    # forward: 2 * ((128 + 32)*3 + (192 - 32 + 40)*2) = 1760 linear + 4 * 4 * (3*3 + 2*2 + 2*3) = 304 = 2064
    model, hardware = flops.training(batch, recompute=False)
    assert (model.item(), hardware.item()) == (6192, 6192)
    # recompute: one more forward of the blocks, without the head (2 * 40 * 2 = 160)
    assert flops.training(batch, recompute=True)[1].item() == 6192 + 2064 - 160


@pytest.fixture(scope="session")
def tiny_family_dir(tmp_path_factory):
    """make_tiny_family's folder of a family, built on first use (2-4 s each) and kept for the session."""
    built = {}

    def folder(family: str) -> str:
        if family not in built:
            built[family] = str(tmp_path_factory.mktemp(family))
            make_tiny_family.make(family, built[family])
        return built[family]

    return folder


@pytest.fixture(params=FAMILIES)
def family_model(request, tiny_family_dir):
    """A randomly initialised model of each family, with eager attention: its scores and mixing are the
    matmuls that FlopCounterMode counts."""
    family = request.param
    torch.manual_seed(0)
    if family == "t5":
        return T5ForConditionalGeneration(embedded_config(dropout_rate=0.0, attn_implementation="eager"))
    if family == "mbart":
        config = MBartConfig(
            vocab_size=1000,
            attn_implementation="eager",
            **make_tiny_family.BART_SHAPE,
            decoder_start_token_id=2,  # none by default; which id does not change a FLOP
        )
        return MBartForConditionalGeneration(config)
    return AutoModelForSeq2SeqLM.from_pretrained(tiny_family_dir(family), attn_implementation="eager")


def test_counted_weights_are_the_linear_layers_of_the_blocks(family_model):
    flops = Seq2SeqFlops.from_config(family_model.config)

    def linear_weights(stack):
        return sum(m.weight.numel() for m in stack.modules() if isinstance(m, torch.nn.Linear))

    assert flops.encoder_weights == linear_weights(family_model.get_encoder())
    assert flops.decoder_weights == linear_weights(family_model.get_decoder())
    assert flops.head_weights == family_model.get_output_embeddings().weight.numel()


def unpadded_batch() -> dict:
    """3 rows, 17 source and 6 target tokens, no padding: real and computed tokens are the same."""
    return {
        "source_ids": torch.randint(2, 1000, (3, 17)),
        "source_mask": torch.ones(3, 17, dtype=torch.long),
        "target_ids": torch.randint(2, 1000, (3, 6)),
        "target_mask": torch.ones(3, 6, dtype=torch.long),
    }


def counted_training_flops(model, batch: dict) -> int:
    """Every matmul FLOP of one forward and backward, as torch.utils.flop_counter counts them."""
    counter = FlopCounterMode(display=False)
    with counter:
        token_losses, _ = SEQ2SEQ.token_losses(model, batch)
        token_losses.sum().backward()
    return counter.get_total_flops()


def test_training_flops_equal_torchs_flop_counter_on_the_real_model(family_model):
    """Forward and backward of the real model under torch.utils.flop_counter (every matmul it runs), on a
    batch without padding, where real and computed tokens are the same: the count is exact."""
    batch = unpadded_batch()
    counted = counted_training_flops(family_model, batch)
    model_flops, _ = Seq2SeqFlops.from_config(family_model.config).training(batch, recompute=False)
    assert counted == model_flops.item()


@pytest.mark.parametrize("config", [LongT5Config(), GPT2Config()], ids=["longt5", "gpt2"])
def test_a_model_of_no_counted_family_has_no_count_and_no_flop_rates(config):
    """LongT5 has T5's config fields but attends locally: T5's formula does not hold for it."""
    assert Seq2SeqFlops.from_config(config) is None
    throughput = Throughput(None, recompute=False, world_size=1, peak_flops=1e12)
    assert throughput.rates(0.0, 0.0, seconds=1.0) == {}


def test_peak_table_matches_device_names_most_specific_first():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756.5e12
    assert gpu_peak_flops("NVIDIA H100 NVL", torch.bfloat16) == 835.5e12
    assert gpu_peak_flops("NVIDIA L40", torch.bfloat16) == 181e12  # not the L4's (a prefix of it)
    assert gpu_peak_flops("NVIDIA L40S", torch.bfloat16) == pytest.approx(362.1e12)
    assert gpu_peak_flops("NVIDIA H200", torch.float32) == pytest.approx(66.9e12)
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", torch.bfloat16) is None  # no bf16 on Volta
    assert gpu_peak_flops("Some Future GPU", torch.bfloat16) is None
    # --tf32 (on by default on CUDA): fp32 matmuls at TF32's dense rate, half bf16's; none without bf16
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float32, tf32=True) == pytest.approx(494.7e12)
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, tf32=True) == pytest.approx(156e12)
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16, tf32=True) == 312e12
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", torch.float32, tf32=True) == pytest.approx(15.7e12)


def test_lora_training_flops_against_torchs_flop_counter():
    """--peft lora: frozen weights get no gradient, so a linear layer's backward is one matmul. The count
    leaves out the adapters' own FLOPs (rank 4 here) and counts the first encoder block's input gradients,
    which autograd skips (nothing below it trains): within 5% of torch's count at this tiny shape, where
    the adapters weigh most; and well below the full fine-tuning count."""
    pytest.importorskip("peft")
    from tests.dist_workers import LORA, LORA_BASE
    from utils.model.lora import apply_lora

    config = embedded_config(dropout_rate=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    model = apply_lora(T5ForConditionalGeneration(config), LORA, LORA_BASE, SEQ2SEQ)
    batch = unpadded_batch()
    counted = counted_training_flops(model, batch)
    lora_flops, _ = Seq2SeqFlops.from_config(config, frozen_weights=True).training(batch, recompute=False)
    full_flops, _ = Seq2SeqFlops.from_config(config).training(batch, recompute=False)
    assert lora_flops.item() == pytest.approx(counted, rel=0.05)
    assert lora_flops.item() < 0.8 * full_flops.item()


def test_a_packed_blocks_count_is_the_causal_work_of_each_of_its_documents(tiny_family_dir):
    """The decoder-only count of a packed batch (the tiny Llama, grouped-query attention; two blocks, of documents
    of 5, 3 and 7 tokens and of 6 and 4, position ids restarting at each, then padding) against torch's FLOP
    counter on the work a causal model must do: each document read alone, one token at a time through the KV
    cache, so that every query meets exactly the keys before it in its own document (eager attention: its matmuls
    are what the counter sees). Forward FLOPs, exact. The pairs by hand: s (s + 1) / 2 a document; the control,
    the blocks read as one sequence each (no position ids), pairs each block's tokens across its documents."""
    model = AutoModelForCausalLM.from_pretrained(tiny_family_dir("llama"), attn_implementation="eager").eval()
    blocks, width = [[5, 3, 7], [6, 4]], 17
    torch.manual_seed(0)
    documents = [[torch.randint(3, 900, (1, length)) for length in block] for block in blocks]
    # transformers 5.24 names the model's cache argument `cache` (past_key_values before, deprecated since)
    cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        for document in (d for block in documents for d in block):
            cache = DynamicCache(config=model.config)  # filled in place, token by token
            for t in range(document.shape[1]):
                model(input_ids=document[:, t : t + 1], use_cache=True, **{cache_argument: cache})

    def row(block: list[torch.Tensor], key: str) -> torch.Tensor:
        parts = {"ids": block, "positions": [torch.arange(d.shape[1])[None] for d in block]}[key]
        values = torch.cat(parts, dim=1)[0]
        return torch.cat([values, values.new_zeros(width - len(values))])

    real = [sum(d.shape[1] for d in block) for block in documents]
    batch = {
        "input_ids": torch.stack([row(block, "ids") for block in documents]),
        "position_ids": torch.stack([row(block, "positions") for block in documents]),
        "attention_mask": torch.stack([(torch.arange(width) < n).long() for n in real]),
    }
    count = CausalFlops.from_config(model.config)
    forward = sum(count.forward_parts(*attended_pairs(batch))).item()
    assert counter.get_total_flops() == forward
    assert count.training(batch, recompute=False)[0].item() == 3 * forward
    assert attended_pairs(batch)[1].item() == sum(s * (s + 1) // 2 for block in blocks for s in block)
    as_one_sequence = {key: value for key, value in batch.items() if key != "position_ids"}
    assert attended_pairs(as_one_sequence)[1].item() == sum(n * (n + 1) // 2 for n in real)
