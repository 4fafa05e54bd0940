"""Auto-wrap policies: which submodules become their own FSDP unit.

Each FSDP unit all-gathers its full parameters only while it runs, so peak parameter memory is about one
unit plus the root, not the whole model. With the transformer policy every layer of the encoder and decoder
stacks is a unit (for T5 each T5Block; `layer_classes` reads them from the model); the shared token
embedding, used by the encoder, the decoder and the (tied) lm_head, stays in the root unit so all three can
reach it.
"""

import functools
from collections import Counter

from torch import nn
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy


def layer_classes(model: nn.Module) -> frozenset[type]:
    """The classes of the layers the encoder and decoder stacks repeat: T5's T5Block, mT5's MT5Block, BART's
    BartEncoderLayer and BartDecoderLayer. They are the model's own word for them (`_no_split_modules`, which
    accelerate wraps by) where it has one, kept to the classes that are a stack's elements (mBART also names
    its attention); else (PEGASUS names none) the classes of the outermost module lists' elements."""
    stacked = {type(layer) for layer in outermost_list_elements(model)}
    declared = set(getattr(model, "_no_split_modules", None) or ())
    named = {cls for cls in stacked if cls.__name__ in declared}
    return frozenset(named or stacked)


def outermost_list_elements(model: nn.Module) -> list[nn.Module]:
    """The elements of every nn.ModuleList not inside another one's element (a stack's layers, not the
    sub-layers a T5Block keeps in a list of its own)."""
    elements, inside = [], set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and id(module) not in inside:
            elements.extend(module)
            inside.update(id(sub) for element in module for sub in element.modules())
    return elements


def get_transformer_wrap_policy(model: nn.Module):
    """Each stack layer a unit (for T5: transformer_layer_cls={T5Block}, the tutorial's policy)."""
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(layer_classes(model)))


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
        policy = get_transformer_wrap_policy(model)
    elif name == "size_based":
        ties = modules_holding_tied_parameters(model)
        policy = functools.partial(_size_based_keeping_ties, min_num_params=min_num_params, tied_modules=ties)
    else:
        raise ValueError(f"wrap policy must be transformer or size_based, not {name!r}")
    trains = {p.requires_grad for p in model.parameters()}
    return functools.partial(_adapters_apart, policy=policy) if trains == {True, False} else policy
