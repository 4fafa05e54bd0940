"""Summaries from the sharded model, on every rank at once, for either FSDP backend.

`generate` (T5's, BART's) calls the encoder directly, not the model's forward, so FSDP never gathers the root
unit's parameters (the shared embedding, the final norms, the tied lm_head) and generation fails on shards
(docs/pitfalls.md #18). The root unit is therefore gathered around the whole call (utils/fsdp/parallelism.py:
FSDP1 with `summon_full_params(recurse=False)`, FSDP2 by registering `generate` as a forward method at wrap
time).

Each layer unit (T5Block) is, by default where the whole model fits (--gather_for_generation, `keep_gathered`),
gathered at its first forward and kept until the evaluation ends (`gathered_for_generation`): one all-gather
per unit and evaluation. Otherwise it is gathered only while it runs and freed after, as in training: a rank
then holds at most the root unit and about one layer unit unsharded, never the whole model, at the price of
one all-gather per decoder unit and generated token.

Ranks that finish decoding early must keep joining the all-gathers of the others: `synced_gpus=True`
makes every rank step until all are done. The evaluation sampler gives every rank the same number of
batches (repeats padded in and ignored when scoring).
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from utils.distributed.launcher import ranks_on_this_host
from utils.distributed.process_group import any_rank
from utils.fsdp.parallelism import Parallelism
from utils.observe.memory import available_memory


def generate(model: nn.Module, parallelism: Parallelism, prompts: dict, generation: dict) -> torch.Tensor:
    """Token ids of the outputs for one batch's `prompts` (the spec's prompts of a batch on the model's device,
    utils/spec.py), with `generation` (the spec's generation_kwargs) as generate's settings; `parallelism`
    gathers the root unit around the call. Collective: every rank calls it the same number of times."""
    kwargs = {
        **prompts,
        "synced_gpus": dist.get_world_size() > 1,
        "use_cache": True,  # the model is loaded with use_cache=False for training; decoding wants the cache
        **generation,
    }
    with torch.no_grad():
        return parallelism.generate(model, kwargs)


def stop_token_ids(model: nn.Module, parallelism: Parallelism, tokenizer) -> list[int]:
    """The ids generation ends a row at: the model's generation config's EOS (one, or several: a chat model's
    end of turn too) and the tokenizer's."""
    return stops_of(getattr(parallelism.inner(model), "generation_config", None), tokenizer)


def stops_of(generation_config, tokenizer) -> list[int]:
    """A generation config's EOS ids (none, one or several) and the tokenizer's (None: none), sorted."""
    ids = getattr(generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    own = getattr(tokenizer, "eos_token_id", None)
    return sorted({*ids, *([] if own is None else [own])})


def keep_gathered(
    model: nn.Module, parallelism: Parallelism, setting: str, compute_dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether generation keeps every unit gathered for the whole evaluation (--gather_for_generation): `setting`
    true or false, or auto: with more than one rank, where the whole model's parameters in `compute_dtype` take
    at most half of every rank's free device memory (the other half: the decoding cache, the activations; on
    CPU the host's, shared by its ranks). Collective: every rank must decide the same, or the ranks'
    all-gathers would no longer pair up."""
    if setting != "auto":
        return setting == "true"
    if dist.get_world_size() == 1:
        return False  # nothing is sharded: nothing to gather
    needed = parallelism.param_numel_whole(model) * compute_dtype.itemsize
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        available = available_memory()
        free = None if available is None else available // ranks_on_this_host(dist.get_world_size())
    return not any_rank(free is None or needed > free // 2, device)


def gathered_for_generation(model: nn.Module, parallelism: Parallelism, keep: bool):
    """Inside, with `keep`: each FSDP unit stays gathered from its first forward on; all are freed at the end."""
    return parallelism.kept_gathered(model) if keep else contextlib.nullcontext()
