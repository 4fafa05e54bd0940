"""Summaries from the sharded model, on every rank at once, for either FSDP backend.

`generate` (T5's, BART's) calls the encoder directly, not the model's forward, so FSDP never gathers the root
unit's parameters (the shared embedding, the final norms, the tied lm_head) and generation fails on shards
(docs/pitfalls.md #18). The root unit is therefore gathered around the whole call: FSDP1 with
`summon_full_params(recurse=False)`, FSDP2 by registering `generate` as a forward method at wrap time. Each
layer unit (T5Block) is still gathered only while it runs and freed after, so a rank holds at most the root
unit and about one layer unit unsharded at any time, never the whole model.

Ranks that finish decoding early must keep joining the all-gathers of the others: `synced_gpus=True`
makes every rank step until all are done. The evaluation sampler gives every rank the same number of
batches (repeats padded in and ignored when scoring).
"""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from configs.data import DataConfig
from configs.evaluation import EvalConfig

GENERATION_KEYS = ("num_beams", "max_new_tokens", "length_penalty", "no_repeat_ngram_size", "do_sample")


def generation_kwargs(evaluation: EvalConfig, max_target_length: int) -> dict:
    """The keyword arguments of `generate` for these settings (also saved as hf_model/generation_config.json).
    Summaries are as long as the model was trained to write unless --max_new_tokens says otherwise."""
    return {
        "num_beams": evaluation.num_beams,
        "max_new_tokens": evaluation.max_new_tokens or max_target_length,
        "length_penalty": evaluation.length_penalty,
        "no_repeat_ngram_size": evaluation.no_repeat_ngram_size,
        "do_sample": False,
    }


def summarization_params(data: DataConfig, evaluation: EvalConfig, cleaning: str) -> dict:
    """How this run prepares a source text (its cleaning, named as in summarization_dataset.CLEANINGS, the
    prefix, the length) and generates its output. Saved in the model config's
    `task_specific_params["summarization"]` (where T5's published checkpoints keep theirs), so checkpoints and
    hf_model/ carry it and scripts/summarize.py needs no flags."""
    return {
        "cleaning": cleaning,
        "prefix": data.source_prefix,
        "max_source_length": data.max_source_length,
        **generation_kwargs(evaluation, data.max_target_length),
    }


def generate(model: nn.Module, batch: dict, generation: dict) -> torch.Tensor:
    """Token ids of the summaries of one batch (on the model's device), with `generation` (generation_kwargs)
    as generate's settings. Collective: every rank calls it the same number of times."""
    kwargs = {
        "input_ids": batch["source_ids"],
        "attention_mask": batch["source_mask"],
        "synced_gpus": dist.get_world_size() > 1,
        "use_cache": True,  # the model is loaded with use_cache=False for training; decoding wants the cache
        **generation,
    }
    with torch.no_grad():
        if isinstance(model, FSDP):
            with FSDP.summon_full_params(model, recurse=False, writeback=False), _fsdp1_compute_dtype(model):
                return model.module.generate(**kwargs)
        return model.generate(**kwargs)  # FSDP2: a registered forward method (utils/fsdp/shard.py)


def _fsdp1_compute_dtype(model: FSDP):
    """The summoned root parameters come back in full precision, and the root's forward, which casts to the
    compute dtype, is skipped: autocast to the policy's compute dtype keeps the fp32 root's matmuls (the
    embedding's output, the lm_head) compatible with the bf16/fp16 layer units, which cast their own inputs
    (policies/mixed_precision.py, docs/pitfalls.md #43). Nothing to do in fp32."""
    dtype = model.mixed_precision.param_dtype
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=model.compute_device.type, dtype=dtype)
