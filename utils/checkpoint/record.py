"""The record (config.json) of the run that a resume continues, whose settings are its defaults (configs/cli.py:
continue_run). Read by every rank before the process group exists and before torch is imported.
"""

import json
import os

from utils.base import layout
from utils.base.log import get_logger


def resumed_checkpoint(resume: str, output_dir: str) -> str | None:
    """The checkpoint folder a resume names, unchecked: output_dir's newest complete one for --resume true, the
    folder --resume names; None for a new run, a .pt, or an output_dir without a checkpoint."""
    if resume.lower() == "true":
        kept = layout.complete_checkpoints(output_dir)
        return kept[-1] if kept else None
    return resume if resume.lower() != "false" and os.path.isdir(resume) else None


def recorded_run(resume: str, output_dir: str) -> tuple[str, dict] | None:
    """(path, contents) of the run record of the run a resume continues: output_dir's for --resume true when it
    holds a checkpoint; for a checkpoint folder, the record of the output_dir it is in (set-aside checkpoints
    included). None for a new run (or a .pt), or where no record is found."""
    checkpoint = resumed_checkpoint(resume, output_dir)
    if checkpoint is None:
        return None
    folder = output_dir if resume.lower() == "true" else _run_folder_of(checkpoint)
    if folder is None:
        get_logger().warning(
            "--resume %s: no run record (%s) found above it: the settings are this command's alone",
            resume, layout.CONFIG_FILE,
        )  # fmt: skip
        return None
    path = os.path.join(folder, layout.CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return path, json.load(f)
    except (OSError, ValueError):
        return None


def records_inputs(resume: str, output_dir: str) -> bool:
    """Whether the checkpoint a resume starts from records what its run read (utils/checkpoint/inputs.py), so
    that an input named at another path can be checked by its content."""
    checkpoint = resumed_checkpoint(resume, output_dir)
    if checkpoint is None:
        return False
    try:
        with open(os.path.join(checkpoint, layout.STATE_FILE), encoding="utf-8") as f:
            return "inputs" in json.load(f)
    except (OSError, ValueError):  # an incomplete or damaged one: start.py says so
        return False


def _run_folder_of(checkpoint: str) -> str | None:
    """The output_dir a checkpoint folder belongs to: the parent of the `checkpoints` folder above it (a
    set-aside checkpoint sits deeper: checkpoints/abandoned/after_.../step_...), where its run record is."""
    folder = os.path.abspath(checkpoint)
    for _ in range(4):
        folder = os.path.dirname(folder)
        if os.path.basename(folder) == layout.CHECKPOINTS_DIR:
            run = os.path.dirname(folder)
            return run if os.path.isfile(os.path.join(run, layout.CONFIG_FILE)) else None
    return None
