"""Device meshes for both FSDP backends: which ranks shard a parameter together, which replicate it.

FSDP1 gets a mesh only for the hybrid strategies (left to itself it derives the shard groups from
torch.cuda.device_count(), which is 0 on a CPU group, and silently stops synchronising gradients,
docs/pitfalls.md #26); FSDP2 always shards over a mesh.
"""

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from configs.fsdp import HYBRID, ShardingStrategyName, hybrid_group_size


def hybrid_mesh(world_size: int, shard_group_size: int, device: torch.device) -> DeviceMesh:
    """replicate x shard: shard within groups of shard_group_size ranks, replicate across the groups."""
    return init_device_mesh(
        device.type, (world_size // shard_group_size, shard_group_size), mesh_dim_names=("replicate", "shard")
    )


def fsdp2_mesh(
    strategy: ShardingStrategyName, world_size: int, device: torch.device, group_size: int = 0
) -> DeviceMesh:
    """The FSDP2 device mesh of a sharding strategy: 1-D for (ZeRO-2/3) sharding, replicate x shard else."""
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    shard = 1 if strategy == "NO_SHARD" else hybrid_group_size(world_size, group_size)
    return hybrid_mesh(world_size, shard, device)


def fsdp1_mesh(
    strategy: ShardingStrategyName, world_size: int, device: torch.device, group_size: int = 0
) -> DeviceMesh | None:
    """The explicit hybrid mesh FSDP1 needs for the hybrid strategies; None (the whole group) otherwise."""
    if strategy not in HYBRID:
        return None
    return hybrid_mesh(world_size, hybrid_group_size(world_size, group_size), device)
