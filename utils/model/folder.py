"""A model named by a path: told from a hub name, and checked before anything loads (the entry point checks it
before it imports torch and transformers, so a mistyped folder is said in about a second). A hub name is
looked up when the model loads (utils/model/loading.py: hub_source).
"""

import os

from huggingface_hub.utils import HFValidationError, validate_repo_id

from configs.errors import ConfigError
from utils.files import closest_folder

HUB_HINT = (
    "Pass a local folder made by save_pretrained (e.g. the embedded data/tiny-t5), or a hub name such as "
    "t5-base on a machine that can reach huggingface.co or has the model in its HF cache (offline: "
    "HF_HUB_OFFLINE=1)."
)


def looks_like_local_path(model_name: str) -> bool:
    """A path a user typed, not a hub id ('t5-base', 'google/flan-t5-base'): it exists, or a hub id cannot be
    spelled so (absolute, ./, ../, ~, two or more '/', a trailing '/'; huggingface_hub's own rule)."""
    if os.path.exists(model_name):
        return True
    try:
        validate_repo_id(model_name)
    except HFValidationError:
        return True  # e.g. 'outputs/run1/hf_model': a hub id has at most one '/'
    return False


def check_local_model_dir(path: str) -> None:
    """Fail early, on every rank, with the fix, instead of a hub lookup of a mistyped path."""
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise ConfigError(f"no such folder: model path {path!r} does not exist{did_you_mean(path)}. {HUB_HINT}")
    if not os.path.isdir(path):
        raise ConfigError(f"model path {path!r} is a file, not a folder. {HUB_HINT}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        if os.path.isfile(os.path.join(path, "adapter_config.json")):  # a --peft lora run's hf_adapter/
            raise ConfigError(
                f"model folder {path!r} is a LoRA adapter, not a whole model: use the merged model a --peft lora "
                "--merge_lora true run writes (hf_model/), or load the adapter onto its base model with "
                "peft.PeftModel.from_pretrained (docs/ecosystem.md)"
            )
        raise ConfigError(
            f"model folder {path!r} has no config.json: it is not a saved transformers model. {HUB_HINT}"
        )


def did_you_mean(path: str) -> str:
    """' (did you mean X?)' for the model folder that exists with the path closest to `path`, if any."""
    meant = closest_folder(path, holding="config.json")
    return f" (did you mean {meant!r}?)" if meant else ""
