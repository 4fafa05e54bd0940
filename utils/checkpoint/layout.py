"""The layout of an output_dir: every file and folder name is spelled here, and only here.

    output_dir/
      config.json                         the run record (utils/observe/run_record.py)
      metrics.jsonl                       one JSON record per line (utils/observe/metrics.py)
      checkpoints/step_00000123/          a resumable checkpoint (utils/checkpoint/checkpointer.py):
        train_state.json                    progress, scheduler, scaler, format; written last
        optimizer_param_groups.json         the optimizer's hyper-parameters
        rng/rank_<r>.pt                     each rank's RNG state
        tokenizer/, config.json             what an HF export needs besides the weights
        model.pt, optimizer.pt              FULL_STATE_DICT: full state dicts gathered on rank 0
        .metadata, __<r>_0.distcp           SHARDED_STATE_DICT: torch.distributed.checkpoint shards
      checkpoints/.tmp_step_.../          a save in progress (ignored; replaced by the next save)
      hf_model/                           the best epoch's model (--metric_for_best), save_pretrained + tokenizer
      hf_model_last/                      the final model, when it is not the best
      predictions/<split>_step_<N>.jsonl  the summaries of each ROUGE evaluation (utils/eval/evaluator.py)
      T5-model-<run>-epoch<E>-val<L>.pt   --save_model: the tutorial's full state dict per best epoch

Also here: finding complete checkpoints, resolving --resume, and refusing a new run over an old one.
"""

import json
import os
import re

from utils.errors import CheckpointError, ConfigError
from utils.observe.log import get_logger
from utils.train.progress import TrainProgress

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
HF_DIR = "hf_model"
HF_LAST_DIR = "hf_model_last"  # the final model, when an earlier epoch was the best
HF_ADAPTER_DIR = "hf_adapter"  # --peft lora: the adapter (hf_adapter, hf_adapter_last)
STATE_FILE = "train_state.json"
PARAM_GROUPS_FILE = "optimizer_param_groups.json"
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
RNG_DIR = "rng"
TOKENIZER_DIR = "tokenizer"
BEST_MODEL_PREFIX = "T5-model"
TMP_PREFIX = ".tmp_"
STEP_DIR = re.compile(r"^step_(\d{8})$")

FULL = "FULL_STATE_DICT"
SHARDED = "SHARDED_STATE_DICT"
FORMAT_VERSION = 1


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS_DIR)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rng_file(checkpoint: str, rank: int) -> str:
    return os.path.join(checkpoint, RNG_DIR, f"rank_{rank}.pt")


def best_model_filename(run_id: str, epoch: int, val_loss: float | None) -> str:
    """Unique per run and epoch, so saves never overwrite each other or an earlier run's."""
    loss_part = f"-val{val_loss:.4f}" if val_loss is not None else ""
    return f"{BEST_MODEL_PREFIX}-{run_id}-epoch{epoch}{loss_part}.pt"


def complete_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints under output_dir, oldest first (temporary folders of unfinished saves ignored)."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(root, name, STATE_FILE)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return [path for _, path in sorted(found)]


def read_train_state(checkpoint: str) -> dict:
    """A checkpoint's train_state.json, checked for format; CheckpointError if unreadable."""
    try:
        with open(os.path.join(checkpoint, STATE_FILE), encoding="utf-8") as f:
            state = json.load(f)
        if state.get("format_version") != FORMAT_VERSION or state.get("checkpoint_type") not in (FULL, SHARDED):
            raise ValueError(f"unknown format {state.get('format_version')!r}/{state.get('checkpoint_type')!r}")
        progress = state["progress"]
        if "best_val_loss" in progress:  # written before --metric_for_best existed: the metric was val_loss
            progress["best_metric"] = progress.pop("best_val_loss")
        TrainProgress(**progress)
        return state
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"checkpoint {checkpoint} is unreadable ({err}): corrupt or not a checkpoint"
        ) from None


def resolve_resume_path(resume: str, output_dir: str) -> str | None:
    """`--resume`: 'false' -> None; 'true' -> the newest complete checkpoint (None if there is none);
    otherwise a checkpoint folder or a full-model .pt file, which must exist."""
    if resume.lower() == "false":
        return None
    if resume.lower() == "true":
        found = complete_checkpoints(output_dir)
        if not found:
            get_logger().warning("--resume true: no complete checkpoint in %s; starting from scratch", output_dir)
            return None
        return found[-1]
    if not os.path.exists(resume):
        raise CheckpointError(
            f"--resume {resume!r}: no such checkpoint folder or .pt file. Use --resume true for the newest "
            f"checkpoint in output_dir, or a folder such as {checkpoint_root(output_dir)}/{step_dir_name(100)}"
        )
    if os.path.isdir(resume) and not os.path.isfile(os.path.join(resume, STATE_FILE)):
        raise CheckpointError(
            f"--resume {resume!r} has no {STATE_FILE}: it is not a complete checkpoint (a save interrupted "
            "before it finished?). Resume from an older one."
        )
    return resume


def prepare_output_dir(output_dir: str) -> None:
    """Create output_dir and check it is writable."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        probe = os.path.join(output_dir, f".write_test_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise ConfigError(
            f"output_dir {output_dir!r} is not writable ({err.strerror}); choose another --output_dir"
        ) from None


def choose_start(resume: str, output_dir: str) -> str | None:
    """The checkpoint or .pt to start from (None: a new run); refuses to start a new run over an old one."""
    path = resolve_resume_path(resume, output_dir)
    old_run = os.path.isfile(os.path.join(output_dir, METRICS_FILE)) or complete_checkpoints(output_dir)
    if resume.lower() == "false" and old_run:
        raise ConfigError(
            f"output_dir {output_dir!r} already holds a run ({METRICS_FILE}, {CHECKPOINTS_DIR}/): continue it "
            "with --resume true, or choose a new --output_dir. Nothing was changed."
        )
    return path


def is_checkpoint_folder(start: str | None) -> bool:
    """A resumable checkpoint (training continues where it stopped), as opposed to a bare weights file."""
    return start is not None and os.path.isdir(start)


def full_weights_file(start: str | None) -> str | None:
    """The .pt whose weights go into the unwrapped model before sharding: a FULL_STATE_DICT checkpoint's
    model.pt, or a --resume file.pt. None for a new run or a sharded checkpoint (restored after wrapping)."""
    if start is None:
        return None
    if not is_checkpoint_folder(start):
        return start
    if read_train_state(start)["checkpoint_type"] == FULL:
        return os.path.join(start, MODEL_FILE)
    return None
