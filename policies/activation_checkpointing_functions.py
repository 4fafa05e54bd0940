"""Activation checkpointing of the stack layers (T5Blocks for T5) inside their FSDP units.

Non-reentrant checkpointing (torch.utils.checkpoint with use_reentrant=False) works with FSDP's hooks and
with inputs that do not require grad. The old `offload_to_cpu` keyword of checkpoint_wrapper is not accepted
any more and would be forwarded to the layer's forward (docs/pitfalls.md #4), so it is not passed. The model must
run with `use_cache=False`, or the recomputed forward saves a different number of tensors and backward fails.
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
