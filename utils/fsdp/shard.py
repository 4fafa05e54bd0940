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
# At world size 1 FSDP1 runs NO_SHARD whatever strategy it is given, and warns; the layout line
# (Parallelism.describe) names the strategy it runs instead (seen on one GPU: the warning came raw, the log did
# not say it).
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


def unit_class_name(unit: nn.Module) -> str:
    """The class a unit wraps (T5Block), seen through a checkpoint wrapper and FSDP2's generated FSDPT5Block."""
    cls = type(wrapped_module(unit))
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule)).__name__


# FSDP1's state dicts warn at every use, about torch internals nobody here can act on: its optimizer-state and
# sharding utilities ask the process group for its device through a deprecated helper (on a gloo group that
# helper also warns that it has to guess), its sharded state dicts are ShardedTensors, deprecated in favour of
# FSDP2's DTensors, and FSDP.state_dict_type is deprecated in favour of get_state_dict (the tutorial's FSDP1
# full-state path uses it on purpose; --fsdp_version 2 is the replacement). The checkpoint manager's saves,
# loads and exports, and the entry points here and in hf_export.py that build or load such state dicts, ignore
# exactly these (`fsdp1_state_dict_warnings_ignored`), and nothing else; the per-tensor helpers they call
# (local_rows, fill_from_full, ...) run inside them, so they do not enter the block again for every tensor.
FSDP1_STATE_DICT_WARNINGS = (
    (UserWarning, "`_get_pg_default_device` will be deprecated"),
    (UserWarning, "Multiple backends are registered with this ProcessGroup"),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor"),
    (FutureWarning, "FSDP.state_dict_type() and FSDP.set_state_dict_type() are being deprecated"),
    # NO_SHARD (asked for, or FSDP1's choice at world size 1): a sharded state dict holds whole tensors,
    # which local_rows and fill_from_full take as they are
    # ("will be returned" when saving, "willbe returned" when loading)
    (UserWarning, "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will"),
)


def fsdp1_state_dict_warnings_ignored():
    return warnings_ignored(*FSDP1_STATE_DICT_WARNINGS)
