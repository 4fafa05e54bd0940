"""Model and tokenizer from a hub name (t5-small ... t5-11b) or a local folder."""

import os

import torch
from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer

from utils.errors import ConfigError
from utils.logging_utils import get_logger

HUB_HINT = (
    "Pass a local folder made by save_pretrained (e.g. the embedded data/tiny-t5), or a hub name such as "
    "t5-base on a machine that can reach huggingface.co (or has it in its HF cache)."
)


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


def load_model_and_tokenizer(
    model_name: str, on_meta: bool = False
) -> tuple[T5ForConditionalGeneration, T5Tokenizer]:
    """The pretrained model in host memory, or (on_meta) only its skeleton on the meta device, which
    allocates nothing: with rank-0-only loading the weights arrive later by broadcast."""
    if looks_like_local_path(model_name):
        check_local_model_dir(model_name)
        model_name = os.path.expanduser(model_name)
    try:
        # The KV cache only serves generation; with activation checkpointing it breaks recomputation
        # ("a different number of tensors was saved", PITFALLS item 4). It must be off at load time:
        # the encoder and decoder stacks keep their own copies of the config.
        if on_meta:
            with torch.device("meta"):
                model = T5ForConditionalGeneration(T5Config.from_pretrained(model_name, use_cache=False))
        else:
            model = T5ForConditionalGeneration.from_pretrained(model_name, use_cache=False)
        tokenizer = T5Tokenizer.from_pretrained(model_name)
    except OSError as err:
        raise ConfigError(f"could not load T5 model {model_name!r}: {str(err).rstrip('.')}. {HUB_HINT}") from None
    n_params = sum(p.numel() for p in model.parameters())
    get_logger().info("model %s: %.2fM parameters, vocab %d", model_name, n_params / 1e6, len(tokenizer))
    return model, tokenizer
