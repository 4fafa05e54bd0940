"""Wrapping the model in FSDP (FullyShardedDataParallel, the tutorial's FSDP1 API).

One function per concern, each taking plain values, so a second backend can sit beside `apply_fsdp`.
"""

import torch
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers.models.t5.modeling_t5 import T5Block

from configs.fsdp import FSDPConfig
from policies.activation_checkpointing_functions import apply_fsdp_checkpointing
from policies.mixed_precision import POLICIES, select_policy_name
from policies.wrapping import get_wrap_policy
from utils.environment import bf16_supported
from utils.errors import ConfigError
from utils.logging_utils import get_logger

HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def check_strategy_for_device(sharding_strategy: ShardingStrategy, device: torch.device) -> None:
    """Refuse what FSDP1 would accept but get silently wrong.

    Without an explicit process-group pair, FSDP1's hybrid strategies shard within a node of
    torch.cuda.device_count() ranks. On a CPU group that count is 0, so every rank becomes its own
    one-rank "node", FSDP falls back to NO_SHARD on it, and gradients are never synchronised: the ranks
    train different models without any error (measured in tests/test_fsdp_numerics.py).
    """
    if sharding_strategy in HYBRID_STRATEGIES and device.type != "cuda":
        raise ConfigError(
            f"--sharding_strategy {sharding_strategy.name} needs GPUs: on a CPU group FSDP1 builds its shard "
            "groups from the GPU count (0) and silently stops synchronising gradients. Use FULL_SHARD or "
            "SHARD_GRAD_OP on CPU."
        )


def apply_fsdp(
    model: nn.Module,
    *,
    device: torch.device,
    auto_wrap_policy,
    sharding_strategy: ShardingStrategy,
    mixed_precision: MixedPrecision | None,
    backward_prefetch: BackwardPrefetch | None,
    limit_all_gathers: bool,
) -> FSDP:
    """Shard `model` (on CPU, unwrapped) over the default process group. Collective: every rank calls it.

    `device_id` makes FSDP move each unit to the device as it wraps it, so a model that fits in host memory
    but not on one GPU never needs to be on the GPU whole (tutorial: "FSDP model init on device").
    """
    check_strategy_for_device(sharding_strategy, device)
    return FSDP(
        model,
        auto_wrap_policy=auto_wrap_policy,
        sharding_strategy=sharding_strategy,
        mixed_precision=mixed_precision,
        backward_prefetch=backward_prefetch,
        limit_all_gathers=limit_all_gathers,
        device_id=device,
    )


def choose_precision(fsdp_config: FSDPConfig, device: torch.device) -> str:
    """Name of the mixed-precision policy for this config on this device (a key of POLICIES)."""
    if fsdp_config.mixed_precision and fsdp_config.use_fp16 and device.type != "cuda":
        raise ConfigError(
            "--use_fp16 true needs a CUDA GPU (fp16 with a gradient scaler); on CPU use bf16 "
            "(--use_fp16 false) or fp32 (--mixed_precision false)"
        )
    bf16_ok = bf16_supported(device)
    name = select_policy_name(fsdp_config.mixed_precision, fsdp_config.use_fp16, fsdp_config.bf16_policy, bf16_ok)
    if fsdp_config.mixed_precision and not fsdp_config.use_fp16 and not bf16_ok:
        get_logger().warning("bf16 is not supported on %s: training in fp32 instead", device)
    return name


def wrap_model(model, fsdp_config: FSDPConfig, device: torch.device, precision: str):
    """FSDP units per the wrap policy, then activation checkpointing of the T5Blocks inside them."""
    model = apply_fsdp(
        model,
        device=device,
        auto_wrap_policy=get_wrap_policy(fsdp_config.wrap_policy, model, fsdp_config.min_num_params),
        sharding_strategy=fsdp_config.sharding_strategy,
        mixed_precision=POLICIES[precision],
        backward_prefetch=fsdp_config.backward_prefetch,
        limit_all_gathers=fsdp_config.limit_all_gathers,
    )
    if fsdp_config.fsdp_activation_checkpointing:
        apply_fsdp_checkpointing(model)
    return model


def log_fsdp_layout(model, precision: str) -> None:
    """One line at INFO (units, precision); the whole wrapped module tree at DEBUG (long for t5-3b)."""
    units = FSDP.fsdp_modules(model)
    blocks = sum(isinstance(unit.module, T5Block) for unit in units)
    get_logger().info(
        "FSDP: %d units (root + %d T5Blocks + %d other), mixed precision %s",
        len(units),
        blocks,
        len(units) - 1 - blocks,
        precision,
    )
    get_logger().debug("FSDP model:\n%s", model)
