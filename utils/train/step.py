"""One training step and one validation pass. Losses are true token means over every rank.

The tutorial summed per-batch mean losses and divided by `len(batch)`, the number of keys of the batch
dict (4), and trained on padding (docs/pitfalls.md #7, #8). Here each rank sums the cross-entropy of its
non-padding target tokens and counts them; the sums and counts are all-reduced, and the loss is their
ratio. The gradient is that of the same global token mean.
"""

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from summarization_dataset import labels_for_loss

# Columns of the per-step statistics kept on the device until the next flush.
LOSS_SUM, TARGET_TOKENS, INPUT_TOKENS, SAMPLES = range(4)
STAT_COLUMNS = 4
STAT_DTYPE = torch.float64  # exact token counts and accurate loss sums for long epochs


def move_batch(batch: dict, device: torch.device) -> dict:
    # non_blocking lets the host-to-GPU copy of pinned memory overlap with compute; a no-op on CPU.
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def forward_token_losses(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy (float32, 0 at padding) and the labels, for a batch already on the device."""
    labels = labels_for_loss(batch["target_ids"], batch["target_mask"])
    # T5 builds decoder inputs by shifting `labels` right (pad as start token; -100 becomes pad). Its own
    # `loss` output is recomputed below in float32 as a sum, so that ranks can be combined exactly.
    logits = model(input_ids=batch["source_ids"], attention_mask=batch["source_mask"], labels=labels).logits
    token_losses = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none"
    ).view_as(labels)
    return token_losses, labels


def batch_stats(token_losses: torch.Tensor, labels: torch.Tensor, batch: dict) -> torch.Tensor:
    """[loss sum, target tokens, source+target tokens, samples] of one batch, on the device, no host sync."""
    stats = torch.stack(
        [
            token_losses.detach().sum(dtype=STAT_DTYPE),
            (labels != -100).sum().to(STAT_DTYPE),
            (batch["source_mask"].sum() + batch["target_mask"].sum()).to(STAT_DTYPE),
            torch.tensor(labels.shape[0], dtype=STAT_DTYPE, device=labels.device),
        ]
    )
    return stats


def train_step(model: nn.Module, batch: dict, optimizer: torch.optim.Optimizer, scaler, world_size: int):
    """One optimizer step on the global token-mean loss. Returns this rank's batch_stats.

    FSDP averages gradients over ranks, so the local loss is scaled by world_size / global token count:
    the averaged gradient is then exactly that of (sum of all ranks' token losses) / (all ranks' tokens).
    Collective: the token count is all-reduced (one scalar, no host sync).
    """
    token_losses, labels = forward_token_losses(model, batch)
    global_tokens = (labels != -100).sum().to(torch.float32)
    dist.all_reduce(global_tokens)
    loss = token_losses.sum() * world_size / global_tokens.clamp(min=1)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return batch_stats(token_losses, labels, batch)


@torch.no_grad()
def validate(model: nn.Module, loader: Iterable, *, device: torch.device, num_real_samples: int, progress: tqdm):
    """Token-mean validation loss over the real samples of every rank.

    The evaluation sampler pads each rank's share with repeated samples so that every rank runs the same
    number of forward passes (FSDP's all-gathers are collectives). Rows past this rank's
    `num_real_samples` are those repeats: they run, but are masked out of the sums, so the loss is not
    biased by duplicates (docs/pitfalls.md #14). One all-reduce and one host sync at the end.
    """
    model.eval()
    sums = torch.zeros(2, dtype=STAT_DTYPE, device=device)  # loss sum, target tokens
    position = 0
    for batch in loader:
        batch = move_batch(batch, device)
        token_losses, labels = forward_token_losses(model, batch)
        rows = labels.shape[0]
        is_real = (torch.arange(position, position + rows, device=device) < num_real_samples).to(STAT_DTYPE)
        position += rows
        sums[0] += (token_losses.sum(dim=1, dtype=STAT_DTYPE) * is_real).sum()
        sums[1] += ((labels != -100).sum(dim=1).to(STAT_DTYPE) * is_real).sum()
        progress.update(1)
    dist.all_reduce(sums)
    loss_sum, tokens = sums.tolist()
    return loss_sum / max(tokens, 1.0)
