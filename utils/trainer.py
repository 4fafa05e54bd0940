"""The epoch loop: train, validate, step the LR, record metrics and memory, save the best model."""

import math
import os
import time
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from utils.checkpointing import checkpoint_filename, save_full_model
from utils.environment import DistInfo
from utils.logging_utils import get_logger
from utils.memory import gather_ints, peak_memory, reset_peak_memory
from utils.metrics import MetricsWriter
from utils.train_utils import train_epoch, validate


@dataclass
class LoopSettings:
    epochs: int
    log_every_n_steps: int
    track_memory: bool
    save_model: bool
    output_dir: str
    run_id: str


def _bar(total: int, desc: str, colour: str, enabled: bool) -> tqdm:
    # Rank 0 only: N ranks drawing N bars on one terminal is unreadable.
    return tqdm(total=total, desc=desc, colour=colour, disable=not enabled, dynamic_ncols=True)


def _gather_peaks(device: torch.device) -> tuple[list[int], list[int] | None]:
    """Peak memory of every rank (collective). Reserved bytes exist on CUDA only."""
    peak, reserved = peak_memory(device)
    rows = gather_ints([peak, -1 if reserved is None else reserved], device)
    reserved_list = [row[1] for row in rows] if reserved is not None else None
    return [row[0] for row in rows], reserved_list


def fit(
    model,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    scaler,
    *,
    train_loader: DataLoader,
    train_sampler: DistributedSampler,
    val_loader: DataLoader | None,
    val_num_real_samples: int,
    info: DistInfo,
    settings: LoopSettings,
    metrics: MetricsWriter,
) -> float | None:
    """Train for settings.epochs epochs. Returns the best validation loss (None without validation)."""
    logger = get_logger()
    best_val_loss = math.inf
    global_step = 0

    def write_steps(records: list[dict]) -> None:
        for record in records:
            metrics.write({"type": "step", "epoch": epoch, **record})

    for epoch in range(1, settings.epochs + 1):
        # Without set_epoch every epoch would see the same order.
        train_sampler.set_epoch(epoch)
        if settings.track_memory:
            reset_peak_memory(info.device)
        epoch_start = time.perf_counter()
        with _bar(len(train_loader), f"Training epoch {epoch}", "blue", info.is_main) as bar:
            result = train_epoch(
                model,
                train_loader,
                optimizer,
                scaler,
                device=info.device,
                world_size=info.world_size,
                first_step=global_step,
                log_every=settings.log_every_n_steps,
                on_step_records=write_steps,
                progress=bar,
            )
        global_step = result.last_step
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
            "samples_per_s": result.samples / result.seconds,
            "tokens_per_s": result.tokens / result.seconds,
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
    return None if math.isinf(best_val_loss) else best_val_loss
