"""What training updates and a checkpoint restores: the wrapped model, its optimizer, LR schedule and
gradient scaler, built together so that the trainer and the checkpointer share the same objects."""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, StepLR

from configs.training import TrainConfig
from policies.mixed_precision import needs_grad_scaler


@dataclass
class Trainables:
    model: nn.Module  # FSDP-wrapped
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    scaler: ShardedGradScaler | None  # fp16 only
    per_step_schedule: bool = False  # the scheduler steps after every optimizer step (else after every epoch)


def lr_factor(step: int, schedule: str, warmup: int, total: int) -> float:
    """The multiplier of the base LR after `step` optimizer steps: linear warmup over `warmup` steps, then
    constant, linear to 0 at `total`, or half a cosine to 0 at `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: with weight decay, the matrices decay and the layer norms (and any bias)
    do not, the usual recipe. Grouped by name, which both backends keep (FSDP1 with use_orig_params, which
    configs/validate.py requires for this). Without weight decay, one group, as the tutorial had."""
    trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]  # LoRA: adapters
    if not weight_decay:
        return [{"params": [param for _, param in trained], "weight_decay": 0.0}]
    decay, no_decay = [], []
    for name, param in trained:
        # T5's norms are *.layer_norm.weight and *.final_layer_norm.weight; it has no biases, and its
        # relative_attention_bias is an embedding matrix, which decays.
        (no_decay if "layer_norm" in name or name.endswith(".bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int) -> LRScheduler:
    """The tutorial's StepLR per epoch, or a per-step schedule over `total_steps` optimizer steps."""
    if config.lr_scheduler == "step":
        return StepLR(optimizer, step_size=1, gamma=config.gamma)
    warmup = config.warmup_steps or round(config.warmup_ratio * total_steps)
    return LambdaLR(optimizer, lambda step: lr_factor(step, config.lr_scheduler, warmup, total_steps))


def build_trainables(
    model: nn.Module, config: TrainConfig, precision: str, device: torch.device, total_steps: int
) -> Trainables:
    """AdamW over the (sharded) parameters, the LR schedule, and a scaler when fp16 needs one.

    Built after wrapping: the optimizer must hold FSDP's sharded parameters, not the original ones.
    `total_steps`: the run's optimizer steps (what linear and cosine schedules decay over).
    """
    # The sharded scaler agrees on inf/NaN across ranks, so every rank skips the same steps.
    scaler = ShardedGradScaler(device=device.type) if needs_grad_scaler(precision) else None
    # --on_nonfinite skip needs the fused kernel, the one that honours a found-inf flag (utils/train/step.py);
    # it rounds differently from the default for-each kernel in the last bit, so it is used only then.
    fused = config.on_nonfinite == "skip" and scaler is None
    optimizer = torch.optim.AdamW(parameter_groups(model, config.weight_decay), lr=config.lr, fused=fused)
    scheduler = build_scheduler(optimizer, config, total_steps)
    return Trainables(model, optimizer, scheduler, scaler, per_step_schedule=config.lr_scheduler != "step")


def total_optimizer_steps(config: TrainConfig, batches_per_epoch: int) -> int:
    """The run's optimizer steps: --max_steps, or every epoch's batches in groups of the accumulation."""
    per_epoch = math.ceil(batches_per_epoch / config.gradient_accumulation_steps)
    return config.max_steps or config.epochs * per_epoch
