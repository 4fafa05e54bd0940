"""Auto-wrap policies: which submodules become their own FSDP unit.

Each FSDP unit all-gathers its full parameters only while it runs, so peak parameter memory is about one
unit plus the root, not the whole model. With the transformer policy every T5Block is a unit; the shared
token embedding, used by the encoder, the decoder and the (tied) lm_head, stays in the root unit so all
three can reach it.
"""

import functools
from collections import Counter

from torch import nn
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
from transformers.models.t5.modeling_t5 import T5Block


def get_t5_wrap_policy():
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block})


def modules_holding_tied_parameters(model: nn.Module) -> set[int]:
    """ids of the modules whose subtree holds a parameter that more than one module owns (a tie).

    T5 ties `shared` (= encoder/decoder embed_tokens) to `lm_head` (t5 v1.0 checkpoints): the modules
    holding them are shared, lm_head, both T5Stacks and the model itself.
    """
    owners = Counter(id(p) for module in model.modules() for p in module.parameters(recurse=False))
    tied = {param_id for param_id, count in owners.items() if count > 1}
    return {id(module) for module in model.modules() if any(id(p) in tied for p in module.parameters())}


def _size_based_keeping_ties(module, recurse, nonwrapped_numel, *, min_num_params, tied_modules):
    # recurse=False asks "make this module a unit?": never for a module holding a tied parameter. In a
    # unit apart from its twin the tie breaks and training silently goes wrong (measured in
    # tests/test_fsdp_numerics.py); tied parameters stay in the root unit, which holds everything.
    if not recurse and id(module) in tied_modules:
        return False
    return size_based_auto_wrap_policy(module, recurse, nonwrapped_numel, min_num_params=min_num_params)


def get_size_based_wrap_policy(model: nn.Module, min_num_params: int):
    return functools.partial(
        _size_based_keeping_ties,
        min_num_params=min_num_params,
        tied_modules=modules_holding_tied_parameters(model),
    )


def _adapters_apart(module, recurse, nonwrapped_numel, *, policy):
    # A module whose own parameters all train, in a model that is otherwise frozen (LoRA's lora_A and
    # lora_B), becomes a unit of its own: a FlatParameter must not mix frozen and trained weights.
    if recurse:
        return True
    own = list(module.parameters(recurse=False))
    if own and all(p.requires_grad for p in own):
        return True
    return policy(module, recurse, nonwrapped_numel)


def get_wrap_policy(name: str, model: nn.Module, min_num_params: int):
    """The named policy; when part of the model is frozen (--peft lora), with the trained modules (the
    adapters) wrapped apart, so FSDP1 needs no use_orig_params and shards each adapter over every rank."""
    if name == "transformer":
        policy = get_t5_wrap_policy()
    elif name == "size_based":
        policy = get_size_based_wrap_policy(model, min_num_params)
    else:
        raise ValueError(f"wrap policy must be transformer or size_based, not {name!r}")
    trains = {p.requires_grad for p in model.parameters()}
    return functools.partial(_adapters_apart, policy=policy) if trains == {True, False} else policy
