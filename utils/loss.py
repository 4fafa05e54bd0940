"""The per-token cross-entropy the step and validation take (utils/spec.py's token_losses): from the model's
whole logits, or chunk by chunk inside its output head (--loss_chunk_tokens), so that the (tokens x
vocabulary) float32 logits never exist.

    chunk_the_loss(model, 1024)                       # once, on the unwrapped model, before FSDP
    losses = token_cross_entropy(model, inputs, targets)

Why inside the model: under FSDP (1 and 2) the head's weight belongs to the root unit (or under FSDP1's
size_based policy to a unit of its own), which gathers it only while that unit's forward runs, so a loss
computed after the forward from the hidden states would find it sharded. chunk_the_loss replaces the head by a
ChunkedLossHead holding the same parameters (the same objects: a tied head stays tied, every name stays, and
with them checkpoints and exports). While token_cross_entropy runs the forward, the head finds the batch's
targets (SCORING) and returns each position's cross-entropy where the logits were, which the model hands on as
its `.logits` (T5 scales the decoder's output before its head, Llama and GPT-2 slice it: both before).
Otherwise it is the plain head: generation and every other forward are untouched.

Each chunk runs under non-reentrant activation checkpointing: the forward keeps the chunk's losses and not its
logits, and backward computes one chunk's logits again at a time (one more forward of the head: hardware
FLOPs, utils/observe/flops.py). In validation (no gradient) the chunks simply run one after the other.
"""

import contextvars
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from configs.errors import ConfigError
from utils.data.loaders import IGNORED

# Where transformers models change their logits after the head (a bias added, a scale, tanh soft-capping): a
# chunked head's losses would skip it. The model's buffer, or its config's field (of any value).
LOGIT_BIAS_BUFFER = "final_logits_bias"  # BART, mBART, PEGASUS, Blenderbot, Marian
LOGIT_CONFIG_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # Gemma 2/3, Cohere, Granite


def position_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of each row of `logits` (positions x vocabulary) against its target, in float32 (0
    where IGNORED): the one loss both the whole logits and each chunk's go through."""
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORED, reduction="none")


def chunk_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> torch.Tensor:
    """The cross-entropy of one chunk's logits."""
    return position_cross_entropy(F.linear(hidden, weight, bias), targets)


@dataclasses.dataclass
class Scoring:
    """The loss being computed: the targets a ChunkedLossHead scores its positions against, and what it
    returned."""

    targets: torch.Tensor
    losses: torch.Tensor | None = None


# Set while token_cross_entropy runs the model's forward; the head reads it wherever FSDP put it (in the root
# unit, or a unit of its own under FSDP1's size_based policy).
SCORING: contextvars.ContextVar[Scoring | None] = contextvars.ContextVar("scoring", default=None)


class ChunkedLossHead(nn.Linear):
    """The model's output head, with the head's own weight and bias: the logits, or while a loss is scored
    (SCORING) each position's cross-entropy against its target, computed `chunk_tokens` flattened positions
    at a time."""

    def __init__(self, head: nn.Linear, chunk_tokens: int):
        # Built on the meta device, then given the head's parameters: nothing is allocated or copied.
        super().__init__(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
        self.weight, self.bias = head.weight, head.bias
        self.train(head.training)
        self.chunk_tokens = chunk_tokens

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scoring = SCORING.get()
        if scoring is None:
            return super().forward(hidden)
        chunks = zip(
            hidden.flatten(0, -2).split(self.chunk_tokens), scoring.targets.flatten().split(self.chunk_tokens),
            strict=True,
        )  # fmt: skip
        if torch.is_grad_enabled():  # backward computes each chunk's logits again, one chunk at a time
            losses = [
                checkpoint(chunk_cross_entropy, part, self.weight, self.bias, targets, use_reentrant=False)
                for part, targets in chunks
            ]
        else:
            losses = [chunk_cross_entropy(part, self.weight, self.bias, targets) for part, targets in chunks]
        scoring.losses = torch.cat(losses).view_as(scoring.targets)
        return scoring.losses

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_tokens={self.chunk_tokens}"


def chunk_the_loss(model: nn.Module, chunk_tokens: int) -> None:
    """Replace `model`'s output head (a plain model's or a PEFT model's base's) by a ChunkedLossHead of
    `chunk_tokens`. ConfigError for a head that is not a linear layer and for a model that changes its logits
    after the head (the chunked losses would leave that out)."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ConfigError(
            f"--loss_chunk_tokens computes the loss inside the model's output head, which here is a "
            f"{type(head).__name__}, not a linear layer: leave --loss_chunk_tokens 0"
        )
    buffers = {name.rsplit(".", 1)[-1] for name, _ in model.named_buffers()}
    changes = [LOGIT_BIAS_BUFFER] if LOGIT_BIAS_BUFFER in buffers else []
    changes += [field for field in LOGIT_CONFIG_FIELDS if getattr(model.config, field, None) is not None]
    if changes:
        raise ConfigError(
            f"--loss_chunk_tokens: a {model.config.model_type} model changes its logits after its output head "
            f"({', '.join(changes)}), which a loss computed inside the head would leave out: leave "
            "--loss_chunk_tokens 0 for it"
        )
    model.set_output_embeddings(ChunkedLossHead(head, chunk_tokens))


def token_cross_entropy(model: nn.Module, inputs: dict, targets: torch.Tensor) -> torch.Tensor:
    """Each position's cross-entropy (float32, 0 where its target is IGNORED) of `model`'s logits for `inputs`
    against `targets` (one per position of the logits): inside its head, chunk by chunk, where chunk_the_loss
    replaced it, else from the whole logits."""
    scoring = Scoring(targets)
    token = SCORING.set(scoring)
    try:
        output = model(**inputs).logits
    finally:
        SCORING.reset(token)
    if scoring.losses is None:  # the plain head: the whole logits
        return position_cross_entropy(output.flatten(0, 1), targets.flatten()).view_as(targets)
    if output is not scoring.losses:  # a family chunk_the_loss does not know changed its head's output
        raise ConfigError(
            f"--loss_chunk_tokens: a {model.config.model_type} model changes its output head's logits before "
            "it returns them, which a loss computed inside the head would leave out: leave "
            "--loss_chunk_tokens 0 for it"
        )
    return output
