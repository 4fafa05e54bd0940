"""One training step and one validation pass. Losses are true token means over every rank.

The tutorial summed per-batch mean losses and divided by `len(batch)`, the number of keys of the batch
dict (4), and trained on padding (docs/pitfalls.md #7, #8). Here each rank sums the cross-entropy of its
non-padding target tokens and counts them; the sums and counts are all-reduced, and the loss is their
ratio. The gradient is that of the same global token mean. How a batch becomes token losses is the model
spec's (utils/spec.py).
"""

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from policies.private_api import skip_next_step_if
from utils.base.log import ProgressLines
from utils.data.loaders import IGNORED, move_batch
from utils.distributed.hang_report import WHERE
from utils.distributed.process_group import StopCheck
from utils.fsdp.parallelism import Parallelism
from utils.observe.flops import FlopCounter
from utils.observe.memory import SavedTensorCounter
from utils.spec import ModelSpec

# Columns of the per-step statistics kept on the device until the next flush. GRAD_NORM holds the global
# norm divided by the world size: the flush sums over ranks, and every rank has the same global norm.
# MODEL_FLOPS / HARDWARE_FLOPS: this rank's training FLOPs from its real token counts (utils/observe/flops.py).
LOSS_SUM, TARGET_TOKENS, INPUT_TOKENS, SAMPLES, GRAD_NORM, MODEL_FLOPS, HARDWARE_FLOPS = range(7)
STAT_COLUMNS = 7
STAT_DTYPE = torch.float64  # exact token counts and accurate loss sums for long epochs


@dataclass(frozen=True)
class StepSettings:
    parallelism: Parallelism  # how the model is spread: gradient sync under accumulation, clipping
    max_grad_norm: float = 0.0  # 0: no clipping (the norm is still measured)
    sync_each_micro_batch: bool = True  # False: reduce gradients after the last micro-batch only
    skip_nonfinite: bool = False  # skip the update when the global gradient norm is NaN/Inf (fused AdamW)
    flops: FlopCounter | None = None  # counts each batch's training FLOPs (None: zeros)
    recompute: bool = False  # activation checkpointing: hardware FLOPs include the blocks' second forward
    recompute_head: bool = False  # --loss_chunk_tokens: hardware FLOPs include the head's second forward
    saved_counter: SavedTensorCounter | None = None  # counts what the first micro-batch saves for backward
    spec: ModelSpec = field(kw_only=True)  # how a batch becomes token losses (utils/spec.py)


def batch_stats(token_losses: torch.Tensor, labels: torch.Tensor, batch: dict, settings: StepSettings):
    """[loss sum, target tokens, source+target tokens, samples, 0, model FLOPs, hardware FLOPs] of one
    batch, on the device, no host sync (column GRAD_NORM is the step's, filled in by train_step)."""
    zero = torch.zeros((), dtype=STAT_DTYPE, device=labels.device)
    if settings.flops:
        flops = settings.flops.training(batch, settings.recompute, recompute_head=settings.recompute_head)
    else:
        flops = (zero, zero)
    stats = torch.stack(
        [
            token_losses.detach().sum(dtype=STAT_DTYPE),
            (labels != IGNORED).sum().to(STAT_DTYPE),
            settings.spec.read_tokens(batch).to(STAT_DTYPE),
            torch.full((), labels.shape[0], dtype=STAT_DTYPE, device=labels.device),  # not torch.tensor: a copy
            zero,
            *flops,
        ]
    )
    return stats


def train_step(
    model: nn.Module,
    micro_batches: dict | list[dict],
    optimizer: torch.optim.Optimizer,
    scaler,
    world_size: int,
    settings: StepSettings,
) -> torch.Tensor:
    """One optimizer step on the global token-mean loss of one batch or of several accumulated micro-batches.
    Returns this rank's statistics (see batch_stats), with the step's pre-clip global gradient norm.

    FSDP averages gradients over ranks, so each micro-batch's summed loss is scaled by world_size / the
    token count of all micro-batches of all ranks: the accumulated, averaged gradient is then exactly that
    of (sum of every token loss) / (every token), not a mean of means. Collective: the token count is
    all-reduced once per step (one scalar, no host sync), before the first forward.
    """
    micro_batches = micro_batches if isinstance(micro_batches, list) else [micro_batches]
    global_tokens = sum(settings.spec.trained_tokens(batch) for batch in micro_batches).to(torch.float32)
    dist.all_reduce(global_tokens)
    stats = []
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        counting = settings.saved_counter if index == 0 and settings.saved_counter else contextlib.nullcontext()
        with settings.parallelism.gradient_sync(model, last or settings.sync_each_micro_batch), counting:
            WHERE.enter("forward")  # where a hang report says the rank was (utils/distributed/hang_report.py)
            token_losses, labels = settings.spec.token_losses(model, batch)
            loss = token_losses.sum() * world_size / global_tokens.clamp(min=1)
            WHERE.enter("backward")
            (scaler.scale(loss) if scaler is not None else loss).backward()
        stats.append(batch_stats(token_losses, labels, batch, settings))
    WHERE.enter("gradient norm and clipping")
    grad_norm = clip_gradients(model, optimizer, scaler, settings.max_grad_norm, settings.parallelism)
    if settings.skip_nonfinite and scaler is None:
        flag_nonfinite_step(optimizer, grad_norm)
    WHERE.enter("optimizer step")
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = torch.stack(stats).sum(dim=0)
    total[GRAD_NORM] = grad_norm.to(STAT_DTYPE) / world_size
    return total


def flag_nonfinite_step(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
    """Make the coming optimizer.step() a no-op when the global gradient norm is NaN or infinite.

    Fused AdamW then leaves parameters, moments and step count as they were (policies/private_api.py). The
    norm is the same on every rank, so every rank skips the same steps; a non-finite loss on any rank makes
    its gradients, and so the norm, non-finite.
    """
    skip_next_step_if(optimizer, (~torch.isfinite(grad_norm)).to(torch.float32))


def clip_gradients(model: nn.Module, optimizer, scaler, max_norm: float, parallelism: Parallelism) -> torch.Tensor:
    """The global gradient norm over every shard, before clipping; clips to max_norm when it is set.
    Collective. With fp16 the gradients are unscaled first, so the norm is the true one."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    limit = max_norm if max_norm > 0 else math.inf  # inf: measure only (grads x 1.0, bit for bit unchanged)
    return parallelism.clip_grad_norm(model, limit)


@torch.no_grad()
def validate(
    model: nn.Module,
    loader: Iterable,
    *,
    device: torch.device,
    num_real_samples: int,
    progress: "tqdm | ProgressLines",
    stop_requested: Callable[[], bool] | None = None,
    spec: ModelSpec,
):
    """Token-mean validation loss over the real samples of every rank.

    The evaluation sampler pads each rank's share with repeated samples so that every rank runs the same
    number of forward passes (FSDP's all-gathers are collectives). Rows past this rank's
    `num_real_samples` are those repeats: they run, but are masked out of the sums, so the loss is not
    biased by duplicates (docs/pitfalls.md #14). One all-reduce and one host sync at the end. With
    `stop_requested`, every rank abandons the pass within two batches once it is true on any (StopAgreed;
    the flag is read a batch late, so the host never waits for the batch it just queued). `spec`: how a
    batch becomes token losses.
    """
    WHERE.enter("validation")
    model.eval()
    sums = torch.zeros(2, dtype=STAT_DTYPE, device=device)  # loss sum, target tokens
    position = 0
    check_stop = StopCheck(stop_requested, device)
    for batch in loader:
        check_stop()
        batch = move_batch(batch, device)
        token_losses, labels = spec.token_losses(model, batch)
        rows = labels.shape[0]
        is_real = (torch.arange(position, position + rows, device=device) < num_real_samples).to(STAT_DTYPE)
        position += rows
        sums[0] += (token_losses.sum(dim=1, dtype=STAT_DTYPE) * is_real).sum()
        sums[1] += ((labels != IGNORED).sum(dim=1).to(STAT_DTYPE) * is_real).sum()
        progress.update(1)
    dist.all_reduce(sums)
    loss_sum, tokens = sums.tolist()
    return loss_sum / tokens if tokens else math.nan  # no token scored: no loss to report, nor a best model
