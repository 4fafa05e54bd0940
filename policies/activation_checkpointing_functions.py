"""Activation checkpointing of T5Blocks inside their FSDP units.

Non-reentrant checkpointing (torch.utils.checkpoint with use_reentrant=False) works with FSDP's hooks and
with inputs that do not require grad. The old `offload_to_cpu` keyword of checkpoint_wrapper is not accepted
any more and would be forwarded to T5Block.forward (docs/pitfalls.md #4), so it is not passed. T5 must run with
`use_cache=False`, or the recomputed forward saves a different number of tensors and backward fails.
"""

import functools

from torch import nn
from transformers.models.t5.modeling_t5 import T5Block

from policies.private_api import CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper

non_reentrant_wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def apply_fsdp_checkpointing(model: nn.Module) -> None:
    """Wrap every T5Block of `model` (an FSDP-wrapped T5) in a non-reentrant checkpoint wrapper, in place."""
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=non_reentrant_wrapper, check_fn=lambda module: isinstance(module, T5Block)
    )
