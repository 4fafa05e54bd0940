"""Where the model comes from: a folder (checked), or a hub name (looked up once: the hub, its HF cache copy
where the hub cannot be reached, or a refusal with the offline fixes). Neither needs torch or transformers: the
entry point checks the model's source before it imports them, so a mistyped folder or a hub name that cannot be
read is said in about a second (utils/model/loading.py reads the model from the source decided here).
"""

import importlib.util
import os

from huggingface_hub import constants as hub_constants
from huggingface_hub import get_hf_file_metadata, hf_hub_url, is_offline_mode, try_to_load_from_cache
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import HFValidationError, validate_repo_id

from configs.errors import ConfigError
from utils.base import layout
from utils.base.files import closest_folder
from utils.base.log import get_logger

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


def is_adapter_folder(path: str) -> bool:
    """A --peft lora run's hf_adapter/: PEFT's adapter config and no model of its own (config.json)."""
    path = os.path.expanduser(path)
    return os.path.isfile(os.path.join(path, layout.ADAPTER_CONFIG_FILE)) and not os.path.isfile(
        os.path.join(path, "config.json")
    )


def check_local_model_dir(path: str, adapter_ok: bool = False) -> None:
    """Fail early, on every rank, with the fix, instead of a hub lookup of a mistyped path. `adapter_ok`
    (--evaluate_only): a LoRA adapter folder passes, if PEFT is installed; its base is checked where it is
    loaded."""
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise ConfigError(f"no such folder: model path {path!r} does not exist{did_you_mean(path)}. {HUB_HINT}")
    if not os.path.isdir(path):
        raise ConfigError(f"model path {path!r} is a file, not a folder. {HUB_HINT}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        if is_adapter_folder(path):
            if adapter_ok and importlib.util.find_spec("peft") is None:
                raise ConfigError(
                    f"model folder {path!r} is a LoRA adapter, merged in through PEFT: pip install peft"
                )
            if adapter_ok:
                return
            raise ConfigError(
                f"model folder {path!r} is a LoRA adapter, not a whole model: --evaluate_only true and "
                "scripts/summarize.py take it (merged into its base), but to train from it use the merged model "
                "a --peft lora --merge_lora true run writes (hf_model/), or load the adapter onto its base with "
                "peft.PeftModel.from_pretrained (docs/ecosystem.md)"
            )
        raise ConfigError(
            f"model folder {path!r} has no config.json: it is not a saved transformers model. {HUB_HINT}"
        )


def did_you_mean(path: str) -> str:
    """' (did you mean X?)' for the model folder that exists with the path closest to `path`, if any."""
    meant = closest_folder(path, holding="config.json")
    return f" (did you mean {meant!r}?)" if meant else ""


def hub_model_source(model_id: str) -> str:
    """The id itself where the hub answers for it (or HF_HUB_OFFLINE=1 is set and the HF cache holds it), the
    HF cache's snapshot folder where the hub cannot be reached, else a ConfigError with the offline fixes.

    One HEAD request for config.json, without retries, with huggingface_hub's own timeout (HF_HUB_ETAG_TIMEOUT,
    10 s by default; instant where the name does not resolve or the port is closed). Left to transformers, each
    file of an unreachable hub costs huggingface_hub's 5 retries (23 s, two log lines per retry)."""
    cached = try_to_load_from_cache(model_id, "config.json")  # a path, or None / a marker when not cached
    in_cache = isinstance(cached, str)
    if is_offline_mode():
        if in_cache:
            return model_id  # transformers reads the HF cache itself, without the network
        why = "HF_HUB_OFFLINE=1 is set"
    else:
        why = hub_unreachable(model_id)
        if why is None:
            return model_id
        if in_cache:
            snapshot = os.path.dirname(cached)
            get_logger().warning(
                "%s; reading %s from the HF cache (%s), as HF_HUB_OFFLINE=1 would", why, model_id, snapshot
            )
            return snapshot
    meant = did_you_mean(model_id)
    if meant:
        raise no_such_folder(model_id, meant, f"as a hub name it cannot be read either: {why}")
    raise ConfigError(
        f"model {model_id!r} is not a folder here, and as a hub name it cannot be read: {why}, and the HF cache "
        f"({hub_constants.HF_HUB_CACHE}) does not hold it. Offline, pass a local folder made by save_pretrained "
        "(e.g. the embedded data/tiny-t5); or fill the HF cache on a machine with network (`hf download "
        f"{model_id}`), copy it here (or point HF_HOME at it) and set HF_HUB_OFFLINE=1; or run where "
        f"{hub_host()} can be reached."
    )


def hub_unreachable(model_id: str) -> str | None:
    """Why the hub cannot serve `model_id` now (no connection, no answer, a server error), or None where it
    answers. A refusal (no such model, a gated one) is an answer: transformers says it at once, in its words,
    unless a model folder that exists has a path close to the id, which the user more likely meant."""
    url = hf_hub_url(model_id, "config.json")
    try:
        get_hf_file_metadata(url, timeout=hub_constants.HF_HUB_ETAG_TIMEOUT)  # no retries by default
    except HfHubHTTPError as err:
        status = err.response.status_code
        if status >= 500 or status == 429:
            return f"{hub_host()} answers HTTP {status}"
        meant = did_you_mean(model_id)
        if meant:
            raise no_such_folder(model_id, meant, f"{hub_host()} has no such model (HTTP {status})") from None
    except Exception as err:  # the HTTP library's connection errors and timeouts: the hub cannot be reached
        return f"{hub_host()} cannot be reached ({type(err).__name__}: {err})"
    return None


def no_such_folder(model_id: str, meant: str, hub_answer: str) -> ConfigError:
    """The error for a name that is no folder here but close to one that is (`meant`: did_you_mean's words),
    with what the hub made of it."""
    return ConfigError(f"no such folder: {model_id!r} does not exist here{meant}, and {hub_answer}.")


def hub_host() -> str:
    """The hub's address (HF_ENDPOINT, huggingface.co by default) as a message names it."""
    return hub_constants.ENDPOINT.split("://", 1)[-1]
