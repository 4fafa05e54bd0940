"""What training updates and a checkpoint restores: the wrapped model, its optimizer, LR schedule and
gradient scaler, built together so that the trainer and the checkpointer share the same objects."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim.lr_scheduler import LRScheduler, StepLR

from configs.training import TrainConfig
from policies.mixed_precision import needs_grad_scaler


@dataclass
class Trainables:
    model: nn.Module  # FSDP-wrapped
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    scaler: ShardedGradScaler | None  # fp16 only


def build_trainables(model: nn.Module, config: TrainConfig, precision: str, device: torch.device) -> Trainables:
    """AdamW over the (sharded) parameters, StepLR(gamma) per epoch, and a scaler when fp16 needs one.

    Built after wrapping: the optimizer must hold FSDP's sharded parameters, not the original ones.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = StepLR(optimizer, step_size=1, gamma=config.gamma)
    # The sharded scaler agrees on inf/NaN across ranks, so every rank skips the same steps.
    scaler = ShardedGradScaler(device=device.type) if needs_grad_scaler(precision) else None
    return Trainables(model, optimizer, scheduler, scaler)
