"""Training FLOPs of an encoder-decoder or a decoder-only model from real token counts, and the peak FLOP/s
that MFU divides by.

Model FLOPs of one forward pass of one sequence with S_enc source and S_dec target tokens (matmuls only;
norms, softmax, biases and the loss are a rounding error):

    2 * ((N_enc + N_kv) * S_enc + (N_dec - N_kv + V * d_model) * S_dec)      the linear layers and the head
  + 4 * d_attn * (L_enc * S_enc^2 + L_dec * (S_dec^2 + S_dec * S_enc))         scores (QK^T) and mixing (AV)

N_enc and N_dec are the weights of the Linear layers of each stack's blocks (embeddings and T5's position bias
are lookups), d_attn the attention's width (all heads), N_kv = L_dec * 2 * d_model * d_attn the decoder's
cross-attention k and v, which project the encoder's S_enc tokens (docs/pitfalls.md #24). A decoder-only model
(CausalFlops) is the decoder alone, its attention counted per document and causal, as the model needs it
(each token against itself and the tokens before it in its document, whatever a kernel computes beyond):

    2 * (N + V * d_model) * T + 4 * d_attn * L * sum over the T real tokens of (p + 1)

with T the real tokens and p a token's position in its document (a packed block's position ids restart at each
of its documents; sum (p + 1) is s (s + 1) / 2 for a document of s tokens). A training step is 3x the forward
(backward: the input's and the weight's gradient); whole-block activation checkpointing's recomputed forward is
hardware FLOPs, not model FLOPs (per op it recomputes no matmul: recomputes_blocks), and so is the head's second
forward under --loss_chunk_tokens (utils/loss.py: backward computes each chunk's logits again): 2 * V * d_model
per token.
Families are recognised by model_type, not by their config's field names: LongT5, LED, BigBird-PEGASUS and
PEGASUS-X share T5's or BART's but attend locally or sparsely, and NLLB-MoE routes tokens to experts, so any
other model has no count (no FLOP rates, no MFU). tests/test_flops.py checks the count against
torch.utils.flop_counter on a real model of each family; docs/throughput.md#flops-and-mfu.
"""

import time
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PretrainedConfig

from configs.fsdp import FSDPConfig

T5_STYLE_MODELS = ("t5", "mt5", "umt5")
BART_STYLE_MODELS = ("bart", "mbart", "pegasus")
LLAMA_STYLE_MODELS = ("llama", "mistral", "qwen2", "qwen3")
GPT2_STYLE_MODELS = ("gpt2",)


class FlopCounter(Protocol):
    """What the step and the rates ask of a model spec's FLOP count (utils/spec.py: flop_counter)."""

    def training(
        self, batch: dict, recompute: bool, recompute_head: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(model, hardware) FLOPs of one forward+backward of `batch`, on its device, without a host sync;
        `recompute`: the blocks' forward twice, `recompute_head`: the head's."""
        ...


@dataclass(frozen=True)
class Seq2SeqFlops:
    encoder_weights: int  # N_enc: Linear weights of the encoder blocks
    decoder_weights: int  # N_dec: Linear weights of the decoder blocks
    cross_kv_weights: int  # N_kv: the part of N_dec that projects the encoder's output (cross-attention k, v)
    head_weights: int  # V * d_model
    attention_width: int  # d_attn: num_heads * d_kv (T5 style), d_model (BART style)
    encoder_layers: int
    decoder_layers: int
    frozen_weights: bool = False  # --peft lora: backward computes no gradient for the (frozen) weights

    @classmethod
    def from_config(cls, config: PretrainedConfig, frozen_weights: bool = False) -> "Seq2SeqFlops | None":
        """The count of a T5-style or BART-style model (see the module's docstring); None for any other."""
        if config.model_type in T5_STYLE_MODELS:
            d_model = config.d_model
            width = config.num_heads * config.d_kv
            feed_forward = d_model * config.d_ff * (3 if config.is_gated_act else 2)
            encoder_layers, decoder_layers = config.num_layers, config.num_decoder_layers
            encoder_feed_forward = decoder_feed_forward = feed_forward
        elif config.model_type in BART_STYLE_MODELS:
            d_model = width = config.d_model
            encoder_layers, decoder_layers = config.encoder_layers, config.decoder_layers
            encoder_feed_forward = 2 * d_model * config.encoder_ffn_dim
            decoder_feed_forward = 2 * d_model * config.decoder_ffn_dim
        else:
            return None
        return cls(
            encoder_weights=encoder_layers * (4 * d_model * width + encoder_feed_forward),
            decoder_weights=decoder_layers * (8 * d_model * width + decoder_feed_forward),
            cross_kv_weights=decoder_layers * 2 * d_model * width,
            head_weights=config.vocab_size * d_model,
            attention_width=width,
            encoder_layers=encoder_layers,
            decoder_layers=decoder_layers,
            frozen_weights=frozen_weights,
        )

    def forward_parts(self, source_lengths: torch.Tensor, target_lengths: torch.Tensor, head: bool = True):
        """(linear layers, attention scores and mixing) forward FLOPs of a batch, summed over its sequences
        (lengths: real tokens per row, float64)."""
        src, tgt = source_lengths, target_lengths
        head_weights = self.head_weights if head else 0
        on_source = self.encoder_weights + self.cross_kv_weights
        linear = 2 * (on_source * src + (self.decoder_weights - self.cross_kv_weights + head_weights) * tgt)
        scores = self.encoder_layers * src * src + self.decoder_layers * (tgt * tgt + tgt * src)
        return linear.sum(), (4 * self.attention_width * scores).sum()

    def forward(self, source_lengths: torch.Tensor, target_lengths: torch.Tensor, head: bool = True):
        """Forward FLOPs of a batch, summed over its sequences."""
        return sum(self.forward_parts(source_lengths, target_lengths, head))

    def training(
        self, batch: dict, recompute: bool, recompute_head: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(model, hardware) FLOPs of one forward+backward of `batch`, on its device, without a host sync.
        With frozen weights a linear layer's backward is one matmul (its input's gradient), not two; the
        adapters' own FLOPs (rank r) are left out."""
        src = batch["source_mask"].sum(dim=1).to(torch.float64)
        tgt = batch["target_mask"].sum(dim=1).to(torch.float64)
        linear, attention = self.forward_parts(src, tgt)
        model = (2 if self.frozen_weights else 3) * linear + 3 * attention
        hardware = model + self.forward(src, tgt, head=False) if recompute else model
        if recompute_head:
            hardware = hardware + 2 * self.head_weights * tgt.sum()
        return model, hardware


@dataclass(frozen=True)
class CausalFlops:
    block_weights: int  # N: Linear (Conv1D) weights of the blocks
    head_weights: int  # V * d_model
    attention_width: int  # d_attn: num_heads * head_dim
    layers: int
    frozen_weights: bool = False  # --peft lora: backward computes no gradient for the (frozen) weights

    @classmethod
    def from_config(cls, config: PretrainedConfig, frozen_weights: bool = False) -> "CausalFlops | None":
        """The count of a Llama-style or GPT-2 model (see the module's docstring); None for any other."""
        if config.model_type in LLAMA_STYLE_MODELS:
            d_model, heads = config.hidden_size, config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or d_model // heads
            width, kv_width = heads * head_dim, config.num_key_value_heads * head_dim
            per_layer = 2 * d_model * width + 2 * d_model * kv_width + 3 * d_model * config.intermediate_size
            layers = config.num_hidden_layers
        elif config.model_type in GPT2_STYLE_MODELS:
            d_model = width = config.n_embd
            per_layer = 4 * d_model * d_model + 2 * d_model * (config.n_inner or 4 * d_model)
            layers = config.n_layer
        else:
            return None
        return cls(
            block_weights=layers * per_layer,
            head_weights=config.vocab_size * d_model,
            attention_width=width,
            layers=layers,
            frozen_weights=frozen_weights,
        )

    def forward_parts(self, tokens: torch.Tensor, attended: torch.Tensor, head: bool = True):
        """(linear layers, attention scores and mixing) forward FLOPs of `tokens` real tokens that attend to
        `attended` (query, key) pairs in all (float64)."""
        linear = 2 * (self.block_weights + (self.head_weights if head else 0)) * tokens
        return linear, 4 * self.attention_width * self.layers * attended

    def training(
        self, batch: dict, recompute: bool, recompute_head: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(model, hardware) FLOPs of one forward+backward of `batch`, as Seq2SeqFlops.training counts them."""
        tokens, attended = attended_pairs(batch)
        linear, attention = self.forward_parts(tokens, attended)
        model = (2 if self.frozen_weights else 3) * linear + 3 * attention
        hardware = model + sum(self.forward_parts(tokens, attended, head=False)) if recompute else model
        if recompute_head:
            hardware = hardware + 2 * self.head_weights * tokens
        return model, hardware


def attended_pairs(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(real tokens, the (query, key) pairs a causal model attends to) of a decoder-only batch, float64 on its
    device, without a host sync: a token at position p of its document attends to p + 1 keys. A packed block's
    position ids restart at each of its documents (causal_lm_dataset.py; a wrapped block is one document); a row
    without them is one document, counted from its first real token."""
    mask = batch["attention_mask"]
    positions = batch["position_ids"] if "position_ids" in batch else mask.cumsum(dim=1) - 1
    real = mask.to(torch.float64)
    return real.sum(), ((positions + 1) * real).sum()


def recomputes_blocks(fsdp_config: FSDPConfig) -> bool:
    """Whether backward runs the blocks' forward a second time (hardware FLOPs): whole-block activation
    checkpointing does; per op (--activation_checkpointing_scope ops) the matmuls' and attention kernels' outputs
    are kept, and only elementwise ops run again, a rounding error like the norms."""
    return fsdp_config.fsdp_activation_checkpointing and fsdp_config.activation_checkpointing_scope == "blocks"


# Dense (no sparsity) peak TFLOP/s per GPU by compute dtype, from the vendors' data sheets (SXM parts;
# fp32 without TF32: --tf32 false, torch's default). The first name contained in torch.cuda.get_device_name()
# wins, so the more specific names come first.
GPU_PEAK_TFLOPS = {
    "H200 NVL": {torch.bfloat16: 835.5, torch.float16: 835.5, torch.float32: 60.0},
    "H200": {torch.bfloat16: 989.4, torch.float16: 989.4, torch.float32: 66.9},
    "H100 NVL": {torch.bfloat16: 835.5, torch.float16: 835.5, torch.float32: 60.0},
    "H100 PCIe": {torch.bfloat16: 756.5, torch.float16: 756.5, torch.float32: 51.2},
    "H100": {torch.bfloat16: 989.4, torch.float16: 989.4, torch.float32: 66.9},
    "A100": {torch.bfloat16: 312.0, torch.float16: 312.0, torch.float32: 19.5},
    "L40S": {torch.bfloat16: 362.1, torch.float16: 362.1, torch.float32: 91.6},
    "L40": {torch.bfloat16: 181.0, torch.float16: 181.0, torch.float32: 90.5},
    "L4": {torch.bfloat16: 121.0, torch.float16: 121.0, torch.float32: 30.3},
    "V100": {torch.float16: 125.0, torch.float32: 15.7},
}


def gpu_peak_flops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """The table's peak FLOP/s for this GPU and dtype; None for a GPU or dtype it does not know. fp32 with
    `tf32` (its matmuls on TF32 tensor cores): half the bf16 peak, TF32's dense rate on the Ampere, Ada and
    Hopper data sheets; a GPU without bf16 (a V100) has no TF32 either, and keeps its fp32 peak."""
    bf16 = gpu_peak_flops(device_name, torch.bfloat16) if tf32 and dtype == torch.float32 else None
    if bf16 is not None:
        return bf16 / 2
    for name, peaks in GPU_PEAK_TFLOPS.items():
        if name in device_name:
            peak = peaks.get(dtype)
            return None if peak is None else peak * 1e12
    return None


def cpu_gemm_flops(dtype: torch.dtype, sizes: tuple[int, ...] = (128, 256, 512), repeats: int = 5) -> float:
    """Measured FLOP/s of square matmuls in `dtype` with this process's threads, the fastest of `sizes`. A CPU
    has no data-sheet peak that torch reaches, so this probe stands in for one. Several sizes, since the
    fastest one depends on the CPU and the dtype: without native bf16 (AVX512-BF16, AMX) a bf16 matmul of 512
    runs at a third of one of 128, and a probe of 512 alone put a tiny model's MFU above 1. Each size: the best
    of `repeats` after a warm-up."""
    best = 0.0
    for size in sizes:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        a @ b  # warm-up: thread pool, kernel selection
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


@dataclass(frozen=True)
class Throughput:
    """How a step's FLOPs are counted (`flops`, None for a model of no counted family: no FLOP rates;
    `recompute`: the blocks' forward run again, recomputes_blocks; `recompute_head`: --loss_chunk_tokens) and
    rated: per device over `world_size` ranks, and as MFU against `peak_flops` per device (None: no MFU), which
    comes from `peak_source`."""

    flops: FlopCounter | None
    recompute: bool
    world_size: int
    peak_flops: float | None
    peak_source: str = ""
    recompute_head: bool = False

    def rates(self, model_flops: float, hardware_flops: float, seconds: float) -> dict:
        """Record fields for FLOPs summed over all ranks in `seconds` of wall time; none without a count."""
        if self.flops is None:  # the steps' FLOPs are zeros, which no rate should report
            return {}
        device_seconds = max(seconds, 1e-9) * self.world_size
        rates = {
            "model_tflops_per_s": model_flops / device_seconds / 1e12,
            "hardware_tflops_per_s": hardware_flops / device_seconds / 1e12,
        }
        if self.peak_flops:
            rates["mfu"] = model_flops / device_seconds / self.peak_flops
        return rates


def device_peak_flops(
    device: torch.device, dtype: torch.dtype, override_tflops: float, tf32: bool = False
) -> tuple[float | None, str]:
    """(peak FLOP/s of one device in `dtype`, where it comes from; fp32 matmuls in TF32 with `tf32`).
    Collective on CPU: every rank probes at once, as they train at once, and the mean is used."""
    if override_tflops:
        return override_tflops * 1e12, "--peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name, dtype, tf32)
        sheet = f"data sheet of {name}" + (", TF32" if peak != gpu_peak_flops(name, dtype) else "")
        return peak, (sheet if peak else f"{name} is not in the peak table: give --peak_tflops")
    probe = torch.tensor(cpu_gemm_flops(dtype), dtype=torch.float64)
    torch.distributed.all_reduce(probe)
    threads = torch.get_num_threads()
    mean = probe.item() / torch.distributed.get_world_size()
    return mean, f"a {str(dtype).removeprefix('torch.')} GEMM measured on {threads} thread(s) per rank"
