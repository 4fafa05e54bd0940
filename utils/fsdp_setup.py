"""Wrapping the model in FSDP (FullyShardedDataParallel, the tutorial's FSDP1 API).

One function per concern, each taking plain values, so a second backend can sit beside `apply_fsdp`.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, FSDPModule, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers.models.t5.modeling_t5 import T5Block

from configs.fsdp import FSDPConfig
from policies.activation_checkpointing_functions import apply_fsdp_checkpointing
from policies.mixed_precision import POLICIES, select_policy_name
from policies.wrapping import get_wrap_policy
from utils.environment import bf16_supported
from utils.errors import ConfigError
from utils.fsdp2_setup import (
    HYBRID,
    RESHARD_AFTER_FORWARD,
    apply_fsdp2,
    broadcast_rank0_weights,
    build_mesh,
    check_fsdp2_settings,
    hybrid_group_size,
    hybrid_mesh,
    to_fsdp2_policy,
)
from utils.logging_utils import get_logger
from utils.rank0_loading import Rank0Materializer, weight_reader


def check_hybrid_group(sharding_strategy: ShardingStrategy, shard_group_size: int) -> None:
    """Refuse what FSDP1 would accept but get silently wrong.

    With a shard group of one rank, FSDP1 falls back to NO_SHARD inside the group and never all-reduces
    across the groups: the ranks train different models without any error (measured: losses 0.4-1% off
    after 4 steps on 2 and 4 ranks). Without an explicit mesh it derives the groups from
    torch.cuda.device_count(), which is 0 on a CPU group, with the same result, so a mesh is always passed.
    """
    if sharding_strategy in HYBRID and shard_group_size == 1:
        raise ConfigError(
            f"--sharding_strategy {sharding_strategy.name} with a shard group of 1 rank: FSDP1 would silently "
            "stop synchronising gradients across groups. Use --sharding_strategy NO_SHARD (pure replication) "
            "or a --hybrid_shard_group_size above 1."
        )


def check_device_settings(fsdp_config: FSDPConfig, device: torch.device) -> None:
    """Settings that need GPUs, refused on a CPU group rather than silently ignored."""
    if device.type == "cuda":
        return
    if fsdp_config.fsdp_cpu_offload:
        raise ConfigError(
            "--fsdp_cpu_offload true needs GPUs: on a CPU group the parameters already live in host memory"
        )
    if fsdp_config.sync_module_states and fsdp_config.fsdp_version == 1:
        raise ConfigError(
            "--sync_module_states true needs GPUs: FSDP1 refuses it for CPU tensors. Use --fsdp_version 2 "
            "--cpu_ram_efficient_loading true for rank-0-only loading on CPU."
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
    shard_group_size: int = 0,
    forward_prefetch: bool = False,
    use_orig_params: bool = False,
    sync_module_states: bool = False,
    cpu_offload: bool = False,
    param_init_fn=None,
) -> FSDP:
    """Shard `model` (on CPU, unwrapped) over the default process group. Collective: every rank calls it.

    `device_id` makes FSDP move each unit to the device as it wraps it, so a model that fits in host memory
    but not on one GPU never needs to be on the GPU whole (tutorial: "FSDP model init on device").
    """
    mesh = None
    if sharding_strategy in HYBRID:
        group = hybrid_group_size(dist.get_world_size(), shard_group_size)
        check_hybrid_group(sharding_strategy, group)
        mesh = hybrid_mesh(dist.get_world_size(), group, device)
    return FSDP(
        model,
        auto_wrap_policy=auto_wrap_policy,
        sharding_strategy=sharding_strategy,
        mixed_precision=mixed_precision,
        backward_prefetch=backward_prefetch,
        limit_all_gathers=limit_all_gathers,
        device_id=device,
        device_mesh=mesh,
        forward_prefetch=forward_prefetch,
        use_orig_params=use_orig_params,
        sync_module_states=sync_module_states,
        cpu_offload=CPUOffload(offload_params=True) if cpu_offload else None,
        param_init_fn=param_init_fn,
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


def wrap_model(model, fsdp_config: FSDPConfig, device: torch.device, precision: str, weights_source: str = ""):
    """Shard `model` with the configured backend. Collective: every rank calls it.

    With cpu_ram_efficient_loading and FSDP1, every rank's model is on the meta device and rank 0 reads the
    weights unit by unit from `weights_source` (a pretrained model or a full .pt / checkpoint).
    """
    check_device_settings(fsdp_config, device)
    if fsdp_config.fsdp_version == 2:
        return wrap_model_fsdp2(model, fsdp_config, device, precision)
    return wrap_model_fsdp1(model, fsdp_config, device, precision, weights_source)


def wrap_model_fsdp1(
    model, fsdp_config: FSDPConfig, device: torch.device, precision: str, weights_source: str = ""
):
    """FSDP units per the wrap policy, then activation checkpointing of the T5Blocks inside them."""
    param_init_fn = None
    if fsdp_config.cpu_ram_efficient_loading:
        read, available = weight_reader(weights_source) if dist.get_rank() == 0 else (None, set())
        param_init_fn = Rank0Materializer(model, device, read, available)
    model = apply_fsdp(
        model,
        device=device,
        auto_wrap_policy=get_wrap_policy(fsdp_config.wrap_policy, model, fsdp_config.min_num_params),
        sharding_strategy=fsdp_config.sharding_strategy,
        mixed_precision=POLICIES[precision],
        backward_prefetch=fsdp_config.backward_prefetch,
        limit_all_gathers=fsdp_config.limit_all_gathers,
        shard_group_size=fsdp_config.hybrid_shard_group_size,
        forward_prefetch=fsdp_config.forward_prefetch,
        use_orig_params=fsdp_config.use_orig_params,
        sync_module_states=fsdp_config.sync_module_states,
        cpu_offload=fsdp_config.fsdp_cpu_offload,
        param_init_fn=param_init_fn,
    )
    if fsdp_config.fsdp_activation_checkpointing:
        apply_fsdp_checkpointing(model)
    return model


def wrap_model_fsdp2(model, fsdp_config: FSDPConfig, device: torch.device, precision: str):
    """Activation checkpointing first (FSDP2 shards the wrappers), then fully_shard on a DeviceMesh.

    With cpu_ram_efficient_loading, ranks other than 0 hold the model on the meta device; rank 0's weights
    are broadcast into every rank's shards after sharding.
    """
    check_fsdp2_settings(
        wrap_policy=fsdp_config.wrap_policy,
        backward_prefetch=fsdp_config.backward_prefetch,
        limit_all_gathers=fsdp_config.limit_all_gathers,
        sync_module_states=fsdp_config.sync_module_states,
    )
    rank0_state = None
    if fsdp_config.cpu_ram_efficient_loading:
        # References to rank 0's loaded tensors: they stay alive (one full copy) until the broadcast.
        rank0_state = model.state_dict() if dist.get_rank() == 0 else {}
    if fsdp_config.fsdp_activation_checkpointing:
        apply_fsdp_checkpointing(model)
    model = apply_fsdp2(
        model,
        device=device,
        mesh=build_mesh(
            fsdp_config.sharding_strategy, dist.get_world_size(), device, fsdp_config.hybrid_shard_group_size
        ),
        reshard_after_forward=RESHARD_AFTER_FORWARD[fsdp_config.sharding_strategy],
        mixed_precision=to_fsdp2_policy(POLICIES[precision]),
        backward_prefetch=fsdp_config.backward_prefetch,
        forward_prefetch=fsdp_config.forward_prefetch,
        cpu_offload=fsdp_config.fsdp_cpu_offload,
    )
    if rank0_state is not None:
        broadcast_rank0_weights(model, rank0_state, device)
    return model


def fsdp_units(model) -> list:
    """The FSDP units of a wrapped model, root first, for either backend."""
    if isinstance(model, FSDP):
        return [unit.module for unit in FSDP.fsdp_modules(model)]
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def log_fsdp_layout(model, precision: str) -> None:
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
