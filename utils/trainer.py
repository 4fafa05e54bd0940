"""The epoch loop: train, validate, step the LR, record metrics and memory, save models and checkpoints."""

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader
from tqdm import tqdm

from utils.checkpointing import checkpoint_filename, save_full_model
from utils.data_loading import ResumableDistributedSampler
from utils.environment import DistInfo
from utils.logging_utils import get_logger
from utils.memory import gather_ints, peak_memory, reset_peak_memory
from utils.metrics import MetricsWriter
from utils.preemption import StopRequest
from utils.train_checkpoint import TrainProgress
from utils.train_utils import StepLog, train_epoch, validate


@dataclass
class LoopSettings:
    epochs: int
    batch_size: int
    log_every_n_steps: int
    save_every_n_steps: int  # 0: checkpoints at epoch ends only
    track_memory: bool
    save_model: bool
    output_dir: str
    run_id: str


def _bar(total: int, desc: str, colour: str, enabled: bool, initial: int = 0) -> tqdm:
    # Rank 0 only: N ranks drawing N bars on one terminal is unreadable.
    return tqdm(total=total, initial=initial, desc=desc, colour=colour, disable=not enabled, dynamic_ncols=True)


def _gather_peaks(device: torch.device) -> tuple[list[int], list[int] | None]:
    """Peak memory of every rank (collective). Reserved bytes exist on CUDA only."""
    peak, reserved = peak_memory(device)
    rows = gather_ints([peak, -1 if reserved is None else reserved], device)
    reserved_list = [row[1] for row in rows] if reserved is not None else None
    return [row[0] for row in rows], reserved_list


def _any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is True on any. Collective."""
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value)
    return bool(value.item() > 0)


@dataclass
class MidEpochCheckpoint:
    """The step-end hook of one pass: periodic checkpoints, and checkpoint-then-stop on SIGTERM."""

    progress: TrainProgress
    step_log: StepLog
    save_checkpoint: Callable[..., str] | None  # save_checkpoint(progress=...) -> path; None: no checkpoints
    every_n_steps: int
    batches_in_pass: int
    start_consumed: int
    samples_per_step: int
    seconds_before: float
    started: float = field(default_factory=time.perf_counter)

    def __call__(self, step: int, batches_done: int) -> bool:
        """True when the pass must end now (a stop was requested and the checkpoint is saved)."""
        if batches_done == self.batches_in_pass:
            return False  # the epoch's end saves and stops
        stop = self.step_log.stop_requested
        periodic = self.every_n_steps > 0 and step % self.every_n_steps == 0
        if self.save_checkpoint is None or not (periodic or stop):
            return stop
        self.step_log.flush()  # collective; afterwards metrics.jsonl holds every step the checkpoint holds
        self.progress.global_step = step
        self.progress.samples_consumed = self.start_consumed + batches_done * self.samples_per_step
        self.progress.epoch_totals = self.step_log.totals.tolist()
        self.progress.epoch_train_seconds = self.seconds_before + time.perf_counter() - self.started
        self.save_checkpoint(progress=self.progress)
        return self.step_log.stop_requested


@dataclass
class StepEndHooks:
    """Callbacks run once after the first step of this run, then the pass's mid-epoch checkpoint hook."""

    once: list[Callable[[], None]]
    checkpoint: MidEpochCheckpoint

    def __call__(self, step: int, batches_done: int) -> bool:
        while self.once:
            self.once.pop(0)()
        return self.checkpoint(step, batches_done)


def fit(
    model,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    scaler,
    *,
    train_loader: DataLoader,
    train_sampler: ResumableDistributedSampler,
    val_loader: DataLoader | None,
    val_num_real_samples: int,
    info: DistInfo,
    settings: LoopSettings,
    metrics: MetricsWriter,
    progress: TrainProgress,
    save_checkpoint: Callable[..., str] | None,
    stop: StopRequest,
    after_first_step: Callable[[], None] | None = None,
) -> bool:
    """Train from `progress` to the last epoch. Returns False if it stopped early on SIGTERM (after saving)."""
    logger = get_logger()
    best_val_loss = math.inf if progress.best_val_loss is None else progress.best_val_loss
    samples_per_step = settings.batch_size * info.world_size
    once = [after_first_step] if after_first_step is not None else []

    while progress.epoch <= settings.epochs:
        epoch = progress.epoch
        start_consumed = progress.samples_consumed
        # Without set_epoch every epoch would see the same order; a resumed epoch skips what was trained.
        train_sampler.set_epoch(epoch, start_consumed)
        if settings.track_memory:
            reset_peak_memory(info.device)
        epoch_start = time.perf_counter()

        def write_steps(records: list[dict], epoch=epoch) -> None:
            for record in records:
                metrics.write({"type": "step", "epoch": epoch, **record})

        step_log = StepLog(
            settings.log_every_n_steps, write_steps, lambda: stop.requested, totals=progress.epoch_totals
        )
        seconds_before = progress.epoch_train_seconds if start_consumed else 0.0
        batches_in_pass = len(train_loader)
        mid_epoch = MidEpochCheckpoint(
            progress=progress,
            step_log=step_log,
            save_checkpoint=save_checkpoint,
            every_n_steps=settings.save_every_n_steps,
            batches_in_pass=batches_in_pass,
            start_consumed=start_consumed,
            samples_per_step=samples_per_step,
            seconds_before=seconds_before,
        )
        with _bar(
            batches_in_pass + start_consumed // samples_per_step,
            f"Training epoch {epoch}",
            "blue",
            info.is_main,
            initial=start_consumed // samples_per_step,
        ) as bar:
            result = train_epoch(
                model,
                train_loader,
                optimizer,
                scaler,
                device=info.device,
                world_size=info.world_size,
                first_step=progress.global_step,
                step_log=step_log,
                progress=bar,
                on_step_end=StepEndHooks(once, mid_epoch),
            )
        if result.stopped:
            logger.info("stopped at step %d on SIGTERM; continue with --resume true", result.last_step)
            return False
        progress.global_step = result.last_step
        train_seconds = seconds_before + result.seconds
        val_loss = None
        if val_loader is not None:
            with _bar(len(val_loader), f"Validation epoch {epoch}", "green", info.is_main) as bar:
                val_loss = validate(
                    model, val_loader, device=info.device, num_real_samples=val_num_real_samples, progress=bar
                )
        scheduler.step()
        peaks, reserved = _gather_peaks(info.device) if settings.track_memory else (None, None)
        epoch_seconds = time.perf_counter() - epoch_start
        record = {
            "type": "epoch",
            "epoch": epoch,
            "train_loss": result.loss,
            "val_loss": val_loss,
            "epoch_seconds": epoch_seconds,
            "samples_per_s": result.samples / train_seconds,
            "tokens_per_s": result.tokens / train_seconds,
            "peak_memory_bytes": peaks,
        }
        if reserved is not None:
            record["peak_memory_reserved_bytes"] = reserved
        metrics.write(record)

        improved = val_loss is not None and val_loss < best_val_loss
        if improved:
            best_val_loss = val_loss
        logger.info(
            "epoch %d: train_loss %.4f | val_loss %s | %.1f s | %.1f samples/s | peak memory per rank %s",
            epoch,
            result.loss,
            "-" if val_loss is None else f"{val_loss:.4f}" + (" (new best)" if improved else ""),
            epoch_seconds,
            record["samples_per_s"],
            "-" if peaks is None else ", ".join(f"{p / 2**20:.0f} MiB" for p in peaks),
        )
        # Without validation there is no "best": every epoch is saved, under its own name.
        if settings.save_model and (improved or val_loss is None):
            path = os.path.join(settings.output_dir, checkpoint_filename(settings.run_id, epoch, val_loss))
            save_full_model(model, info.device, info.is_main, path)

        progress.epoch, progress.samples_consumed = epoch + 1, 0
        progress.epoch_totals, progress.epoch_train_seconds = None, 0.0
        progress.best_val_loss = None if math.isinf(best_val_loss) else best_val_loss
        if save_checkpoint is not None:
            save_checkpoint(progress=progress)
        if _any_rank(stop.requested, info.device):
            logger.info("stopped after epoch %d on SIGTERM; continue with --resume true", epoch)
            return False
    return True
