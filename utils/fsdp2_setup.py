"""The FSDP2 backend (`torch.distributed.fsdp.fully_shard`), the sibling of utils.fsdp_setup.apply_fsdp.

How the tutorial's FSDP1 settings map (PITFALLS item 15):

| FSDP1 (tutorial)              | FSDP2 here                                                                   |
| ----------------------------- | ---------------------------------------------------------------------------- |
| FULL_SHARD                    | 1-D mesh (world), reshard_after_forward=True                                 |
| SHARD_GRAD_OP                 | 1-D mesh (world), reshard_after_forward=False                                |
| NO_SHARD                      | 2-D mesh (replicate=world, shard=1): plain replication, gradients all-reduced |
| HYBRID_SHARD / _ZERO2         | 2-D mesh (replicate=world/group, shard=group), reshard True / False          |
| MixedPrecision(param, reduce) | MixedPrecisionPolicy(param_dtype, reduce_dtype)                              |
| MixedPrecision.buffer_dtype   | no equivalent: FSDP2 leaves buffers alone (T5 has none that matter)          |
| auto_wrap_policy (T5Block)    | fully_shard on each T5Block, then on the root                                |
| size-based auto-wrap          | refused: FSDP2 has no auto-wrap policies                                     |
| BACKWARD_PRE                  | FSDP2's default: the next unit's all-gather is issued before this backward   |
| BACKWARD_POST                 | refused: no FSDP2 equivalent                                                 |
| backward_prefetch NONE        | explicit empty backward-prefetch lists                                       |
| limit_all_gathers=True        | built in (FSDP2 frees memory without rate limiting); False is refused       |
| device_id                     | the mesh's device type; parameters moved to the device before sharding       |
| sync_module_states            | set_model_state_dict(..., broadcast_from_rank0=True) (rank-0-only loading)   |
"""

import os

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from transformers.models.t5.modeling_t5 import T5Block

from utils.errors import ConfigError

RESHARD_AFTER_FORWARD = {
    ShardingStrategy.FULL_SHARD: True,
    ShardingStrategy.SHARD_GRAD_OP: False,
    ShardingStrategy.NO_SHARD: True,  # one rank per shard group: nothing to reshard either way
    ShardingStrategy.HYBRID_SHARD: True,
    ShardingStrategy._HYBRID_SHARD_ZERO2: False,
}


def check_fsdp2_settings(
    *,
    wrap_policy: str,
    backward_prefetch: BackwardPrefetch | None,
    limit_all_gathers: bool,
    sync_module_states: bool = False,
) -> None:
    """Refuse the FSDP1 settings that mean nothing under FSDP2, instead of silently dropping them."""
    if sync_module_states:
        raise ConfigError(
            "--sync_module_states is FSDP1's; with --fsdp_version 2 use --cpu_ram_efficient_loading true "
            "(rank 0's weights broadcast after sharding)"
        )
    if wrap_policy != "transformer":
        raise ConfigError(
            "--wrap_policy size_based has no FSDP2 equivalent (FSDP2 has no auto-wrap policies; each T5Block "
            "is sharded). Use --wrap_policy transformer with --fsdp_version 2."
        )
    if backward_prefetch == BackwardPrefetch.BACKWARD_POST:
        raise ConfigError(
            "--backward_prefetch BACKWARD_POST has no FSDP2 equivalent; FSDP2 prefetches like BACKWARD_PRE "
            "(or not at all with --backward_prefetch NONE)."
        )
    if not limit_all_gathers:
        raise ConfigError(
            "--limit_all_gathers false has no FSDP2 equivalent: FSDP2 manages all-gather memory itself. "
            "Leave it true with --fsdp_version 2."
        )


HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def hybrid_group_size(world_size: int, requested: int = 0) -> int:
    """Ranks per shard group for the hybrid strategies: `requested`, or (0) the ranks of one node."""
    size = requested or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % size:
        raise ConfigError(
            f"--hybrid_shard_group_size {size} does not divide the world size {world_size}; choose a divisor"
        )
    return size


def hybrid_mesh(world_size: int, shard_group_size: int, device: torch.device) -> DeviceMesh:
    """replicate x shard: shard within groups of shard_group_size ranks, replicate across the groups."""
    return init_device_mesh(
        device.type, (world_size // shard_group_size, shard_group_size), mesh_dim_names=("replicate", "shard")
    )


def build_mesh(
    strategy: ShardingStrategy, world_size: int, device: torch.device, group_size: int = 0
) -> DeviceMesh:
    """The FSDP2 device mesh of a sharding strategy: 1-D for (ZeRO-2/3) sharding, replicate x shard else."""
    if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    shard = 1 if strategy == ShardingStrategy.NO_SHARD else hybrid_group_size(world_size, group_size)
    return hybrid_mesh(world_size, shard, device)


def to_fsdp2_policy(policy: MixedPrecision) -> MixedPrecisionPolicy:
    """FSDP1 MixedPrecision -> FSDP2 MixedPrecisionPolicy (buffer_dtype has no equivalent and is dropped)."""
    return MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)


def t5_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP2 units, in forward order: each T5Block, or its checkpoint wrapper."""
    wrapped = {
        id(m._checkpoint_wrapped_module) for m in model.modules() if hasattr(m, "_checkpoint_wrapped_module")
    }
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "_checkpoint_wrapped_module", m), T5Block) and id(m) not in wrapped
    ]


def apply_fsdp2(
    model: nn.Module,
    *,
    device: torch.device,
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    mixed_precision: MixedPrecisionPolicy,
    backward_prefetch: BackwardPrefetch | None,
    forward_prefetch: bool = False,
    cpu_offload: bool = False,
) -> nn.Module:
    """fully_shard every T5Block unit, then the root (which keeps the tied embedding). Collective.

    Activation checkpointing, if wanted, must already be applied: FSDP2 shards the checkpoint wrappers.
    """
    units = t5_units(model)
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": mixed_precision}
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for unit in [*units, model]:
        fully_shard(unit, **options)
    if backward_prefetch is None:
        for unit in [*units, model]:
            unit.set_modules_to_backward_prefetch([])
    if forward_prefetch:
        # Explicit lists: each block's forward all-gathers the next block too (FSDP2's default is none).
        for unit, following in zip(units, units[1:], strict=False):
            unit.set_modules_to_forward_prefetch([following])
    return model


def broadcast_rank0_weights(model: nn.Module, rank0_state: dict, device: torch.device) -> None:
    """Fill an FSDP2 model whose non-zero ranks were built on the meta device with rank 0's weights.

    Collective. to_empty allocates each rank's shards (uninitialised), then rank 0's full state dict is
    broadcast shard by shard. The tied embedding stays one parameter: to_empty keeps parameter identity.
    """
    model.to_empty(device=device)
    set_model_state_dict(
        model, rank0_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
