"""Which samples each rank sees, and in which order; both samplers give every rank the same number of
batches, because FSDP's all-gathers are collectives that every rank must join."""

import math
from collections.abc import Iterator
from dataclasses import dataclass

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


@dataclass(frozen=True)
class LengthGrouping:
    """--group_by_length: arrange an epoch's shuffled order so that each step's batches hold similar lengths.

    The order is cut into mega-batches of `MEGA_BATCHES` batches' worth of samples and each sorted by its
    length key (--length_key), longest first; ranks deal from it every world_size-th entry as before, so a
    step's batches come from neighbours in length. Only the order changes: each sample still comes once per
    epoch, and the order is still a function of (seed, epoch), the same on every rank. The mega-batch size
    does not depend on the number of ranks, so a resume on another world size continues the same order, as
    without grouping (a resume with another batch size does not). Its cost is less randomness inside a
    mega-batch (the usual trade-off of length grouping).
    """

    lengths: list[int]  # a sort key per sample (length_keys), read from the cached token ids
    batch_size: int  # per rank

    MEGA_BATCHES = 256

    def arrange(self, order: list[int]) -> list[int]:
        size = self.batch_size * self.MEGA_BATCHES
        arranged = []
        for start in range(0, len(order), size):  # longest first; equal keys keep their shuffled order
            arranged += sorted(order[start : start + size], key=self.lengths.__getitem__, reverse=True)
        return arranged


TARGET_BUCKET = 8  # --length_key target_then_source: summaries within 8 tokens share a bucket


def length_keys(source_lengths: list[int], target_lengths: list[int] | None, length_key: str) -> list[int]:
    """--length_key's sort key per sample: the source length, or the target's bucket then the source length
    (one int, bucket above bit 32: a tuple per sample would take three times the memory), so that a batch's
    summaries are within a bucket of each other and its articles as close as the bucket's samples allow."""
    if length_key == "source":
        return source_lengths
    pairs = zip(source_lengths, target_lengths, strict=True)
    return [(-(-target // TARGET_BUCKET) << 32) | source for source, target in pairs]


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way, after the samples a checkpoint already trained on.

    The epoch's order is the padded, shuffled list DistributedSampler builds from (seed, epoch); ranks take
    every world_size-th entry. After k full batches of b samples on W ranks, the first k*b*W entries of that
    list were consumed, whatever W was, so `set_epoch(epoch, samples_consumed)` deals out the rest. With
    the same world size the resumed order is exactly the uninterrupted one. Once every real sample was consumed
    (the list's first len(dataset) entries; the rest repeat them to make the list a multiple of the saving
    world's ranks), the epoch is over on any world size. `grouping` rearranges the shuffled list by length
    (--group_by_length) before it is dealt out.
    """

    def __init__(
        self, dataset: Dataset, num_replicas: int, rank: int, seed: int, grouping: "LengthGrouping | None" = None
    ):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.samples_consumed = 0
        self.grouping = grouping

    def set_epoch(self, epoch: int, samples_consumed: int = 0) -> None:
        super().set_epoch(epoch)
        self.samples_consumed = samples_consumed

    def _remaining(self) -> list[int]:
        if self.samples_consumed >= len(self.dataset):
            return []
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        order = order.tolist() if self.grouping is None else self.grouping.arrange(order.tolist())
        padding = self.total_size - len(order)
        order += (order * math.ceil(padding / len(order)))[:padding]
        remaining = order[self.samples_consumed :]
        # pad again if the consumed count broke the alignment (cycling: fewer left than ranks need)
        short = -len(remaining) % self.num_replicas
        return remaining + (remaining * math.ceil(short / len(remaining)))[:short]

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return self.share_after(self.samples_consumed)

    def share_after(self, samples_consumed: int) -> int:
        """This rank's items of an epoch once `samples_consumed` of its order were trained on."""
        if samples_consumed >= len(self.dataset):
            return 0
        return math.ceil((self.total_size - samples_consumed) / self.num_replicas)


def train_sampler_for(
    dataset: Dataset, rank: int, world_size: int, seed: int, grouping: LengthGrouping | None = None
) -> ResumableDistributedSampler:
    """Shuffled, reshuffled each epoch by set_epoch (length-grouped with `grouping`); pads with repeats so
    every rank has the same steps."""
    return ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed, grouping=grouping)
