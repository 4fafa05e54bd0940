"""Where a run starts from, decided once: afresh, from the weights of a full-model .pt, or from a checkpoint
folder (training continues exactly where it stopped; docs/checkpoints.md).

    start = resolve_start(config.checkpointing.resume, output_dir, job, attempt)   # collective

Rank 0 lists the candidates; every rank then checks the chosen checkpoint's files (utils/checkpoint/integrity.py).
A damaged checkpoint met on the way to the newest intact one is set aside, never deleted; one named with
`--resume PATH` is refused. `set_aside_newer` makes a rollback stick: the checkpoints newer than the start move
out of the way, so that the next `--resume true` continues this branch.
"""

import json
import os
import shutil
from dataclasses import dataclass

from configs.errors import CheckpointError, ConfigError
from utils.base import layout
from utils.base.files import nearest_existing, write_problem
from utils.base.log import get_logger
from utils.checkpoint.integrity import find_damage
from utils.checkpoint.progress import TrainProgress
from utils.distributed.process_group import is_rank0, rank0_decides


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
        """A --resume file.pt, whose weights go into the unwrapped model before sharding (a checkpoint: after)."""
        return None if self.is_checkpoint else self.path


@dataclass(frozen=True)
class Candidate:
    """A checkpoint the run may start from, as rank 0 found it: its train_state.json, or why it is unreadable."""

    path: str
    state: dict | None
    problem: str | None = None


class DamagedMarker(CheckpointError):
    """A checkpoint's train_state.json is not what this package writes (cut short, overwritten)."""


def read_train_state(checkpoint: str) -> dict:
    """A checkpoint's train_state.json, checked for format. DamagedMarker if its content is not a checkpoint's;
    CheckpointError if it cannot be read (the file system) or was written by a newer version."""
    path = os.path.join(checkpoint, layout.STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        version, kind = state.get("format_version"), state.get("checkpoint_type")
        if isinstance(version, int) and version > max(layout.READABLE_VERSIONS):
            raise CheckpointError(
                f"checkpoint {checkpoint} was written by a newer version of this package (format {version}; this "
                f"one reads {', '.join(map(str, layout.READABLE_VERSIONS))}): resume it with that version"
            )
        if version not in layout.READABLE_VERSIONS or kind not in (layout.FULL, layout.SHARDED):
            raise ValueError(f"unknown format {version!r}/{kind!r}")
        progress = state["progress"]
        if "best_val_loss" in progress:  # written before --metric_for_best existed: the metric was val_loss
            progress["best_metric"] = progress.pop("best_val_loss")
        TrainProgress(**progress)
        return state
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise DamagedMarker(
            f"checkpoint {checkpoint} is unreadable ({layout.STATE_FILE}: {err}): corrupt or not a checkpoint"
        ) from None


def resolve_start(
    resume: str, output_dir: str, job: str | None = None, attempt: int = 0, set_aside: bool = True
) -> StartPoint:
    """`--resume`: 'false' -> a new run (refused if output_dir already holds one); 'true' -> the newest intact
    checkpoint (a new run if there is none); otherwise a checkpoint folder or a full-model .pt file, which must
    exist (a .pt starts a new run: refused where output_dir holds one). Collective.

    A torchrun restart (`attempt` > 0) of the job that started the run in output_dir continues it, as 'true'
    would; one whose earlier attempts never started the run decides as the first did. `set_aside` False
    (--evaluate_only): a damaged checkpoint is refused, not moved."""
    choice = rank0_decides(lambda: _choose(resume, output_dir, job, attempt))
    if choice.start is not None:
        return choice.start
    damaged: list[tuple[Candidate, str]] = []
    for candidate in choice.candidates:
        problem = candidate.problem or find_damage(candidate.path, candidate.state)  # collective
        if problem is None:
            if is_rank0():
                for old, why in damaged:
                    _set_aside_damaged(output_dir, old.path, why, candidate.path)
            return StartPoint(candidate.path, candidate.state["checkpoint_type"])
        if choice.named:
            raise CheckpointError(
                f"--resume {candidate.path}: the checkpoint is damaged: {problem}. Resume from another "
                "checkpoint (--resume true takes the newest intact one in output_dir); nothing was changed."
            )
        if not set_aside:
            raise CheckpointError(
                f"checkpoint {candidate.path} is damaged: {problem}. --evaluate_only changes nothing of a run: "
                "name another checkpoint with --resume PATH (a training resume sets damaged ones aside)."
            )
        damaged.append((candidate, problem))
    named = "; ".join(f"{candidate.path}: {problem}" for candidate, problem in damaged)
    raise CheckpointError(
        f"no intact checkpoint to resume from in {layout.checkpoint_root(output_dir)} ({named}). Start a new "
        "--output_dir, or move the damaged checkpoints away to start this one afresh; nothing was changed."
    )


@dataclass(frozen=True)
class Choice:
    """What rank 0 found: a start decided without a checkpoint (`start`), or checkpoints to try newest first,
    `named` when --resume named the one."""

    start: StartPoint | None = None
    candidates: tuple[Candidate, ...] = ()
    named: bool = False


def _choose(resume: str, output_dir: str, job: str | None, attempt: int) -> Choice:
    """Rank 0: where the run may start from."""
    prepare_output_dir(output_dir)
    # A torchrun restart of this run continues from its newest checkpoint, or starts as its first attempt did.
    restarted = attempt > 0 and job is not None and recorded_job(output_dir) == job
    if restarted:
        found = _complete_candidates(output_dir)
        if found:
            get_logger().warning("torchrun restart %d of this run: continuing from %s", attempt, found[0].path)
            return Choice(candidates=found)
        get_logger().warning("torchrun restart %d of this run, no checkpoint yet: starting as it started", attempt)
    if resume.lower() == "false":
        if not restarted:
            refuse_over_a_run(output_dir, "--resume false")
        return Choice(StartPoint())
    if resume.lower() == "true":
        found = _complete_candidates(output_dir)
        if not found:
            get_logger().warning("--resume true: no complete checkpoint in %s; starting from scratch", output_dir)
            return Choice(StartPoint())
        return Choice(candidates=found)
    if not os.path.exists(resume):
        example = os.path.join(layout.checkpoint_root(output_dir), layout.step_dir_name(100))
        raise CheckpointError(
            f"--resume {resume!r}: no such checkpoint folder or .pt file. Use --resume true for the newest "
            f"checkpoint in output_dir, or a folder such as {example}"
        )
    if not os.path.isdir(resume):
        if not restarted:
            refuse_over_a_run(output_dir, f"--resume {resume} (a new run from its weights)")
        return Choice(StartPoint(resume))
    if not os.path.isfile(os.path.join(resume, layout.STATE_FILE)):
        raise CheckpointError(
            f"--resume {resume!r} has no {layout.STATE_FILE}: it is not a complete checkpoint (a save "
            "interrupted before it finished?). Resume from an older one."
        )
    return Choice(candidates=(Candidate(resume, read_train_state(resume)),), named=True)


def _complete_candidates(output_dir: str) -> tuple[Candidate, ...]:
    """output_dir's complete checkpoints, newest first, each with its state or why it cannot be read."""
    found = []
    for path in reversed(layout.complete_checkpoints(output_dir)):
        try:
            found.append(Candidate(path, read_train_state(path)))
        except DamagedMarker as err:  # damaged; a newer version's or an unreadable file raises (refused)
            found.append(Candidate(path, None, str(err)))
    return tuple(found)


def refuse_over_a_run(output_dir: str, what: str) -> None:
    """A new run must not write over the run output_dir already holds."""
    if os.path.isfile(os.path.join(output_dir, layout.METRICS_FILE)) or layout.complete_checkpoints(output_dir):
        raise ConfigError(
            f"{what}: output_dir {output_dir!r} already holds a run ({layout.METRICS_FILE}, "
            f"{layout.CHECKPOINTS_DIR}/): continue it with --resume true, or choose a new --output_dir. "
            "Nothing was changed."
        )


def _set_aside_damaged(output_dir: str, checkpoint: str, problem: str, continuing_from: str) -> None:
    """Rank 0: move a damaged checkpoint of output_dir out of the way (never delete it), with one warning."""
    destination = layout.damaged_dir(output_dir, checkpoint, layout.time_stamp())
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    shutil.move(checkpoint, destination)
    get_logger().warning(
        "checkpoint %s is damaged (%s): set aside as %s; continuing from %s", checkpoint, problem, destination,
        continuing_from,
    )  # fmt: skip


def set_aside_newer(output_dir: str, start: StartPoint, progress: TrainProgress) -> bool:
    """Rank 0, at a rollback (a start from a checkpoint older than output_dir's newest): the newer checkpoints (and
    one of the same step that is not the start) move, together, to checkpoints/abandoned/. Where that branch found
    a newer best epoch, the exports move with it, and True says that this branch's best is to be chosen again."""
    if not start.is_checkpoint:
        return False  # a new run: refused over an existing one (refuse_over_a_run), so there is nothing newer
    branch_point, start_path = progress.global_step, os.path.realpath(start.path)
    newer = [
        path
        for path in layout.complete_checkpoints(output_dir)
        if layout.step_of(path) >= branch_point and os.path.realpath(path) != start_path
    ]
    if not newer:
        return False
    exports_abandoned = read_train_state(newer[-1])["progress"].get("best_epoch") != progress.best_epoch
    exports = [os.path.join(output_dir, name) for name in layout.EXPORT_DIRS] if exports_abandoned else []
    moved = newer + [path for path in exports if os.path.isdir(path)]
    destination = layout.abandoned_dir(output_dir, branch_point, layout.time_stamp())
    os.makedirs(destination)
    for path in moved:
        shutil.move(path, os.path.join(destination, os.path.basename(path)))
    get_logger().warning(
        "started from step %d, before this output_dir's newest checkpoint: the abandoned branch's %s moved to "
        "%s (--resume true and torchrun restarts now continue from this run's checkpoints)%s",
        branch_point, ", ".join(os.path.basename(path) for path in moved), destination,
        "; its best epoch's model was the exported one, so this branch's best is chosen again from its own "
        "evaluations" if exports_abandoned else "",
    )  # fmt: skip
    return exports_abandoned


def recorded_job(output_dir: str) -> str | None:
    """The torchrun job that started the run in output_dir (its config.json's "torchrun_job"), if known."""
    try:
        with open(os.path.join(output_dir, layout.CONFIG_FILE), encoding="utf-8") as f:
            return json.load(f).get("torchrun_job")
    except (OSError, ValueError, AttributeError):
        return None


OUTPUT_DIR_USE = "the run writes its record, metrics and checkpoints there"


def prepare_output_dir(output_dir: str) -> None:
    """Create output_dir, once a real write where it goes has worked (utils/base/files.py: write_problem)."""
    where = nearest_existing(output_dir)
    problem = write_problem(where)
    if problem is None:
        try:
            os.makedirs(output_dir, exist_ok=True)
        except OSError as err:
            problem = err.strerror
    if problem is not None:
        raise unwritable_folder("output_dir", output_dir, problem, OUTPUT_DIR_USE, where=where)


def unwritable_folder(
    name: str, folder: str, problem: str, use: str, *, where: str, seen_from: str = ""
) -> ConfigError:
    """The refusal of a folder the run will write (`use`: what it writes there) where `problem` stops a write;
    `where`: the folder probed (its nearest existing parent where it is not there yet); `seen_from`: the rank."""
    created = "" if where == folder else f" (to be created in {where!r})"
    return ConfigError(
        f"{name} {folder!r}{created} is not writable{seen_from} ({problem}): {use}. Make it writable (a read-only "
        "mount or snapshot, its permissions, a full quota), or choose another --output_dir. Nothing was changed."
    )
