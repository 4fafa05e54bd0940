"""FSDP1: FullyShardedDataParallel, the tutorial's API (deprecated upstream in favour of FSDP2).

The settings map one to one onto FSDP1's constructor (fsdp1_options); activation checkpointing is applied
to the T5Blocks inside their units afterwards, as the tutorial does.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffload
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from configs.fsdp import FSDPConfig
from policies.activation_checkpointing_functions import apply_fsdp_checkpointing
from policies.mixed_precision import POLICIES
from policies.wrapping import get_wrap_policy
from utils.distributed.mesh import fsdp1_mesh
from utils.model.rank0_loading import Rank0Materializer, weight_reader


def fsdp1_options(fsdp_config: FSDPConfig, model: nn.Module, device: torch.device, precision: str) -> dict:
    """FullyShardedDataParallel's keyword arguments for these settings.

    `device_id` makes FSDP move each unit to the device as it wraps it, so a model that fits in host memory
    but not on one GPU never needs to be on the GPU whole (tutorial: "FSDP model init on device").
    """
    return {
        "auto_wrap_policy": get_wrap_policy(fsdp_config.wrap_policy, model, fsdp_config.min_num_params),
        "sharding_strategy": fsdp_config.sharding_strategy,
        "mixed_precision": POLICIES[precision],
        "backward_prefetch": fsdp_config.backward_prefetch,
        "limit_all_gathers": fsdp_config.limit_all_gathers,
        "device_id": device,
        "device_mesh": fsdp1_mesh(
            fsdp_config.sharding_strategy, dist.get_world_size(), device, fsdp_config.hybrid_shard_group_size
        ),
        "forward_prefetch": fsdp_config.forward_prefetch,
        "use_orig_params": fsdp_config.use_orig_params,
        "sync_module_states": fsdp_config.sync_module_states,
        "cpu_offload": CPUOffload(offload_params=True) if fsdp_config.fsdp_cpu_offload else None,
    }


def wrap_model_fsdp1(
    model: nn.Module, fsdp_config: FSDPConfig, device: torch.device, precision: str, weights_source: str = ""
) -> FSDP:
    """FSDP units per the wrap policy, then activation checkpointing of the T5Blocks inside them. Collective.

    With rank-0-only loading every rank's model is on the meta device, and each unit is filled with rank 0's
    reads of `weights_source` (a pretrained model or a full .pt) as FSDP1 wraps it.
    """
    param_init_fn = None
    if fsdp_config.cpu_ram_efficient_loading:
        read, available = weight_reader(weights_source) if dist.get_rank() == 0 else (None, set())
        param_init_fn = Rank0Materializer(model, device, read, available)
    options = fsdp1_options(fsdp_config, model, device, precision)
    model = FSDP(model, param_init_fn=param_init_fn, **options)
    if fsdp_config.fsdp_activation_checkpointing:
        apply_fsdp_checkpointing(model)
    return model
