"""`--attn_implementation t5_flex`: T5's attention without a (batch, heads, query, key) float mask.

transformers' `sdpa` path for T5 builds, in every attention call of every layer, `where(mask, position_bias,
min)`: a float tensor of (batch, heads, query, key) that is kept for backward (0.5 GiB per encoder layer for
t5-large at batch 64, 512 tokens, bf16) and that rules out SDPA's flash kernel; its cross-attention adds a
bias of zeros the same way. This path, registered with transformers under the name `t5_flex` (its attention
and mask interfaces), keeps T5's modules, parameter names and numbers:

- self-attention over a whole sequence on a GPU (the encoder; the decoder in training and validation): torch's
  FlexAttention, compiled, the position bias of the stack (computed once by its first layer, batch 1) added
  as a `score_mod` and the padding (and causality) as a block mask, so no score or mask tensor is kept;
- cross-attention: no position bias (T5 has none there), so SDPA with the boolean padding mask alone;
- elsewhere (a CPU, generation's one-token steps, attention dropout in training, which FlexAttention does
  not have): SDPA with the float mask, as transformers' `sdpa` computes it;
- T5's RMS norms as torch's fused `F.rms_norm` (`fuse_norms`; on CPU the same numbers in float32).

transformers' own `flex_attention` indexes the batch-1 bias with the batch index (wrong at batch > 1),
which is why `validate_family` refuses it for T5 models.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import (
    AttentionMaskInterface,
    bidirectional_mask_function,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)
from transformers.models.mt5.modeling_mt5 import MT5LayerNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from configs.errors import ConfigError

NAME = "t5_flex"
T5_FAMILY = ("t5", "mt5")  # model types whose attention is T5Attention: one position bias per stack
BATCH_ONE_BIAS = (*T5_FAMILY, "umt5")  # whose bias transformers' flex_attention indexes with the batch index
FLEX_MIN_LENGTH = 16  # below this (generation's first steps) SDPA is as fast, and no compile is paid
# Compiled variants FlexAttention may need in one run: encoder and decoder, with and without gradients, each
# static then dynamic in its lengths. Past dynamo's default (8) torch would fall back to uncompiled
# FlexAttention, which materialises the scores this path exists to avoid.
FLEX_RECOMPILE_LIMIT = 64
# The forward kernel's tile (query x key rows). torch 2.11's default tile for 64-wide heads ran T5-large's
# encoder self-attention (batch 64, 512 tokens, bf16, H100) in 2.97 ms, this one in 0.30 ms; the backward
# keeps torch's choice (smaller tiles made it slower). docs/throughput.md has the measurement. Used where it
# was measured (16-bit, heads up to 64 wide, 128 queries or more); elsewhere torch's own choice: fp32 or
# 128-wide heads (t5-3b, t5-11b) need other shared memory, and shorter queries take torch's decoding kernel.
FLEX_FORWARD_TILE = {"BLOCK_M": 64, "BLOCK_N": 64}
FLEX_TILE_MIN_QUERIES = 128


class T5Mask:
    """What the stack hands every layer instead of a 4D mask: the boolean (batch, 1, query, key) mask SDPA
    takes, and the padding a block mask is built from, once per stack and forward (cached here). A plain
    class, not a dataclass: FSDP2 rebuilds dataclasses it finds in a block's inputs, which would drop the
    cache."""

    def __init__(self, allowed: torch.Tensor, keys: torch.Tensor | None, whole: bool):
        self.allowed = allowed  # bool (batch, 1, query, key): True where a query may attend
        self.keys = keys  # bool (batch, key): the padding mask, None where none was given
        self.whole = whole  # the queries start at position 0 (no cache before them)
        self.block_mask = None  # built by the stack's first layer that runs FlexAttention


def t5_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> T5Mask:
    """The mask interface of `t5_flex`: transformers' boolean SDPA mask, never skipped (skipping it asks the
    GPU whether anything is padded, a host sync per stack), with the padding a block mask needs."""
    if mask_function not in (causal_mask_function, bidirectional_mask_function):
        raise ConfigError(
            f"--attn_implementation {NAME} takes T5's causal and bidirectional masks only (this model's forward "
            "asked for another: packed sequences or an added mask function); use sdpa"
        )
    for skip in ("allow_is_causal_skip", "allow_is_bidirectional_skip"):
        kwargs[skip] = False
    allowed = sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=mask_function, attention_mask=attention_mask, **kwargs,
    )  # fmt: skip
    whole = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0
    keys = prepare_padding_mask(attention_mask, kv_length, kv_offset) if whole else None
    if keys is not None and keys.shape[-1] != kv_length:
        raise ConfigError(f"{NAME}: a padding mask of {keys.shape[-1]} positions for {kv_length} keys")
    return T5Mask(allowed=allowed, keys=keys, whole=whole)


def t5_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: T5Mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    **_kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention interface of `t5_flex` (transformers calls it from T5Attention.forward): (batch, query,
    heads, head_dim) out, no weights. Which attention this is comes from the module: T5's cross-attention is
    the decoder's non-causal one."""
    mask = attention_mask
    if not isinstance(mask, T5Mask):
        raise ConfigError(
            f"--attn_implementation {NAME} builds its own masks; this forward passed a prepared one "
            f"({type(mask).__name__}): use sdpa"
        )
    if module.is_decoder and not module.is_causal:  # cross-attention: T5 adds no bias there (zeros)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask.allowed, dropout_p=dropout,
                                             scale=scaling)  # fmt: skip
    elif uses_flex(query, key, mask, dropout):
        block_mask = block_mask_of(mask, module.is_causal, query)
        out = flex_self_attention(query, key, value, position_bias, block_mask, scaling)
    else:
        where = torch.where(mask.allowed, position_bias, torch.finfo(query.dtype).min)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=where, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def uses_flex(query: torch.Tensor, key: torch.Tensor, mask: T5Mask, dropout: float) -> bool:
    """FlexAttention for self-attention over a whole sequence on a GPU, where no attention dropout is asked."""
    length = query.shape[-2]
    return flex_device(query) and dropout == 0.0 and mask.whole and length == key.shape[-2] and (
        length >= FLEX_MIN_LENGTH)  # fmt: skip


def flex_device(query: torch.Tensor) -> bool:
    """A device FlexAttention trains on: CUDA (on CPU it has no backward, and torch 2.13 cannot compile it)."""
    return query.is_cuda


def block_mask_of(mask: T5Mask, causal: bool, query: torch.Tensor):
    """The stack's block mask (padding, causality), built by its first layer and reused by the others."""
    if mask.keys is None and not causal:
        return None
    if mask.block_mask is None:
        mask.block_mask = build_block_mask(mask.keys, causal, query.shape[0], query.shape[-2], query.device)
    return mask.block_mask


def build_block_mask(keys: torch.Tensor | None, causal: bool, batch: int, length: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def allowed(b, h, q, k):  # noqa: ARG001 - FlexAttention's mask_mod signature: one mask for all heads
        visible = k <= q if causal else k >= 0
        return visible & keys[b, k] if keys is not None else visible

    return create_block_mask(allowed, batch if keys is not None else None, None, length, length, device=device)


def flex_self_attention(query, key, value, position_bias, block_mask, scaling) -> torch.Tensor:
    """FlexAttention with the stack's batch-1 position bias added to every batch row's scores."""
    bias = position_bias[0]  # (heads, query, key): the same for every row of the batch

    def add_bias(score, b, h, q, k):  # noqa: ARG001 - FlexAttention's score_mod: one bias for every row
        return score + bias[h, q, k]

    return flex_kernel()(query, key, value, score_mod=add_bias, block_mask=block_mask, scale=scaling,
                         kernel_options=forward_tile(query))  # fmt: skip


def forward_tile(query: torch.Tensor) -> dict | None:
    """FLEX_FORWARD_TILE where it was measured to help, else None (torch's choice)."""
    measured = query.dtype in (torch.bfloat16, torch.float16) and query.shape[-1] <= 64
    return FLEX_FORWARD_TILE if measured and query.shape[-2] >= FLEX_TILE_MIN_QUERIES else None


def flex_kernel():
    """FlexAttention as it runs fast: compiled once per process; inside a region torch.compile is already
    tracing (--compile true), the plain function, which that compile fuses."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention if torch.compiler.is_compiling() else compiled_flex()


@functools.cache
def compiled_flex():
    """FlexAttention compiled (uncompiled it materialises the scores: a reference only)."""
    from torch.nn.attention.flex_attention import flex_attention

    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, FLEX_RECOMPILE_LIMIT)
    return torch.compile(flex_attention)


def fuse_norms(model: nn.Module) -> int:
    """T5's RMS norms computed by torch's `F.rms_norm`: one fused kernel instead of T5's seven (square, mean,
    add, rsqrt, two multiplies and a cast, with float32 intermediates), in each of a block's two or three norms.
    On CPU it equals T5's bit for bit in float32 (forward and gradients); on a GPU its kernel sums in another
    order (last bits), and in bf16 or fp16 it rounds once where T5 rounds the normalised value and then its
    product with the weight. Input and weight of different dtypes have no fused kernel: T5's own forward
    then. Each norm keeps its class as a base (isinstance, weight names and initialisation are T5's).
    Returns how many norms it changed."""
    norms = [module for module in model.modules() if type(module) in FUSED_NORMS]
    for norm in norms:
        norm.__class__ = FUSED_NORMS[type(norm)]
    return len(norms)


def fused_norm_class(norm_class: type) -> type:
    """`norm_class` with F.rms_norm as its forward, named Fused<name> in this module (so a model pickles)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:
            return norm_class.forward(self, hidden_states)
        return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon)

    name = f"Fused{norm_class.__name__}"
    return type(name, (norm_class,), {"forward": forward, "__module__": __name__, "__qualname__": name})


FusedT5LayerNorm = fused_norm_class(T5LayerNorm)
FusedMT5LayerNorm = fused_norm_class(MT5LayerNorm)  # mT5's copy of T5's norm
FUSED_NORMS = {T5LayerNorm: FusedT5LayerNorm, MT5LayerNorm: FusedMT5LayerNorm}


def register() -> None:
    """Make `t5_flex` a name transformers accepts as attn_implementation (idempotent)."""
    AttentionInterface.register(NAME, t5_attention)
    AttentionMaskInterface.register(NAME, t5_mask)


def validate_family(model_type: str, attn_implementation: str) -> None:
    """ConfigError where the kernel does not fit the model family (called with the model's config)."""
    if attn_implementation == NAME and model_type not in T5_FAMILY:
        raise ConfigError(
            f"--attn_implementation {NAME} is written and checked for T5Attention (T5, flan-t5, mT5), not for a "
            f"{model_type} model: use sdpa (the default)."
        )
    if attn_implementation == "flex_attention" and model_type in BATCH_ONE_BIAS:
        raise ConfigError(
            f"--attn_implementation flex_attention gives a {model_type} model wrong scores at batch > 1 "
            "(transformers indexes its batch-1 position bias with the batch index): use sdpa"
            + (
                f", or --attn_implementation {NAME}, which runs FlexAttention with the bias done right."
                if model_type in T5_FAMILY
                else "."
            )  # fmt: skip
        )
