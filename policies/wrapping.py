"""Auto-wrap policies: which submodules become their own FSDP unit.

Each FSDP unit all-gathers its full parameters only while it runs, so peak parameter memory is about one
unit plus the root, not the whole model. With the transformer policy every T5Block is a unit; the shared
token embedding, used by the encoder, the decoder and the (tied) lm_head, stays in the root unit so all
three can reach it.
"""

import functools

from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
from transformers.models.t5.modeling_t5 import T5Block


def get_t5_wrap_policy():
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block})


def get_size_based_wrap_policy(min_num_params: int):
    return functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)


def get_wrap_policy(name: str, min_num_params: int):
    if name == "transformer":
        return get_t5_wrap_policy()
    if name == "size_based":
        return get_size_based_wrap_policy(min_num_params)
    raise ValueError(f"wrap policy must be transformer or size_based, not {name!r}")
