"""The training recipe beyond the tutorial's AdamW + StepLR: gradient accumulation, clipping, the guard against
non-finite steps, per-step LR schedules with warmup, step budgets and early stopping, and the model's attention
kernel and dropout, NEFTune, and the loss computed in chunks (utils/train/, utils/loss.py)."""

from dataclasses import dataclass
from typing import Literal

from configs.options import option


@dataclass
class RecipeConfig:
    gradient_accumulation_steps: int = option(
        default=1,
        help=(
            "Micro-batches per optimizer step. The loss optimised and reported is the token mean over all of "
            "them on all ranks; the effective batch is batch_size_training x K x ranks."
        ),
        minimum=1,
    )
    accumulate_grad_sync: bool = option(
        default=True,
        help=(
            "With gradient_accumulation_steps > 1: reduce gradients after every micro-batch (true: "
            "memory stays one gradient shard) or only after the last (false: FSDP1 no_sync / FSDP2 "
            "set_requires_gradient_sync(False); less communication, but every rank keeps unsharded "
            "gradients of the whole model between micro-batches)."
        ),
    )
    max_grad_norm: float = option(
        default=0.0,
        help=(
            "Clip the global gradient norm (over all shards) to this value before each optimizer step; 0 = "
            "no clipping. The pre-clip norm is recorded in every step record either way."
        ),
        minimum=0,
    )
    on_nonfinite: Literal["stop", "skip"] = option(
        default="stop",
        help=(
            "A step whose loss or gradient norm is NaN or infinite on any rank. stop: the run ends with an "
            "error at the next step-log flush (at most log_every_n_steps steps later, before any checkpoint "
            "or export), keeping what was saved. skip: every rank skips each optimizer step whose global "
            "gradient norm is NaN/Inf (a NaN loss makes it NaN; fused AdamW with a found-inf flag: no host "
            "sync), and the step record says skipped. fp16's gradient scaler skips such steps itself."
        ),
    )
    lr_scheduler: Literal["step", "constant", "linear", "cosine"] = option(
        default="step",
        help=(
            "step: the tutorial's StepLR, lr x gamma after each epoch. constant, linear (to 0) and cosine "
            "(to 0): stepped after every optimizer step over the run's optimizer steps, after warmup. A resume "
            "that changes the run's shape (batch size, ranks, accumulation, --epochs, --max_steps) spreads the "
            "rest of the schedule over the steps it has left (docs/checkpoints.md)."
        ),
        on_resume="fixed",
    )
    warmup_steps: int = option(
        default=0,
        help="Optimizer steps of linear warmup from 0 to lr (constant/linear/cosine schedules).",
        minimum=0,
        on_resume="fixed",
    )
    warmup_ratio: float = option(
        default=0.0,
        help="Warmup as a fraction of the run's optimizer steps, when warmup_steps is 0.",
        minimum=0,
        maximum=1,
        on_resume="fixed",
    )
    max_steps: int = option(
        default=0,
        help=(
            "The run's length in optimizer steps, whatever --epochs says (HF's meaning): as many epochs as it "
            "takes, the last one partial, ending with the validation, evaluation, checkpoint and export of a "
            "normal end; the learning-rate schedule spans them (said at start: N steps = E epochs + k). 0 = "
            "--epochs epochs."
        ),
        minimum=0,
    )
    early_stopping_patience: int = option(
        default=0,
        help=(
            "Stop after this many epochs without a new best --metric_for_best (the run then ends as usual: "
            "checkpoint and export); 0 = never. Counted from the best epoch, so it survives --resume."
        ),
        minimum=0,
    )
    attn_implementation: Literal["sdpa", "eager", "flex_attention", "t5_flex"] = option(
        default="sdpa",
        help=(
            "The attention kernel (transformers' attn_implementation): sdpa (torch's "
            "scaled_dot_product_attention with the position bias as an additive mask; what transformers 5.15+ "
            "picks by default), eager (matmul, softmax, matmul: the reference), flex_attention (torch "
            "FlexAttention; refused for T5, whose bias it indexes wrongly at batch > 1), t5_flex (T5 family: "
            "on a GPU FlexAttention with the position bias as a score_mod and padding as a block mask, no "
            "(batch, heads, query, key) mask; cross-attention with a boolean mask; T5's norms as the fused "
            "F.rms_norm; utils/model/t5_attention.py). "
            "T5's learned position bias rules out flash attention."
        ),
    )
    dropout_rate: float | None = option(
        default=None,
        help=(
            "Override the model config's dropout rate (0 turns dropout off, for exact comparisons); NONE keeps "
            "the model's (0.1 for T5)."
        ),
        minimum=0,
        maximum=1,
    )
    neftune_noise_alpha: float | None = option(
        default=None,
        help=(
            "NEFTune (HF TrainingArguments' and TRL's name): while training, uniform noise in [-b, b] added to "
            "the input embeddings, b = alpha / sqrt(padded length x hidden width), as transformers' hook adds "
            "it (an encoder-decoder's: the encoder's and the decoder's); none in evaluation and generation. "
            "The paper used 5 to 15. NONE or 0: off."
        ),
        minimum=0,
    )
    loss_chunk_tokens: int = option(
        default=0,
        help=(
            "The training and validation cross-entropy computed per chunk of this many tokens (the batch's "
            "positions flattened) inside the model's output head, so that the (tokens x vocabulary) float32 "
            "logits never exist: backward computes one chunk's logits again at a time (one more forward of the "
            "head, counted in the hardware FLOPs). In fp32 on CPU its per-token losses equal the plain loss's "
            "within 1.3e-7 relative and its gradients within 1e-6 of each parameter's largest (measured; "
            "tests/test_chunked_loss.py asserts 1e-6 and 1e-5); generation is unchanged. Refused for a head "
            "LoRA adapts (lm_head in --lora_target_modules) and for models that change their logits after the "
            "head (BART's final_logits_bias, Gemma's soft-capping). E.g. 1024; 0 = off: the whole logits at "
            "once (docs/throughput.md#chunked-cross-entropy---loss_chunk_tokens)."
        ),
        minimum=0,
    )
