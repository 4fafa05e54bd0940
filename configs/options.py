"""`option()`: a dataclass field with its --help text, the bounds the CLI checks, what a resume does with it."""

from dataclasses import field
from typing import Literal

# What a resume (--resume true or a checkpoint folder) does with a field (configs/cli.py: continue_run):
# "keep": the run's recorded value, unless the command line gives another, which is taken with one line;
# "fixed": the run's recorded value; another one is refused (its checkpoints cannot honour it);
# "launch": not part of the run (where to write, where to start from, what to do): never taken from the record.
OnResume = Literal["keep", "fixed", "launch"]
# What a field names on disk (configs/cli.py: absolute_path): "path", a file or folder, made absolute when the
# settings are read; "path_or_name", a folder where one exists (made absolute), else a hub name (--model_name,
# --dataset_name). A resume compares it as a path: the same file or folder by another spelling is the same.
PathKind = Literal["path", "path_or_name"]


def option(
    default,
    help: str,
    *,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    on_resume: OnResume = "keep",
    path: PathKind | None = None,
):
    """A config field. `minimum`/`maximum`: value must be >= / <= it; `above`: value must be > it; `path`: what it
    names on disk, if anything."""
    metadata = {
        "help": help, "minimum": minimum, "above": above, "maximum": maximum, "on_resume": on_resume, "path": path,
    }  # fmt: skip
    return field(default=default, metadata=metadata)
