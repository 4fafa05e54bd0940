"""The model as a Hugging Face folder: save_pretrained (safetensors) plus the tokenizer.

`T5ForConditionalGeneration.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)` load it;
no pickles, no remote code. Written at the end of a finished run from the live model, or afterwards from any
checkpoint by scripts/convert_checkpoint_to_hf.py (one process, no GPU, no process group).
"""

import copy
import os

import torch
import torch.distributed.checkpoint as dcp
from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer

from configs.errors import FAILURES, CheckpointError, UserError, error_summary
from configs.lora import LoraConfig
from utils.checkpoint.safe_dcp import SafeFileSystemReader
from utils.checkpoint.start import read_train_state
from utils.eval.generation import GENERATION_KEYS
from utils.files import atomic_path
from utils.layout import FULL, MODEL_FILE, STATE_FILE, TOKENIZER_DIR
from utils.model.loading import load_full_model_state
from utils.model.lora import apply_lora


def write_hf_folder(state_dict: dict, model_config, tokenizer, folder: str) -> None:
    """Save a plain state dict as a transformers folder, atomically (an existing folder is replaced whole).

    The model skeleton lives on the meta device: no second copy of the weights is allocated.
    """
    # Training runs without the KV cache (activation checkpointing needs that); whoever loads the folder
    # generates, which wants it.
    model_config = copy.deepcopy(model_config)
    model_config.use_cache = True
    with torch.device("meta"):
        skeleton = T5ForConditionalGeneration(model_config)
    # generation_config.json gets the run's generation settings, so `generate()` summarises as evaluated.
    summarization = (getattr(model_config, "task_specific_params", None) or {}).get("summarization", {})
    generation = {key: summarization[key] for key in GENERATION_KEYS if key in summarization}
    if generation.get("num_beams", 1) == 1:
        generation.pop("length_penalty", None)  # a beam-search setting; transformers refuses it otherwise
    skeleton.generation_config.update(use_cache=True, **generation)
    with atomic_path(folder) as tmp:
        skeleton.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)


def write_lora_folders(
    state_dict: dict, model_config, tokenizer, lora: LoraConfig, base_model: str, folders: tuple
) -> None:
    """Rank 0: the adapter folder (PEFT save_pretrained + tokenizer) and, with --merge_lora, the merged
    model as a plain transformers folder. `folders`: (adapter folder, merged folder)."""
    adapter_folder, merged_folder = folders
    config = copy.deepcopy(model_config)
    config.use_cache = True
    with torch.device("meta"):  # no random init of a model about to be overwritten
        peft_model = apply_lora(T5ForConditionalGeneration(config), lora, base_model)
    peft_model.to_empty(device="cpu")  # keeps parameter identity: the tied embedding stays one tensor
    peft_model.load_state_dict(state_dict, strict=True)
    # PEFT names the base after the skeleton's config, which has no name: PeftModel.from_pretrained reads it.
    peft_model.peft_config["default"].base_model_name_or_path = base_model
    with atomic_path(adapter_folder) as tmp:
        peft_model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    if lora.merge_lora:
        merged = peft_model.merge_and_unload()
        write_hf_folder(merged.state_dict(), model_config, tokenizer, merged_folder)


def checkpoint_weights(checkpoint: str, model_config: T5Config) -> dict:
    """A checkpoint's model state dict as plain CPU tensors named like the unwrapped model's parameters.

    A SHARDED_STATE_DICT checkpoint written by any number of ranks is read whole (no process group).
    """
    if read_train_state(checkpoint)["checkpoint_type"] == FULL:
        return load_full_model_state(os.path.join(checkpoint, MODEL_FILE))
    # A template with the full shapes: DCP reads every rank's shards into it.
    template = {"model": T5ForConditionalGeneration(model_config).state_dict()}
    dcp.load(template, storage_reader=SafeFileSystemReader(checkpoint), no_dist=True)
    return template["model"]


def convert_checkpoint(checkpoint: str, output: str) -> str:
    """Write the HF folder `output` from a checkpoint folder (its weights, model config and tokenizer)."""
    if not os.path.isfile(os.path.join(checkpoint, STATE_FILE)):
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint folder (no {STATE_FILE})")
    config = T5Config.from_pretrained(checkpoint)
    tokenizer = T5Tokenizer.from_pretrained(os.path.join(checkpoint, TOKENIZER_DIR))
    try:
        weights = checkpoint_weights(checkpoint, config)
    except UserError:
        raise
    except FAILURES as err:  # one message naming the checkpoint
        raise CheckpointError(f"cannot read the weights of {checkpoint}: {error_summary(err)}") from None
    write_hf_folder(weights, config, tokenizer, output)
    return output
