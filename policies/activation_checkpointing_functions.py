"""Activation checkpointing of the stack layers (T5Blocks for T5) inside their FSDP units.

Two scopes (--activation_checkpointing_scope). `blocks`: a layer keeps only its inputs and recomputes its whole
forward in backward. `ops` (torch's selective checkpointing): a layer keeps the outputs of its matmuls and
attention kernels and recomputes only the cheap ops between them (norms, activations, softmax, dropout), so
backward redoes a few elementwise passes instead of the layer's matmuls, for part of the memory.

Non-reentrant checkpointing works with FSDP's hooks and with inputs that do not require grad; the model must run
with `use_cache=False`, and the wrapper takes no `offload_to_cpu` (docs/pitfalls.md #4). The recompute starts
from the forward's random state (the checkpoint's preserve_rng_state), so a recomputed dropout draws the same
mask.
"""

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from policies.private_api import (
    CheckpointImpl,
    TorchDispatchMode,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

aten = torch.ops.aten

# The fused attention kernels and the position of `dropout_p` in their schemas. With dropout a kernel draws
# random numbers: kept, it would not draw them again in the recompute, and every later dropout of the layer
# would get another mask than in the forward (docs/pitfalls.md #50). So it is kept only without dropout.
# (SDPA's math fallback is no kernel: it reaches the policy as its matmuls, softmax and dropout.)
ATTENTION_DROPOUT_POSITION = {
    aten._scaled_dot_product_flash_attention.default: 3,
    aten._scaled_dot_product_flash_attention_for_cpu.default: 3,
    aten._scaled_dot_product_efficient_attention.default: 5,
    aten._scaled_dot_product_cudnn_attention.default: 5,
    aten._scaled_dot_product_fused_attention_overrideable.default: 4,
}

# What the `ops` scope keeps: the ops whose recompute would cost a pass of matmuls (a Linear is mm or addmm,
# attention without a fused kernel bmm or baddbmm, float8's _scaled_mm), the attention kernels, FlexAttention,
# and `max`, the amax from which float8 training computes its scales (small; kept so that the recompute
# does not reduce again). torchtitan's per-op policy keeps the same kinds of ops; it also recomputes every
# second mm to save more memory, which this policy does not.
KEPT_OPS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten._scaled_mm.default,
        aten.max.default,
        torch.ops.higher_order.flex_attention,
        *ATTENTION_DROPOUT_POSITION,
    }
)

# Functions that see each output the `ops` scope keeps, while they are registered (kept_outputs_seen_by):
# torch keeps those outputs in its own storage, out of sight of autograd's saved-tensor hooks.
_KEPT_OUTPUT_WATCHERS: list[Callable[[torch.Tensor], None]] = []


def keeps_output(op, args: tuple, kwargs: dict) -> bool:
    """Whether the `ops` scope keeps the output of `op` called with `args` and `kwargs`."""
    if op not in KEPT_OPS:
        return False
    position = ATTENTION_DROPOUT_POSITION.get(op)
    if position is None:
        return True
    dropout = kwargs.get("dropout_p", args[position] if len(args) > position else 0.0)
    return dropout == 0.0


def _per_op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ARG001 - torch's signature
    # MUST_SAVE: torch.compile's partitioner may not recompute these either
    return CheckpointPolicy.MUST_SAVE if keeps_output(op, args, kwargs) else CheckpointPolicy.PREFER_RECOMPUTE


class _KeptOutputsSeen(TorchDispatchMode):
    """Entered above torch's caching mode in a layer's forward: hands each output the policy keeps to the
    watchers."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Like torch's caching mode: what torch compiles inside (eager FlexAttention does) is not traced
        through it."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ARG002 - torch's signature
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        if keeps_output(func, args, kwargs):
            for tensor in output if isinstance(output, tuple | list) else (output,):
                if isinstance(tensor, torch.Tensor):  # a kernel's outputs may include None and integers
                    for watch in _KEPT_OUTPUT_WATCHERS:
                        watch(tensor)
        return output


# FlexAttention is a higher-order op, which reaches a dispatch mode only through a rule of that mode's own
# (torch has one for its caching mode): this one passes it on like any op.
@torch.ops.higher_order.flex_attention.py_impl(_KeptOutputsSeen)
def _flex_attention_seen(mode, *args, **kwargs):
    return mode.__torch_dispatch__(torch.ops.higher_order.flex_attention, (), args, kwargs)


@contextlib.contextmanager
def _watched(forward_context):
    with forward_context, _KeptOutputsSeen():
        yield


def per_op_contexts():
    """The `context_fn` of a layer's checkpoint under the `ops` scope: torch's selective-checkpoint contexts for
    the forward and the recompute, the forward's watched while a watcher is registered."""
    forward, recompute = create_selective_checkpoint_contexts(_per_op_policy)
    return (_watched(forward) if _KEPT_OUTPUT_WATCHERS else forward), recompute


@contextlib.contextmanager
def kept_outputs_seen_by(watch: Callable[[torch.Tensor], None]):
    """Inside, `watch(tensor)` is called with each output the `ops` scope keeps for backward."""
    _KEPT_OUTPUT_WATCHERS.append(watch)
    try:
        yield
    finally:
        _KEPT_OUTPUT_WATCHERS.remove(watch)


CHECKPOINT_WRAPPERS = {
    "blocks": functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
    "ops": functools.partial(
        checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=per_op_contexts
    ),
}


def apply_fsdp_checkpointing(model: nn.Module, layers: frozenset[type], scope: str = "blocks") -> None:
    """Wrap every module of `model` of the classes `layers` (policies/wrapping.py: layer_classes; T5Block for
    T5) in a non-reentrant checkpoint wrapper of `scope` ("blocks" or "ops"), in place; FSDP-wrapped or not."""
    layer_types = tuple(layers)
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=CHECKPOINT_WRAPPERS[scope],
        check_fn=lambda module: isinstance(module, layer_types),
    )
