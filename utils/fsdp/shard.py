"""The pieces the three parallelisms (utils/fsdp/parallelism.py) wrap with: which modules become units, compiling
them, the mixed-precision policy FSDP1 is given, and the warnings of FSDP that nobody here can act on.
"""

import dataclasses

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecision

from configs.fsdp import TESTED_LAYER_CLASSES
from policies.private_api import wrapped_module
from utils.base.log import warnings_ignored
from utils.model.loading import computed_buffers

# FSDP2 warns, on every forward of every layer unit, that it returned a view whose in-place modification would
# skip its pre-backward hook; no family loses a gradient that way (the FSDP2 parity tests of each family).
FSDP2_VIEW_WARNINGS = tuple(
    (UserWarning, f"FSDP2-wrapped module (FSDP{name}) returned a view tensor")
    for name in ("CheckpointWrapper", *TESTED_LAYER_CLASSES)
)

# NO_SHARD, deprecated in favour of DDP, is one of the tutorial's strategies, kept for comparisons.
FSDP1_NO_SHARD_WARNING = (FutureWarning, "The `NO_SHARD` sharding strategy is deprecated")
# At world size 1 FSDP1 runs NO_SHARD whatever it is given; the layout line (Parallelism.describe) says so.
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


# The graphs of the one forward the stack layers share in a run (docs/throughput.md: 16 for T5); dynamo's default
# limit (8) is spent by training and the first validation, past which it runs every new variant uncompiled.
COMPILE_RECOMPILE_LIMIT = 32


def computed_buffers_kept(policy: MixedPrecision, model: nn.Module) -> MixedPrecision:
    """FSDP1's policy, but leaving the buffers alone where the model computes some (RoPE's inv_freq): cast to
    bf16 by buffer_dtype, its rotary angles would come from rounded frequencies, off by radians at long
    positions. FSDP2 leaves every buffer alone."""
    return dataclasses.replace(policy, buffer_dtype=None) if computed_buffers(model) else policy


def layer_units(model: nn.Module, layers: frozenset[type]) -> list[nn.Module]:
    """The modules that become FSDP2 units, in forward order: each stack layer, or its checkpoint wrapper."""
    wrapped = {id(wrapped_module(m)) for m in model.modules() if wrapped_module(m) is not m}
    layer_types = tuple(layers)
    return [m for m in model.modules() if isinstance(wrapped_module(m), layer_types) and id(m) not in wrapped]


def compile_layers(model: nn.Module, layers: frozenset[type], backend="inductor") -> None:
    """torch.compile every stack layer in place, before sharding (FSDP2's recommended order; FSDP1 needs
    use_orig_params): in place (`Module.compile`), the layers keep their class, so the wrap policy and
    activation checkpointing still find them. `backend`: the tests count compiles through one of their own."""
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, COMPILE_RECOMPILE_LIMIT)
    layer_types = tuple(layers)
    for module in model.modules():
        if isinstance(module, layer_types):
            module.compile(backend=backend)


def unit_class_name(unit: nn.Module) -> str:
    """The class a unit wraps (T5Block), seen through a checkpoint wrapper and FSDP2's generated FSDPT5Block."""
    cls = type(wrapped_module(unit))
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule)).__name__


# FSDP1's state dicts warn at every use about torch internals nobody here can act on (a deprecated helper that
# finds the group's device, ShardedTensor, FSDP.state_dict_type: --fsdp_version 2 is the replacement). Ignored
# around the entry points that build or load them, not per tensor (the helpers they call run inside).
FSDP1_STATE_DICT_WARNINGS = (
    (UserWarning, "`_get_pg_default_device` will be deprecated"),
    (UserWarning, "Multiple backends are registered with this ProcessGroup"),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor"),
    (FutureWarning, "FSDP.state_dict_type() and FSDP.set_state_dict_type() are being deprecated"),
    # NO_SHARD: a sharded state dict holds whole tensors, which local_rows and fill_from_full take as they are
    # (the message goes on "will be returned" when saving, "willbe returned" when loading)
    (UserWarning, "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will"),
)


def fsdp1_state_dict_warnings_ignored():
    return warnings_ignored(*FSDP1_STATE_DICT_WARNINGS)
