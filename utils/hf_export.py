"""The final model as a Hugging Face folder: save_pretrained (safetensors) plus the tokenizer.

`T5ForConditionalGeneration.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)` load it;
no pickles, no remote code.
"""

import os
import shutil

import torch
from torch import nn
from transformers import T5ForConditionalGeneration

from utils.checkpointing import gather_full_state_dict
from utils.environment import DistInfo
from utils.logging_utils import get_logger

HF_DIR = "hf_model"


def write_hf_folder(state_dict: dict, model_config, tokenizer, folder: str) -> None:
    """Save a plain state dict as a transformers folder, atomically (temporary name, then rename).

    The model skeleton lives on the meta device: no second copy of the weights is allocated.
    """
    tmp, old = f"{folder}.tmp", f"{folder}.old"
    for leftover in (tmp, old):
        if os.path.exists(leftover):
            shutil.rmtree(leftover)
    with torch.device("meta"):
        skeleton = T5ForConditionalGeneration(model_config)
    skeleton.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if os.path.exists(folder):
        os.replace(folder, old)
    os.replace(tmp, folder)
    if os.path.exists(old):
        shutil.rmtree(old)


def export_hf_model(model: nn.Module, model_config, tokenizer, output_dir: str, info: DistInfo) -> str | None:
    """Gather the full model (collective) and write output_dir/hf_model on rank 0. Returns its path there."""
    state = gather_full_state_dict(model, info.device)
    if not info.is_main:
        return None
    folder = os.path.join(output_dir, HF_DIR)
    write_hf_folder(state, model_config, tokenizer, folder)
    get_logger().info("final model: %s (from_pretrained-loadable, safetensors)", folder)
    return folder
