"""AdamW's parameter groups and the LR schedules; T5_training.py builds the optimizer with them."""

import math
import os

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, StepLR

from configs.errors import ConfigError
from configs.recipe import RecipeConfig


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


def uses_fused_adamw(device_type: str, on_nonfinite: str, has_grad_scaler: bool) -> bool:
    """AdamW's fused kernel on a GPU (fewer, larger kernels than the for-each one), and wherever --on_nonfinite
    skip needs it (it is the kernel that honours a found-inf flag: utils/train/step.py), parameters offloaded
    to the CPU included. On a CPU otherwise the for-each kernel: the fused one rounds differently in the last
    bit, which the exact comparisons against an unsharded reference would see. Not with fp16's gradient
    scaler, which skips non-finite steps itself and has not run with the fused kernel here."""
    return not has_grad_scaler and (device_type == "cuda" or on_nonfinite == "skip")


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups: with weight decay, the matrices decay and the norms' weights and every bias
    do not, the usual recipe. Grouped by name, which both backends keep (FSDP1 with use_orig_params, which
    configs/validate.py requires for this). Without weight decay, one group, as the tutorial had."""
    trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]  # LoRA: adapters
    if not weight_decay:
        return [{"params": [param for _, param in trained], "weight_decay": 0.0}]
    # A norm is known by its module, not its name: T5's layer_norm, BART's layernorm_embedding and
    # self_attn_layer_norm, Llama's input_layernorm and norm. T5's relative_attention_bias is an embedding
    # matrix, which decays.
    norms = {prefix for prefix, module in model.named_modules() if is_norm(module)}
    decay, no_decay = [], []
    for name, param in trained:
        owner, _, leaf = name.rpartition(".")
        (no_decay if owner in norms or leaf == "bias" else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def is_norm(module: nn.Module) -> bool:
    """torch's normalisation layers, and the models' own (T5LayerNorm, MT5LayerNorm, LlamaRMSNorm, ...)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)) or type(module).__name__.endswith("Norm")


def lr_scheduler(
    optimizer: torch.optim.Optimizer, gamma: float, recipe: RecipeConfig, total_steps: int
) -> LRScheduler:
    """The tutorial's StepLR (lr x gamma after each epoch), or a per-step schedule (--lr_scheduler constant,
    linear, cosine) with warmup over `total_steps` optimizer steps (a `StretchableSchedule`)."""
    if recipe.lr_scheduler == "step":
        return StepLR(optimizer, step_size=1, gamma=gamma)
    warmup = recipe.warmup_steps or round(recipe.warmup_ratio * total_steps)
    return LambdaLR(optimizer, StretchableSchedule(recipe.lr_scheduler, warmup, total_steps))


def continue_schedule(scheduler: LRScheduler, step: int, end_step: int, output_dir: str) -> str | None:
    """A per-step schedule at `step` of a run (in `output_dir`) that ends at `end_step`
    (StretchableSchedule.continue_to): what changed, or None. The tutorial's StepLR counts epochs, which a run's
    shape does not change."""
    schedule = getattr(scheduler, "lr_lambdas", [None])[0]  # LambdaLR's: one object for every group
    return schedule.continue_to(step, end_step, output_dir) if isinstance(schedule, StretchableSchedule) else None


class StretchableSchedule:
    """A per-step schedule's LR multiplier by optimizer step, LambdaLR's function: warmup then constant,
    linear or cosine over `total` positions, the optimizer steps of the run's first shape (global batch and
    length).

    Optimizer step `step` is at position `anchor_position + (step - anchor_step) * pace`, where the pace
    spreads what is left of the schedule after the anchor over the steps left until `end_step`. A run
    that keeps its shape advances one position a step (`end_step = total`, anchor 0). A resume that changes it
    (another batch size, number of ranks, accumulation, --epochs or --max_steps) re-anchors at its step
    (`continue_to`), so the rate goes on from where it was, an unfinished warmup is stretched, not repeated,
    and linear and cosine reach 0 after the last step (docs/checkpoints.md). LambdaLR's state dict carries
    this object's fields, so every checkpoint records where the schedule stands. `stretches` is False for a
    run resumed from a checkpoint written before the schedule was recorded: it keeps the counting it had."""

    def __init__(self, kind: str, warmup: int, total: int):
        self.kind, self.warmup, self.total = kind, warmup, total
        self.anchor_step, self.anchor_position, self.end_step = 0, 0, total
        self.stretches = True

    def __call__(self, step: int) -> float:
        return lr_factor(self.position(step), self.kind, self.warmup, self.total)

    def position(self, step: int) -> float:
        """Where optimizer step `step` stands in the schedule: an integer while the run keeps its shape."""
        if step >= self.end_step:
            return max(self.total, self.anchor_position)  # exactly the end, whatever the pace's rounding
        steps_left, positions_left = self.end_step - self.anchor_step, self.total - self.anchor_position
        if steps_left == positions_left:  # the shape the schedule was laid out for: exact integer steps
            return self.anchor_position + (step - self.anchor_step)
        return self.anchor_position + (step - self.anchor_step) * positions_left / steps_left

    def continue_to(self, step: int, end_step: int, output_dir: str) -> str | None:
        """A run (in `output_dir`) at `step` that ends at `end_step`: where that differs from the end laid out,
        what is left of the schedule is spread over the steps left (the anchor moves to `step`). Returns what
        changed, or None."""
        if not self.stretches or end_step == self.end_step or end_step <= step:
            return None
        position, was_left = self.position(step), self.end_step - step
        if position >= self.total and self.kind != "constant":
            raise ConfigError(
                f"the run's {self.kind} learning-rate schedule ended at step {min(step, self.end_step)} (a rate "
                f"of 0 from there), so the {end_step - step} step(s) more that this resume would train would "
                "change nothing. Train on in a new run from its final model (--model_name "
                f"{os.path.join(output_dir, 'hf_model_last')}, or hf_model where the last epoch was the best, and "
                "another --output_dir): its schedule starts afresh."
            )
        self.anchor_step, self.anchor_position, self.end_step = step, position, end_step
        pace = (self.total - position) / (end_step - step)
        return (
            f"{end_step - step} steps left where the schedule had {was_left} (the run's shape or data changed): "
            f"the rest of the {self.kind} schedule, from position {position:g} of {self.total}, is spread over "
            f"them ({pace:.4g} of the first shape's steps each)"
        )


def steps_per_epoch(recipe: RecipeConfig, batches_per_epoch: int) -> int:
    """An epoch's optimizer steps: its batches in groups of the accumulation (the last group may be shorter)."""
    return math.ceil(batches_per_epoch / recipe.gradient_accumulation_steps)


def total_optimizer_steps(recipe: RecipeConfig, epochs: int, batches_per_epoch: int) -> int:
    """The run's optimizer steps: --max_steps, over as many epochs as it takes (HF's meaning: --epochs aside),
    or without it every epoch's batches in groups of the accumulation."""
    return recipe.max_steps or epochs * steps_per_epoch(recipe, batches_per_epoch)


def run_length(max_steps: int, steps_per_epoch: int) -> str:
    """--max_steps in epochs of `steps_per_epoch` optimizer steps, for the start line: "N steps = E epochs + k"."""
    epochs, steps = divmod(max_steps, steps_per_epoch)
    length = f"{epochs} epoch{'s' if epochs != 1 else ''}" + (f" + {steps}" if steps else "")
    length = length if epochs else "part of one epoch"
    partial = "; the last epoch partial" if steps and epochs else ""
    return (
        f"--max_steps {max_steps}: {max_steps} steps = {length} ({steps_per_epoch} optimizer steps an "
        f"epoch{partial}), whatever --epochs says"
    )
