"""AdamW's parameter groups and the LR schedules; T5_training.py builds the optimizer with them."""

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, StepLR

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
    linear, cosine) with warmup over `total_steps` optimizer steps."""
    if recipe.lr_scheduler == "step":
        return StepLR(optimizer, step_size=1, gamma=gamma)
    warmup = recipe.warmup_steps or round(recipe.warmup_ratio * total_steps)
    return LambdaLR(optimizer, lambda step: lr_factor(step, recipe.lr_scheduler, warmup, total_steps))


def steps_per_epoch(recipe: RecipeConfig, batches_per_epoch: int) -> int:
    """An epoch's optimizer steps: its batches in groups of the accumulation (the last group may be shorter)."""
    return math.ceil(batches_per_epoch / recipe.gradient_accumulation_steps)


def unreached_step_budget(recipe: RecipeConfig, epochs: int, batches_per_epoch: int) -> str | None:
    """What a --max_steps larger than the epochs hold means here (HF's adds epochs; this one does not)."""
    total = total_optimizer_steps(recipe, epochs, batches_per_epoch)
    if recipe.max_steps <= total:
        return None
    needed = math.ceil(recipe.max_steps / max(steps_per_epoch(recipe, batches_per_epoch), 1))
    return (
        f"--max_steps {recipe.max_steps} is more than the {epochs} epoch(s) hold ({total} optimizer steps): the "
        f"run trains {total}; --epochs {needed} would train them all"
    )


def total_optimizer_steps(recipe: RecipeConfig, epochs: int, batches_per_epoch: int) -> int:
    """The run's optimizer steps: every epoch's batches in groups of the accumulation, or fewer, --max_steps (a
    larger one does not add epochs: they end the run first)."""
    every_epoch = epochs * steps_per_epoch(recipe, batches_per_epoch)
    return min(recipe.max_steps or every_epoch, every_epoch)
