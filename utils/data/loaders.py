"""Datasets and loaders of each rank. Needs the process group (samplers read rank and world size)."""

import dataclasses
import functools
import signal
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from configs.training import TrainConfig
from summarization_dataset import WikihowOptions, pad_collate, wikihow
from utils.data.samplers import LengthGrouping, PaddedEvalSampler, ResumableDistributedSampler, train_sampler_for
from utils.distributed.process_group import DistInfo
from utils.errors import DataError
from utils.observe.log import get_logger


@dataclass
class EvalSet:
    """The articles ROUGE evaluates: the first N of a split, this rank's share in order, padded with repeats
    so that every rank generates the same number of batches."""

    split: str
    dataset: wikihow
    loader: DataLoader
    sampler: PaddedEvalSampler  # says which of this rank's samples are real


@dataclass
class Loaders:
    train: DataLoader
    train_sampler: ResumableDistributedSampler
    val: DataLoader | None
    val_num_real_samples: int  # this rank's validation samples that are not padding repeats
    evaluation: EvalSet | None  # the ROUGE set (--eval_rouge)


def build_dataset(tokenizer, split: str, num_samples: int, config: TrainConfig, world_size: int) -> Dataset:
    """The tutorial's wikihow Dataset of one split, with at least one sample per rank."""
    options = WikihowOptions(config.data_dir, config.source_prefix, config.pad_to_max_length, config.print_text)
    num_or_all = num_samples or None  # 0 means all
    dataset = wikihow(tokenizer, split, num_or_all, config.max_source_length, config.max_target_length, options)
    if len(dataset) < world_size:
        raise DataError(
            f"the {split} split of {config.data_dir} has {len(dataset)} usable samples, fewer than the "
            f"{world_size} ranks: every rank needs at least one. Use more data or fewer processes."
        )
    return dataset


def _ignore_sigterm_in_worker(_worker_id: int) -> None:
    # SIGTERM (preemption) is for the training process, which saves a checkpoint before it exits; a
    # DataLoader worker dying on it would crash the training process first.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def build_loader(
    dataset: Dataset, sampler: Sampler, batch_size: int, pad_token_id: int, num_workers: int, device: torch.device
) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=functools.partial(pad_collate, pad_token_id=pad_token_id),
        num_workers=num_workers,
        # Pinned host memory makes the copy to the GPU asynchronous; pointless on CPU.
        pin_memory=device.type == "cuda",
        persistent_workers=num_workers > 0,
        worker_init_fn=_ignore_sigterm_in_worker if num_workers > 0 else None,
        # Its own generator: starting an iterator would otherwise draw from the global RNG, and a resumed
        # run (which starts one iterator more or fewer) would see different dropout masks.
        generator=torch.Generator().manual_seed(0),
    )


def build_loaders(tokenizer, config: TrainConfig, info: DistInfo) -> Loaders:
    """This rank's training loader (shuffled, resumable) and validation loader (in order, padded)."""
    train_set = build_dataset(tokenizer, "train", config.num_train_samples, config, info.world_size)
    grouping = None
    if config.group_by_length:
        lengths = [len(article) for article in train_set.dataset["text"].tolist()]
        grouping = LengthGrouping(lengths, config.batch_size_training)
    train_sampler = train_sampler_for(train_set, info.rank, info.world_size, config.seed, grouping)
    loader_args = dict(
        pad_token_id=tokenizer.pad_token_id, num_workers=config.num_workers_dataloader, device=info.device
    )
    train = build_loader(train_set, train_sampler, config.batch_size_training, **loader_args)
    val, val_num_real = None, 0
    if config.run_validation:
        val_set = build_dataset(tokenizer, "validation", config.num_val_samples, config, info.world_size)
        val_sampler = PaddedEvalSampler(len(val_set), info.rank, info.world_size)
        val = build_loader(val_set, val_sampler, config.val_batch_size, **loader_args)
        val_num_real = val_sampler.num_real_samples
    evaluation = build_eval_set(tokenizer, config, info, "validation") if config.eval_rouge else None
    get_logger().info("samples: train %d, validation %s", len(train_set), len(val.dataset) if val else "-")
    return Loaders(train, train_sampler, val, val_num_real, evaluation)


def build_eval_set(tokenizer, config: TrainConfig, info: DistInfo, split: str) -> EvalSet:
    """The first --eval_num_samples articles of `split`, each batch padded to its longest source only
    (generation needs no fixed shapes)."""
    dynamic = dataclasses.replace(config, pad_to_max_length=False)
    dataset = build_dataset(tokenizer, split, config.eval_num_samples, dynamic, info.world_size)
    sampler = PaddedEvalSampler(len(dataset), info.rank, info.world_size)
    loader = build_loader(dataset, sampler, config.val_batch_size, tokenizer.pad_token_id,
                          config.num_workers_dataloader, info.device)  # fmt: skip
    return EvalSet(split, dataset, loader, sampler)
