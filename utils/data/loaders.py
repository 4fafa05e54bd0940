"""What a rank's loaders are made of: the DataLoader settings every loader shares, the batches' move to the
device, and the containers the trainer and the evaluator receive. The WikiHow datasets and samplers that fill
them are built in summarization_dataset.py (build_loaders)."""

import signal
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from utils.data.samplers import PaddedEvalSampler, ResumableDistributedSampler


@dataclass
class EvalSet:
    """The rows generation evaluates: the first N of a split, this rank's share in order, padded with repeats
    so that every rank generates the same number of batches."""

    split: str
    dataset: Dataset  # summarization_dataset.SummarizationDataset: .article(i), .reference(i), .row_id(i)
    loader: DataLoader
    sampler: PaddedEvalSampler  # says which of this rank's samples are real


@dataclass
class Loaders:
    train: DataLoader | None  # None with --evaluate_only
    train_sampler: ResumableDistributedSampler | None
    val: DataLoader | None  # None with --run_validation false
    val_num_real_samples: int  # this rank's validation samples that are not padding repeats
    evaluation: EvalSet | None  # generation's rows (--eval_rouge; --evaluate_only's split)
    cleaning: str  # how the source's texts are prepared (summarization_dataset.CLEANINGS)

    def unknown_tokens(self) -> dict:
        """{split: its unknown-token counts} of the splits this run reads (the run record's)."""
        loaders = (self.train, self.val, self.evaluation.loader if self.evaluation else None)
        return {loader.dataset.split: loader.dataset.unknown_tokens for loader in loaders if loader is not None}


def move_batch(batch: dict, device: torch.device) -> dict:
    # non_blocking lets the host-to-GPU copy of pinned memory overlap with compute; a no-op on CPU.
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def _ignore_stop_signals_in_worker(_worker_id: int) -> None:
    # SIGTERM (preemption) and Ctrl-C are for the training process, which saves a checkpoint before it exits;
    # a DataLoader worker dying on them would crash the training process first (torchrun signals the rank's
    # whole process group, workers included), and one inheriting the rank's handler would log it again.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


def build_loader(
    dataset: Dataset,
    sampler: Sampler,
    batch_size: int,
    collate_fn: Callable,
    num_workers: int,
    device: torch.device,
) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        num_workers=num_workers,
        # Pinned host memory makes the copy to the GPU asynchronous; pointless on CPU.
        pin_memory=device.type == "cuda",
        persistent_workers=num_workers > 0,
        worker_init_fn=_ignore_stop_signals_in_worker if num_workers > 0 else None,
        # Its own generator: starting an iterator would otherwise draw from the global RNG, and a resumed
        # run (which starts one iterator more or fewer) would see different dropout masks.
        generator=torch.Generator().manual_seed(0),
    )
