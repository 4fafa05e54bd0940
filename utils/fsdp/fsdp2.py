"""FSDP2: `torch.distributed.fsdp.fully_shard` on a DeviceMesh, the sibling of utils/fsdp/fsdp1.py.

How the tutorial's FSDP1 settings map (docs/pitfalls.md #15; what has no FSDP2 meaning is refused by
configs/validate.py before anything loads):

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
| device_id                     | the mesh's device type: fully_shard moves each unit there                    |
| sync_module_states            | set_model_state_dict(..., broadcast_from_rank0=True) (rank-0-only loading)   |
"""

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffloadPolicy,
    ShardingStrategy,
    fully_shard,
    register_fsdp_forward_method,
)
from transformers.models.t5.modeling_t5 import T5Block

from configs.fsdp import FSDPConfig
from policies.activation_checkpointing_functions import apply_fsdp_checkpointing
from policies.mixed_precision import fsdp2_policy
from utils.distributed.mesh import fsdp2_mesh
from utils.model.rank0_loading import broadcast_rank0_weights

# FSDP2 warns, on every forward of every T5Block unit (checkpointed or not), that the unit returned a view
# whose in-place modification would skip its pre-backward hook. T5 loses no gradient that way: the FSDP2
# parity tests, with and without activation checkpointing, end with the unsharded reference's weights.
# Ignored for exactly those two unit types; any other unit that returns a view still warns.
warnings.filterwarnings(
    "ignore",
    message=r"FSDP2-wrapped module \(FSDP(CheckpointWrapper|T5Block)\) returned a view tensor",
    category=UserWarning,
)

RESHARD_AFTER_FORWARD = {
    ShardingStrategy.FULL_SHARD: True,
    ShardingStrategy.SHARD_GRAD_OP: False,
    ShardingStrategy.NO_SHARD: True,  # one rank per shard group: nothing to reshard either way
    ShardingStrategy.HYBRID_SHARD: True,
    ShardingStrategy._HYBRID_SHARD_ZERO2: False,
}


def fully_shard_options(fsdp_config: FSDPConfig, device: torch.device, precision: str) -> dict:
    """fully_shard's keyword arguments for these settings (the same for every unit)."""
    mesh = fsdp2_mesh(
        fsdp_config.sharding_strategy, dist.get_world_size(), device, fsdp_config.hybrid_shard_group_size
    )
    options = {
        "mesh": mesh,
        "reshard_after_forward": RESHARD_AFTER_FORWARD[fsdp_config.sharding_strategy],
        "mp_policy": fsdp2_policy(precision),
    }
    if fsdp_config.fsdp_cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    return options


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


def set_prefetching(
    model: nn.Module, units: list[nn.Module], backward_prefetch: BackwardPrefetch | None, forward_prefetch: bool
) -> None:
    """BACKWARD_PRE is FSDP2's default; NONE empties every unit's backward list; forward prefetch makes
    each block's forward all-gather the next block too (FSDP2's default is none)."""
    if backward_prefetch is None:
        for unit in [*units, model]:
            unit.set_modules_to_backward_prefetch([])
    if forward_prefetch:
        for unit, following in zip(units, units[1:], strict=False):
            unit.set_modules_to_forward_prefetch([following])


def wrap_model_fsdp2(model: nn.Module, fsdp_config: FSDPConfig, device: torch.device, precision: str) -> nn.Module:
    """Activation checkpointing first (FSDP2 shards the wrappers), then fully_shard every T5Block unit and
    the root (which keeps the tied embedding). Collective.

    With rank-0-only loading, ranks other than 0 hold the model on the meta device; rank 0's weights are
    broadcast into every rank's shards after sharding.
    """
    rank0_state = None
    if fsdp_config.cpu_ram_efficient_loading:
        # References to rank 0's loaded tensors: they stay alive (one full copy) until the broadcast.
        rank0_state = model.state_dict() if dist.get_rank() == 0 else {}
    if fsdp_config.fsdp_activation_checkpointing:
        apply_fsdp_checkpointing(model)
    units = t5_units(model)
    options = fully_shard_options(fsdp_config, device, precision)
    for unit in [*units, model]:
        fully_shard(unit, **options)
    set_prefetching(model, units, fsdp_config.backward_prefetch, fsdp_config.forward_prefetch)
    # generate() calls the encoder directly: registered, it gathers the root's parameters like forward does.
    register_fsdp_forward_method(model, "generate")
    if rank0_state is not None:
        broadcast_rank0_weights(model, rank0_state, device)
    return model
