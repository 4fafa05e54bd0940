"""Datasets, samplers and loaders for each rank. Needs the process group (samplers read rank/world)."""

import functools
import math
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from summarization_dataset import pad_collate, wikihow
from utils.errors import DataError


class PaddedEvalSampler(Sampler[int]):
    """Rank `rank`'s share of range(dataset_len), in order, padded to the same length on every rank.

    Every rank must run the same number of forward passes (FSDP all-gathers are collectives), so short
    shares are padded by repeating their first indices, as DistributedSampler does. Unlike it, this one
    says how many of its indices are real (`num_real_samples`), so validation can leave the repeats out of
    the loss (PITFALLS item 14).
    """

    def __init__(self, dataset_len: int, rank: int, world_size: int):
        if dataset_len < 1:
            raise ValueError("cannot shard an empty dataset")
        self.real_indices = list(range(rank, dataset_len, world_size))
        self.num_real_samples = len(self.real_indices)
        self.num_samples = math.ceil(dataset_len / world_size)
        padding = self.num_samples - self.num_real_samples
        source = self.real_indices or [0]
        self.indices = self.real_indices + [source[i % len(source)] for i in range(padding)]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def build_dataset(tokenizer, split: str, num_samples: int, train_config, world_size: int) -> Dataset:
    dataset = wikihow(
        tokenizer,
        split,
        num_samples or None,  # 0 means all
        train_config.max_source_length,
        train_config.max_target_length,
        train_config.print_text,
        data_dir=train_config.data_dir,
        source_prefix=train_config.source_prefix,
        pad_to_max_length=train_config.pad_to_max_length,
    )
    if len(dataset) < world_size:
        raise DataError(
            f"the {split} split of {train_config.data_dir} has {len(dataset)} usable samples, fewer than the "
            f"{world_size} ranks: every rank needs at least one. Use more data or fewer processes."
        )
    return dataset


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
    )


def train_sampler_for(dataset: Dataset, rank: int, world_size: int, seed: int) -> DistributedSampler:
    """Shuffled, reshuffled each epoch by set_epoch; pads with repeats so every rank has the same steps."""
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
