"""The model and tokenizer of a run, from a hub name (t5-small ... t5-11b) or a local folder.

With rank-0-only loading (--cpu_ram_efficient_loading) some or all ranks build only a skeleton on the
meta device, which allocates nothing; utils/model/rank0_loading.py fills it with rank 0's weights while or
after it is sharded. A run that resumes a checkpoint builds the skeleton on every rank: the checkpoint fills
the shards (utils/checkpoint/manager.py), so the pretrained weights are never read. A run started from a
full-model .pt (--resume file.pt) takes its weights from that file instead of the pretrained ones.
"""

import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer

from configs.errors import FAILURES, CheckpointError, ConfigError, error_summary
from configs.recipe import RecipeConfig
from utils.log import get_logger
from utils.observe.memory import MemoryBaseline, current_rss_bytes, peak_rss_bytes, reset_peak_rss

HUB_HINT = (
    "Pass a local folder made by save_pretrained (e.g. the embedded data/tiny-t5), or a hub name such as "
    "t5-base on a machine that can reach huggingface.co (or has it in its HF cache)."
)


@dataclass
class LoadedModel:
    model: nn.Module  # unwrapped; on the meta device where rank-0-only loading leaves it empty
    tokenizer: T5Tokenizer
    weights_source: str  # where rank-0-only loading reads the weights: the model, or a full .pt
    param_numel_total: int  # the model's parameters, tied weights once
    rss_before: int  # this rank's resident memory before the model was built (the peak was reset there)

    def memory_baseline(self) -> MemoryBaseline:
        """Call once the model is sharded (and a resumed checkpoint restored): this rank's RSS high-water mark
        since before the model was built, over the RSS then. Loading is not measured around from_pretrained
        alone, because transformers 5 memory-maps safetensors and the weights become resident only when FSDP
        copies and shards them."""
        return MemoryBaseline(peak_rss_bytes() - self.rss_before, self.param_numel_total)


def builds_on_meta(cpu_ram_efficient_loading: bool, fsdp_version: int, is_main: bool, restores: bool) -> bool:
    """Whether this rank builds only a skeleton: every rank when a checkpoint will fill the shards
    (`restores`); with rank-0-only loading, FSDP2's ranks but 0 (rank 0's model is broadcast after sharding)
    and every FSDP1 rank (each unit is filled as it is wrapped)."""
    return restores or (cpu_ram_efficient_loading and (fsdp_version == 1 or not is_main))


def model_config_overrides(recipe: RecipeConfig) -> dict:
    """The model-config fields the run sets: the attention kernel, and the dropout if given."""
    overrides = {"attn_implementation": recipe.attn_implementation}
    return overrides if recipe.dropout_rate is None else {**overrides, "dropout_rate": recipe.dropout_rate}


def load_model_for_run(
    model_name: str,
    on_meta: bool,
    weights_file: str | None,
    overrides: dict,
    tokenizer: T5Tokenizer,
) -> LoadedModel:
    """The unwrapped model, with the weights of `weights_file` (a full .pt) if given, and the model-config
    `overrides` (model_config_overrides); `tokenizer` (load_tokenizer, loaded once per run) goes with it."""
    reset_peak_rss()
    rss_before = current_rss_bytes()
    model = load_model(model_name, on_meta=on_meta, **overrides)
    get_logger().info(
        "model %s: %.2fM parameters, vocab %d",
        model_name, sum(p.numel() for p in model.parameters()) / 1e6, len(tokenizer),
    )  # fmt: skip
    if weights_file is not None and not on_meta:
        # A full state dict goes into the unwrapped model; FSDP then shards it (the tutorial's way).
        load_full_model_weights(model, weights_file)
    numel = sum(p.numel() for p in model.parameters())
    return LoadedModel(model, tokenizer, weights_file or model_name, numel, rss_before)


def looks_like_local_path(model_name: str) -> bool:
    """A path a user typed (not a hub id such as 't5-base' or 'google/flan-t5-base')."""
    return os.path.isabs(model_name) or model_name.startswith(("./", "../", "~")) or os.path.exists(model_name)


def check_local_model_dir(path: str) -> None:
    """Fail early, on every rank, with the fix, instead of a hub lookup of a mistyped path."""
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise ConfigError(f"model path {path!r} does not exist or is not a folder. {HUB_HINT}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model folder {path!r} has no config.json: it is not a saved transformers model. {HUB_HINT}"
        )


def load_tokenizer(model_name: str) -> T5Tokenizer:
    """The model's tokenizer alone (seconds), so the data can be read and checked before the model loads."""
    if looks_like_local_path(model_name):
        check_local_model_dir(model_name)
        model_name = os.path.expanduser(model_name)
    try:
        return T5Tokenizer.from_pretrained(model_name)
    except OSError as err:
        raise ConfigError(f"could not load T5 model {model_name!r}: {str(err).rstrip('.')}. {HUB_HINT}") from None


def load_model(model_name: str, on_meta: bool = False, **config_overrides) -> T5ForConditionalGeneration:
    """The pretrained model in host memory, or (on_meta) only its skeleton on the meta device;
    `config_overrides` replace fields of its config (dropout_rate, attn_implementation)."""
    if looks_like_local_path(model_name):
        check_local_model_dir(model_name)
        model_name = os.path.expanduser(model_name)
    try:
        # The KV cache only serves generation; with activation checkpointing it breaks recomputation
        # ("a different number of tensors was saved", docs/pitfalls.md #4). It must be off at load time:
        # the encoder and decoder stacks keep their own copies of the config.
        if on_meta:
            with torch.device("meta"):
                config = T5Config.from_pretrained(model_name, use_cache=False, **config_overrides)
                model = T5ForConditionalGeneration(config)
        else:
            model = T5ForConditionalGeneration.from_pretrained(model_name, use_cache=False, **config_overrides)
    except OSError as err:
        raise ConfigError(f"could not load T5 model {model_name!r}: {str(err).rstrip('.')}. {HUB_HINT}") from None
    return model


def load_full_model_state(path: str) -> dict:
    """A saved .pt as a plain state dict; weights_only=True: only tensors are unpickled, never objects.
    Memory-mapped: the tensors are read from the file as they are copied, and the ranks of one host share
    its pages."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def load_full_model_weights(model: nn.Module, file: str) -> None:
    """A full state dict (.pt) into the *unwrapped* model, before FSDP wraps it. Strict: every key must match."""
    try:
        model.load_state_dict(load_full_model_state(file), strict=True)
    except FAILURES as err:  # any failure means this file cannot seed this model
        raise CheckpointError(
            f"cannot load model weights from {file}: {error_summary(err)}. It is corrupt or was saved from "
            "another model shape; pick another checkpoint or --model_name."
        ) from None
