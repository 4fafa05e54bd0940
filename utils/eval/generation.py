"""Summaries from the sharded model, on every rank at once, for either FSDP backend.

`generate` (T5's, BART's) calls the encoder directly, not the model's forward, so FSDP never gathers the root
unit's parameters (the shared embedding, the final norms, the tied lm_head) and generation fails on shards
(docs/pitfalls.md #18). The root unit is therefore gathered around the whole call: FSDP1 with
`summon_full_params(recurse=False)`, FSDP2 by registering `generate` as a forward method at wrap time.

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
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from policies.private_api import fsdp1_units_kept_unsharded, fsdp2_units_kept_unsharded
from utils.distributed.launcher import ranks_on_this_host
from utils.distributed.process_group import any_rank
from utils.observe.memory import available_memory, param_numel_whole


def generate(model: nn.Module, prompts: dict, generation: dict) -> torch.Tensor:
    """Token ids of the outputs for one batch's `prompts` (the task's prompts of a batch on the model's device,
    utils/task.py), with `generation` (the task's generation_kwargs) as generate's settings. Collective: every
    rank calls it the same number of times."""
    kwargs = {
        **prompts,
        "synced_gpus": dist.get_world_size() > 1,
        "use_cache": True,  # the model is loaded with use_cache=False for training; decoding wants the cache
        **generation,
    }
    with torch.no_grad():
        if isinstance(model, FSDP):
            with FSDP.summon_full_params(model, recurse=False, writeback=False), _fsdp1_compute_dtype(model):
                return model.module.generate(**kwargs)
        # FSDP2: a registered forward method; one rank's unwrapped model: under autocast (utils/fsdp/shard.py)
        return model.generate(**kwargs)


def stop_token_ids(model: nn.Module, tokenizer) -> list[int]:
    """The ids generation ends a row at: the model's generation config's EOS (one, or several: a chat model's
    end of turn too) and the tokenizer's."""
    own = model.module if isinstance(model, FSDP) else model
    return stops_of(getattr(own, "generation_config", None), tokenizer)


def stops_of(generation_config, tokenizer) -> list[int]:
    """A generation config's EOS ids (none, one or several) and the tokenizer's (None: none), sorted."""
    ids = getattr(generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    own = getattr(tokenizer, "eos_token_id", None)
    return sorted({*ids, *([] if own is None else [own])})


def _fsdp1_compute_dtype(model: FSDP):
    """The summoned root parameters come back in full precision, and the root's forward, which casts to the
    compute dtype, is skipped: autocast to the policy's compute dtype keeps the fp32 root's matmuls (the
    embedding's output, the lm_head) compatible with the bf16/fp16 layer units, which cast their own inputs
    (policies/mixed_precision.py, docs/pitfalls.md #43). Nothing to do in fp32."""
    dtype = model.mixed_precision.param_dtype
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=model.compute_device.type, dtype=dtype)


def keep_gathered(model: nn.Module, setting: str, compute_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether generation keeps every unit gathered for the whole evaluation (--gather_for_generation): `setting`
    true or false, or auto: with more than one rank, where the whole model's parameters in `compute_dtype` take
    at most half of every rank's free device memory (the other half: the decoding cache, the activations; on
    CPU the host's, shared by its ranks). Collective: every rank must decide the same, or the ranks'
    all-gathers would no longer pair up."""
    if setting != "auto":
        return setting == "true"
    if dist.get_world_size() == 1:
        return False  # nothing is sharded: nothing to gather
    needed = param_numel_whole(model) * compute_dtype.itemsize
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        available = available_memory()
        free = None if available is None else available // ranks_on_this_host(dist.get_world_size())
    return not any_rank(free is None or needed > free // 2, device)


@contextlib.contextmanager
def gathered_for_generation(model: nn.Module, keep: bool):
    """Inside, with `keep`: each FSDP unit stays gathered from its first forward on; all are freed at the end."""
    if not keep or not isinstance(model, FSDP | FSDPModule):  # one rank's unwrapped model: nothing to gather
        yield
        return
    kept = fsdp1_units_kept_unsharded if isinstance(model, FSDP) else fsdp2_units_kept_unsharded
    with kept(model):
        yield
