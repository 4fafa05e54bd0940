"""Activation checkpointing of the stack layers (T5Blocks for T5) inside their FSDP units.

Non-reentrant checkpointing works with FSDP's hooks and with inputs that do not require grad; the model must run
with `use_cache=False`, and the wrapper takes no `offload_to_cpu` (docs/pitfalls.md #4).
"""

import functools

from torch import nn

from policies.private_api import CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper

non_reentrant_wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def apply_fsdp_checkpointing(model: nn.Module, layers: frozenset[type]) -> None:
    """Wrap every module of `model` of the classes `layers` (policies/wrapping.py: layer_classes; T5Block for
    T5) in a non-reentrant checkpoint wrapper, in place; FSDP-wrapped or not."""
    layer_types = tuple(layers)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=non_reentrant_wrapper, check_fn=lambda module: isinstance(module, layer_types)
    )
