"""Wrapping the model in FSDP (FullyShardedDataParallel, the tutorial's FSDP1 API).

One function per concern, each taking plain values, so a second backend can sit beside `apply_fsdp`.
"""

import torch
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


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
    return FSDP(
        model,
        auto_wrap_policy=auto_wrap_policy,
        sharding_strategy=sharding_strategy,
        mixed_precision=mixed_precision,
        backward_prefetch=backward_prefetch,
        limit_all_gathers=limit_all_gathers,
        device_id=device,
    )
