"""Sharding the model: one call, `shard_model`, with both FSDP backends behind it.

    model = shard_model(model, config.fsdp, precision, device, weights_source, restores)

FSDP1 (`--fsdp_version 1`, the tutorial's API, deprecated upstream) is the tutorial's one constructor call,
`FSDP(model, auto_wrap_policy=..., mixed_precision=..., sharding_strategy=..., ...)`, then activation
checkpointing of the stack layers inside their units (each T5Block for T5; policies/wrapping.py: layer_classes).
FSDP2 (`--fsdp_version 2`) reads like torchtitan's `parallelize`: activation checkpointing, then `fully_shard`
of every layer and of the root. With --compile, each layer is compiled first, for both backends. At world size 1
with --single_rank_fsdp false nothing is sharded or wrapped: the model itself, its layers checkpointed and
compiled alike, computes under autocast (`unwrapped_model`).
How the tutorial's FSDP1 settings map onto FSDP2 (docs/pitfalls.md #15; what has no FSDP2 meaning is refused
by configs/validate.py before anything loads):

| FSDP1 (tutorial)              | FSDP2 here                                                                   |
| ----------------------------- | ---------------------------------------------------------------------------- |
| FULL_SHARD                    | 1-D mesh (world), reshard_after_forward=True                                 |
| SHARD_GRAD_OP                 | 1-D mesh (world), reshard_after_forward=False                                |
| NO_SHARD                      | 2-D mesh (replicate=world, shard=1): plain replication, gradients all-reduced |
| HYBRID_SHARD / _ZERO2         | 2-D mesh (replicate=world/group, shard=group), reshard True / False          |
| MixedPrecision(param, reduce) | MixedPrecisionPolicy(param_dtype, reduce_dtype)                              |
| MixedPrecision.buffer_dtype   | no equivalent: FSDP2 leaves buffers alone (BART's final_logits_bias is fp32) |
| auto_wrap_policy (T5Block)    | fully_shard on each layer (T5Block), then on the root                        |
| size-based auto-wrap          | refused: FSDP2 has no auto-wrap policies                                     |
| BACKWARD_PRE                  | FSDP2's default: the next unit's all-gather is issued before this backward   |
| BACKWARD_POST                 | refused: no FSDP2 equivalent                                                 |
| backward_prefetch NONE        | explicit empty backward-prefetch lists                                       |
| limit_all_gathers=True        | built in (FSDP2 frees memory without rate limiting); False is refused       |
| device_id                     | the mesh's device type: fully_shard moves each unit there                    |
| sync_module_states            | set_model_state_dict(..., broadcast_from_rank0=True) (rank-0-only loading)   |
"""

import dataclasses
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecision,
    ShardingStrategy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from configs.fsdp import TESTED_LAYER_CLASSES, FSDPConfig, wraps_in_fsdp
from policies.activation_checkpointing_functions import apply_fsdp_checkpointing
from policies.mixed_precision import Precision
from policies.private_api import wrapped_module
from policies.wrapping import get_wrap_policy, layer_classes
from utils.distributed.mesh import fsdp1_mesh, fsdp2_mesh
from utils.log import get_logger, warnings_ignored
from utils.model.loading import computed_buffers
from utils.model.rank0_loading import UnitMaterializer, broadcast_rank0_weights, to_empty, weight_reader

# FSDP2 warns, on every forward of every layer unit (checkpointed or not), that the unit returned a view
# whose in-place modification would skip its pre-backward hook. No family loses a gradient that way: the
# FSDP2 parity tests of each (T5 with and without activation checkpointing, mT5, UMT5, BART, PEGASUS) end
# with the unsharded reference's weights. Ignored for the layer units and checkpoint wrappers, around the
# loops that run forwards (`forward_warnings_ignored`); any other unit that returns a view still warns.
VIEW_RETURNING_UNITS = ("CheckpointWrapper", *TESTED_LAYER_CLASSES)
FSDP2_VIEW_WARNINGS = tuple(
    (UserWarning, f"FSDP2-wrapped module (FSDP{name}) returned a view tensor") for name in VIEW_RETURNING_UNITS
)


# FSDP1 warns that NO_SHARD is deprecated in favour of DistributedDataParallel. It is one of the tutorial's
# strategies, kept for comparisons (docs/throughput.md says when to use which); the warning is ignored where
# FSDP1 is constructed, and nowhere else.
FSDP1_NO_SHARD_WARNING = (FutureWarning, "The `NO_SHARD` sharding strategy is deprecated")
# At world size 1 FSDP1 runs NO_SHARD whatever strategy it is given, and warns; log_fsdp_layout's line names
# the strategy it runs instead (seen on one GPU: the warning came raw, the log did not say it).
FSDP1_ONE_RANK_WARNING = (UserWarning, "FSDP is switching to use `NO_SHARD` instead of")


def forward_warnings_ignored():
    """Around a training or evaluation loop: FSDP2's warning about layer units' outputs, ignored."""
    return warnings_ignored(*FSDP2_VIEW_WARNINGS)


RESHARD_AFTER_FORWARD = {
    "FULL_SHARD": True,
    "SHARD_GRAD_OP": False,
    "NO_SHARD": True,  # one rank per shard group: nothing to reshard either way
    "HYBRID_SHARD": True,
    "_HYBRID_SHARD_ZERO2": False,
}


# Graphs of the one forward every stack layer shares, in a run: T5's 4 kinds of block (each stack's first,
# which computes the position bias, and the rest) in training and again without gradients (validation),
# each static then dynamic in its lengths, and generation's cached steps (8 for the embedded model).
# Dynamo's default limit (8) is spent by training and the first validation; past it torch warns and runs
# every new variant uncompiled, generation included.
COMPILE_RECOMPILE_LIMIT = 32


def shard_model(
    model: nn.Module,
    fsdp: FSDPConfig,
    precision: Precision,
    device: torch.device,
    weights_source: str = "",
    restores: bool = False,
) -> nn.Module:
    """Shard `model` (unwrapped, on CPU or meta) over the default process group. Collective. At world size 1
    with --single_rank_fsdp false, the model itself is returned, on the device (`unwrapped_model`).

    With rank-0-only loading (--cpu_ram_efficient_loading) the ranks hold a skeleton on the meta device: FSDP1
    fills each unit with rank 0's reads of `weights_source` (the pretrained model or a full .pt) as it wraps
    it; FSDP2 broadcasts rank 0's loaded weights into every rank's shards after sharding. `restores`: every
    rank holds a skeleton that a checkpoint fills after sharding (utils/checkpoint/manager.py), so the shards
    are only allocated.
    """
    layers = layer_classes(model)  # T5Block for T5: the units, what is checkpointed and compiled
    if fsdp.compile:
        compile_layers(model, layers)
    if not wraps_in_fsdp(fsdp, dist.get_world_size()):
        return unwrapped_model(
            model, layers, checkpointing=fsdp.fsdp_activation_checkpointing, precision=precision, device=device,
            restores=restores,
        )  # fmt: skip
    if fsdp.fsdp_version == 1:
        param_init_fn = None
        if restores:
            param_init_fn = UnitMaterializer(model, device, fill=False)
        elif fsdp.cpu_ram_efficient_loading:
            read, available = weight_reader(weights_source) if dist.get_rank() == 0 else (None, set())
            param_init_fn = UnitMaterializer(model, device, fill=True, read=read, available=available)
        mesh = fsdp1_mesh(fsdp.sharding_strategy, dist.get_world_size(), device, fsdp.hybrid_shard_group_size)
        # The config names torch's enum members (it is read without importing torch).
        prefetch = None if fsdp.backward_prefetch is None else BackwardPrefetch[fsdp.backward_prefetch]
        with warnings_ignored(FSDP1_NO_SHARD_WARNING, FSDP1_ONE_RANK_WARNING):
            model = FSDP(
                model,
                auto_wrap_policy=get_wrap_policy(fsdp.wrap_policy, model, fsdp.min_num_params),
                mixed_precision=computed_buffers_kept(precision.policy, model),
                sharding_strategy=ShardingStrategy[fsdp.sharding_strategy],
                backward_prefetch=prefetch,
                limit_all_gathers=fsdp.limit_all_gathers,
                # FSDP moves each unit to the device as it wraps it, so a model that fits in host memory but not
                # on one GPU never needs to be on the GPU whole (tutorial: "FSDP model init on device").
                device_id=device,
                device_mesh=mesh,
                forward_prefetch=fsdp.forward_prefetch,
                use_orig_params=fsdp.use_orig_params,
                sync_module_states=fsdp.sync_module_states,
                cpu_offload=CPUOffload(offload_params=True) if fsdp.fsdp_cpu_offload else None,
                param_init_fn=param_init_fn,
            )
        if fsdp.fsdp_activation_checkpointing:
            apply_fsdp_checkpointing(model, layers)
        return model

    rank0_state = None
    if fsdp.cpu_ram_efficient_loading and not restores:
        # References to rank 0's loaded tensors: they stay alive (one full copy) until the broadcast.
        rank0_state = model.state_dict() if dist.get_rank() == 0 else {}
    if fsdp.fsdp_activation_checkpointing:
        apply_fsdp_checkpointing(model, layers)  # before sharding: FSDP2 shards the checkpoint wrappers
    units = layer_units(model, layers)
    options = {
        "mesh": fsdp2_mesh(fsdp.sharding_strategy, dist.get_world_size(), device, fsdp.hybrid_shard_group_size),
        "reshard_after_forward": RESHARD_AFTER_FORWARD[fsdp.sharding_strategy],
        "mp_policy": precision.fsdp2_policy,
    }
    if fsdp.fsdp_cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for unit in [*units, model]:
        fully_shard(unit, **options)
    # BACKWARD_PRE is FSDP2's default; NONE empties every unit's backward list. Forward prefetch makes each
    # block's forward all-gather the next block too (FSDP2's default is none).
    if fsdp.backward_prefetch is None:
        for unit in [*units, model]:
            unit.set_modules_to_backward_prefetch([])
    if fsdp.forward_prefetch:
        for unit, following in zip(units, units[1:], strict=False):
            unit.set_modules_to_forward_prefetch([following])
    # generate() calls the encoder directly: registered, it gathers the root's parameters like forward does.
    register_fsdp_forward_method(model, "generate")
    if rank0_state is not None:
        broadcast_rank0_weights(model, rank0_state, device)
    elif restores:
        # Each rank's shards, uninitialised: the checkpoint fills them. With CPU offload they live in host
        # memory (FSDP2 copies each unit to the GPU as it runs), as torchtitan places them.
        to_empty(model, torch.device("cpu") if fsdp.fsdp_cpu_offload else device)
    return model


def unwrapped_model(
    model: nn.Module, layers: frozenset[type], *, checkpointing: bool, precision: Precision, device: torch.device,
    restores: bool,
) -> nn.Module:  # fmt: skip
    """One rank, --single_rank_fsdp false: the model itself on `device`, its stack layers checkpointed as FSDP's
    would be. Its forward and generate run under autocast to the compute dtype (bf16, fp16; nothing in fp32);
    the weights and AdamW's state stay fp32, like FSDP's master copy. `restores`: the skeleton on the meta device
    is allocated for the checkpoint to fill."""
    if checkpointing:
        apply_fsdp_checkpointing(model, layers)
    if restores:
        to_empty(model, device)
    else:
        model.to(device)
    dtype = precision.compute_dtype
    if dtype != torch.float32:
        # One autocast object per method: generate calls forward, and an object entered twice loses the state
        # it restores on exit. generate is covered whole: it calls the encoder without forward.
        model.forward = torch.autocast(device.type, dtype=dtype)(model.forward)
        model.generate = torch.autocast(device.type, dtype=dtype)(model.generate)
    return model


def computed_buffers_kept(policy: MixedPrecision | None, model: nn.Module) -> MixedPrecision | None:
    """FSDP1's policy, but leaving the buffers alone where the model computes some (RoPE's inv_freq): cast to
    bf16 by buffer_dtype, its rotary angles would come from rounded frequencies, off by radians at long
    positions. FSDP2 leaves every buffer alone."""
    if policy is None or policy.buffer_dtype is None or not computed_buffers(model):
        return policy
    return dataclasses.replace(policy, buffer_dtype=None)


def layer_units(model: nn.Module, layers: frozenset[type]) -> list[nn.Module]:
    """The modules that become FSDP2 units, in forward order: each stack layer, or its checkpoint wrapper."""
    wrapped = {id(wrapped_module(m)) for m in model.modules() if wrapped_module(m) is not m}
    layer_types = tuple(layers)
    return [m for m in model.modules() if isinstance(wrapped_module(m), layer_types) and id(m) not in wrapped]


def compile_layers(model: nn.Module, layers: frozenset[type], backend="inductor") -> None:
    """torch.compile every stack layer in place, before sharding (FSDP2's recommended order; FSDP1 needs
    use_orig_params). In place (`Module.compile`), the layers keep their class, so the wrap policy and
    activation checkpointing still find them. Compilation happens at each layer's first call (and again
    when the shapes change, as with per-batch padding, until torch marks them dynamic). `backend`: torch's
    (the tests count compiles through a backend of their own)."""
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, COMPILE_RECOMPILE_LIMIT)
    layer_types = tuple(layers)
    for module in model.modules():
        if isinstance(module, layer_types):
            module.compile(backend=backend)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units of a wrapped model, root first, for either backend."""
    if isinstance(model, FSDP):
        return [unit.module for unit in FSDP.fsdp_modules(model)]
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def unit_class_name(unit: nn.Module) -> str:
    """The class a unit wraps (T5Block), seen through a checkpoint wrapper and FSDP2's generated FSDPT5Block."""
    cls = type(wrapped_module(unit))
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule)).__name__


def log_fsdp_layout(model: nn.Module, precision: Precision) -> None:
    """One line at INFO (units by class, precision); the whole wrapped module tree at DEBUG (long for t5-3b)."""
    units = fsdp_units(model)
    tf32 = ", fp32 matmuls in TF32 (--tf32)" if precision.tf32 else ""
    if not units:
        name = precision.unwrapped_name
        how = "in fp32" if name == "fp32" else f"mixed precision {name} (fp32 weights and optimizer)"
        get_logger().info("no FSDP: one rank trains the model itself (--single_rank_fsdp false), %s%s", how, tf32)
        return
    by_class = Counter(unit_class_name(unit) for unit in units[1:])
    # FSDP1's strategy as it runs (NO_SHARD at world size 1, whatever was asked)
    strategy = "" if isinstance(model, FSDPModule) else f", {model.sharding_strategy.name}"
    get_logger().info(
        "FSDP%d: %d units (root + %s)%s, mixed precision %s%s",
        2 if isinstance(model, FSDPModule) else 1,
        len(units),
        " + ".join(f"{count} {name}" for name, count in by_class.items()),
        strategy,
        precision.name,
        tf32,
    )
    # LoRA's lora_A and lora_B, units of their own under FSDP1 in a partly frozen model
    adapters = by_class.get("Linear", 0) if any(not p.requires_grad for p in model.parameters()) else 0
    if not isinstance(model, FSDPModule) and adapters:
        get_logger().info(
            "FSDP1: %d of the units are LoRA adapters, each with its own all-gathers and reduce-scatters every "
            "step (a flat parameter cannot mix frozen and trained weights); --fsdp_version 2 keeps the adapters "
            "in their layers' units (docs/ecosystem.md: LoRA)",
            adapters,
        )
    get_logger().debug("FSDP model:\n%s", model)
