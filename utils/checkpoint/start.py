"""Where a run starts from, decided once: afresh, from the weights of a full-model .pt, or from a
checkpoint folder (training continues exactly where it stopped).

    start = resolve_start(config.checkpointing.resume, output_dir)   # rank 0 decides, every rank gets it

The checkpoint manager (utils/checkpoint/manager.py) restores it: `weights_file` goes into the unwrapped
model before sharding (a FULL_STATE_DICT checkpoint's model.pt or a .pt, the tutorial's way, and what
rank-0-only loading reads unit by unit); `CheckpointManager.load` restores everything else after sharding.
"""

import json
import os
from dataclasses import dataclass

from configs.errors import CheckpointError, ConfigError
from utils import layout
from utils.checkpoint.progress import TrainProgress
from utils.log import get_logger


@dataclass(frozen=True)
class StartPoint:
    path: str | None = None  # None: a new run from the pretrained weights
    checkpoint_type: str | None = None  # for a checkpoint folder: layout.FULL or layout.SHARDED

    @property
    def is_checkpoint(self) -> bool:
        """A resumable checkpoint (training continues where it stopped), not a bare weights file."""
        return self.checkpoint_type is not None

    @property
    def weights_file(self) -> str | None:
        """The .pt whose weights go into the unwrapped model before sharding: a FULL_STATE_DICT checkpoint's
        model.pt, or a --resume file.pt. None for a new run or a sharded checkpoint (loaded after sharding)."""
        if self.checkpoint_type == layout.SHARDED:
            return None
        if self.checkpoint_type == layout.FULL:
            return os.path.join(self.path, layout.MODEL_FILE)
        return self.path


def read_train_state(checkpoint: str) -> dict:
    """A checkpoint's train_state.json, checked for format; CheckpointError if unreadable."""
    try:
        with open(os.path.join(checkpoint, layout.STATE_FILE), encoding="utf-8") as f:
            state = json.load(f)
        version, kind = state.get("format_version"), state.get("checkpoint_type")
        if version != layout.FORMAT_VERSION or kind not in (layout.FULL, layout.SHARDED):
            raise ValueError(f"unknown format {version!r}/{kind!r}")
        progress = state["progress"]
        if "best_val_loss" in progress:  # written before --metric_for_best existed: the metric was val_loss
            progress["best_metric"] = progress.pop("best_val_loss")
        TrainProgress(**progress)
        return state
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"checkpoint {checkpoint} is unreadable ({err}): corrupt or not a checkpoint"
        ) from None


def resolve_start(resume: str, output_dir: str, job: str | None = None, attempt: int = 0) -> StartPoint:
    """`--resume`: 'false' -> a new run (refused if output_dir already holds one); 'true' -> the newest
    complete checkpoint (a new run if there is none); otherwise a checkpoint folder or a full-model .pt
    file, which must exist. Creates output_dir and checks that it is writable.

    A torchrun restart (`attempt` > 0) of the torchrun job `job` (utils/distributed/process_group.py:
    torchrun_attempt) whose earlier attempt started the run in output_dir continues it, as 'true' would,
    whatever --resume says: the restarted attempt has the first attempt's arguments. An attempt whose
    earlier attempts never started (a refusal, a crash before the run record) decides as the first did."""
    prepare_output_dir(output_dir)
    if attempt > 0 and job is not None and recorded_job(output_dir) == job:
        newest = newest_checkpoint(output_dir)
        where = newest.path if newest is not None else "the start"
        get_logger().warning("torchrun restart %d of this run: continuing from %s", attempt, where)
        return newest if newest is not None else StartPoint()
    if resume.lower() == "false":
        metrics_file = os.path.join(output_dir, layout.METRICS_FILE)
        if os.path.isfile(metrics_file) or layout.complete_checkpoints(output_dir):
            raise ConfigError(
                f"output_dir {output_dir!r} already holds a run ({layout.METRICS_FILE}, "
                f"{layout.CHECKPOINTS_DIR}/): continue it with --resume true, or choose a new --output_dir. "
                "Nothing was changed."
            )
        return StartPoint()
    if resume.lower() == "true":
        newest = newest_checkpoint(output_dir)
        if newest is None:
            get_logger().warning("--resume true: no complete checkpoint in %s; starting from scratch", output_dir)
            return StartPoint()
        return newest
    if not os.path.exists(resume):
        example = os.path.join(layout.checkpoint_root(output_dir), layout.step_dir_name(100))
        raise CheckpointError(
            f"--resume {resume!r}: no such checkpoint folder or .pt file. Use --resume true for the newest "
            f"checkpoint in output_dir, or a folder such as {example}"
        )
    if not os.path.isdir(resume):
        return StartPoint(resume)
    if not os.path.isfile(os.path.join(resume, layout.STATE_FILE)):
        raise CheckpointError(
            f"--resume {resume!r} has no {layout.STATE_FILE}: it is not a complete checkpoint (a save "
            "interrupted before it finished?). Resume from an older one."
        )
    return StartPoint(resume, read_train_state(resume)["checkpoint_type"])


def newest_checkpoint(output_dir: str) -> StartPoint | None:
    """The newest complete checkpoint in output_dir (None if there is none)."""
    found = layout.complete_checkpoints(output_dir)
    return StartPoint(found[-1], read_train_state(found[-1])["checkpoint_type"]) if found else None


def recorded_job(output_dir: str) -> str | None:
    """The torchrun job that started the run in output_dir (its config.json's "torchrun_job"), if known."""
    try:
        with open(os.path.join(output_dir, layout.CONFIG_FILE), encoding="utf-8") as f:
            return json.load(f).get("torchrun_job")
    except (OSError, ValueError, AttributeError):
        return None


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
