"""Sharding a model with the configured FSDP backend, and describing the result."""

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers.models.t5.modeling_t5 import T5Block

from configs.fsdp import FSDPConfig
from utils.fsdp.fsdp1 import wrap_model_fsdp1
from utils.fsdp.fsdp2 import wrap_model_fsdp2
from utils.observe.log import get_logger


def wrap_model(
    model: nn.Module, fsdp_config: FSDPConfig, device: torch.device, precision: str, weights_source: str = ""
) -> nn.Module:
    """Shard `model` (unwrapped, on CPU or meta) over the default process group. Collective.

    `precision` is a policy name of policies/mixed_precision.py; `weights_source` is where FSDP1's
    rank-0-only loading reads the weights (FSDP2 broadcasts rank 0's loaded model instead). The settings
    were checked by configs/validate.py.
    """
    if fsdp_config.compile:
        compile_blocks(model)
    if fsdp_config.fsdp_version == 2:
        return wrap_model_fsdp2(model, fsdp_config, device, precision)
    return wrap_model_fsdp1(model, fsdp_config, device, precision, weights_source)


def compile_blocks(model: nn.Module) -> None:
    """torch.compile every T5Block in place, before sharding (FSDP2's recommended order; FSDP1 needs
    use_orig_params). In place (`Module.compile`), the blocks keep their class, so the wrap policy and
    activation checkpointing still find them. Compilation happens at each block's first call (and again
    when the shapes change, as with per-batch padding, until torch marks them dynamic)."""
    for module in model.modules():
        if isinstance(module, T5Block):
            module.compile()


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units of a wrapped model, root first, for either backend."""
    if isinstance(model, FSDP):
        return [unit.module for unit in FSDP.fsdp_modules(model)]
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def log_fsdp_layout(model: nn.Module, precision: str) -> None:
    """One line at INFO (units, precision); the whole wrapped module tree at DEBUG (long for t5-3b)."""
    units = fsdp_units(model)
    blocks = sum(isinstance(getattr(u, "_checkpoint_wrapped_module", u), T5Block) for u in units)
    get_logger().info(
        "FSDP%d: %d units (root + %d T5Blocks + %d other), mixed precision %s",
        2 if isinstance(model, FSDPModule) else 1,
        len(units),
        blocks,
        len(units) - 1 - blocks,
        precision,
    )
    get_logger().debug("FSDP model:\n%s", model)
