"""Which samples each rank sees, and in which order; both samplers give every rank the same number of
batches, because FSDP's all-gathers are collectives that every rank must join."""

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler


class PaddedEvalSampler(Sampler[int]):
    """Rank `rank`'s share of range(dataset_len), in order, padded to the same length on every rank.

    Every rank must run the same number of forward passes (FSDP all-gathers are collectives), so short
    shares are padded by repeating their first indices, as DistributedSampler does. Unlike it, this one
    says how many of its indices are real (`num_real_samples`), so validation can leave the repeats out of
    the loss (docs/pitfalls.md #14).
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


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way, after the samples a checkpoint already trained on.

    The epoch's order is the padded, shuffled list DistributedSampler builds from (seed, epoch); ranks take
    every world_size-th entry. After k full batches of b samples on W ranks, the first k*b*W entries of that
    list were consumed, whatever W was, so `set_epoch(epoch, samples_consumed)` deals out the rest. With
    the same world size the resumed order is exactly the uninterrupted one.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.samples_consumed = 0

    def set_epoch(self, epoch: int, samples_consumed: int = 0) -> None:
        super().set_epoch(epoch)
        self.samples_consumed = samples_consumed

    def _remaining(self) -> list[int]:
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        order = order.tolist()
        padding = self.total_size - len(order)
        order += (order * math.ceil(padding / len(order)))[:padding]
        remaining = order[self.samples_consumed :]
        short = -len(remaining) % self.num_replicas  # pad again if the consumed count broke the alignment
        return remaining + remaining[:short]

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return math.ceil(max(self.total_size - self.samples_consumed, 0) / self.num_replicas)


def train_sampler_for(dataset: Dataset, rank: int, world_size: int, seed: int) -> ResumableDistributedSampler:
    """Shuffled, reshuffled each epoch by set_epoch; pads with repeats so every rank has the same steps."""
    return ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed)
