"""The record (config.json) of the run that a resume continues: its settings are the resume's defaults
(configs/cli.py: continue_run). Read by every rank before the process group exists, and before torch is
imported: the settings are checked with it.
"""

import json
import os

from utils import layout
from utils.log import get_logger


def recorded_run(resume: str, output_dir: str) -> tuple[str, dict] | None:
    """(path, contents) of the run record (config.json) of the run a resume continues, whose settings are its
    defaults (configs/cli.py: continue_run): output_dir's for --resume true when it holds a checkpoint; for a
    checkpoint folder, the record of the output_dir it is in (set-aside checkpoints included). None for a new
    run (or a .pt), or where no record is found. Read by every rank before the process group exists
    (output_dir is shared storage)."""
    if resume.lower() == "false":
        return None
    if resume.lower() == "true":
        if not layout.complete_checkpoints(output_dir):
            return None
        folder = output_dir
    elif os.path.isdir(resume):
        folder = _run_folder_of(resume)
        if folder is None:
            get_logger().warning(
                "--resume %s: no run record (%s) found above it: the settings are this command's alone",
                resume, layout.CONFIG_FILE,
            )  # fmt: skip
            return None
    else:
        return None
    path = os.path.join(folder, layout.CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return path, json.load(f)
    except (OSError, ValueError):
        return None


def records_inputs(resume: str, output_dir: str) -> bool:
    """Whether the checkpoint a resume starts from (output_dir's newest complete one for --resume true, the
    folder --resume names) records what its run read (train_state.json's "inputs": utils/checkpoint/inputs.py),
    so that an input named at another path can be checked by its content."""
    if resume.lower() == "true":
        kept = layout.complete_checkpoints(output_dir)
        checkpoint = kept[-1] if kept else None
    else:
        checkpoint = resume if os.path.isdir(resume) else None
    try:
        with open(os.path.join(checkpoint, layout.STATE_FILE), encoding="utf-8") as f:
            return "inputs" in json.load(f)
    except (OSError, TypeError, ValueError):  # no checkpoint (TypeError: None), or none readable
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
