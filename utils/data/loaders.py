"""Each rank's loaders: the training loader (shuffled, resumable), the validation loader (in order, padded) and
generation's rows, built from a data format (a spec's Dataset and collate: summarization_dataset.FORMAT) over
the run's source, whose rows come from the data cache (utils/data/cache.py):

    loaders = build_loaders(
        tokenizer=tokenizer, data_format=FORMAT, data=config.data, train=train, evaluation=evaluation, info=info
    )

Also the DataLoader settings every loader shares, the batches' move to the device, and the containers the
trainer and the evaluator receive. Needs the process group: the samplers read rank and world size.
"""

import dataclasses
import functools
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from configs.data import DataConfig, rows_to_read
from configs.errors import DataError
from configs.evaluation import EvalConfig, generation_rows
from configs.training import TrainConfig
from utils.base.log import bars_shown, get_logger
from utils.data.cache import Encoding, SplitPlan, evaluation_plan, split_rows, text_source, warn_once
from utils.data.samplers import (
    LengthGrouping,
    PaddedEvalSampler,
    ResumableDistributedSampler,
    length_keys,
    train_sampler_for,
)
from utils.distributed.process_group import DistInfo, is_rank0

IGNORED = -100  # the label of a token the loss leaves out (padding): cross_entropy's ignore_index


@dataclass(frozen=True)
class DataFormat:
    """How a split's rows become items and items a batch: a model spec's Dataset class, built as
    ``dataset_type(tokenizer, split, num_samples, input_length, output_length, data, rows=split_rows(...))``,
    and its collate, called as ``collate(items, pad_token_id=...)``. What the loaders, the run record and
    evaluation read of a Dataset (summarization_dataset.SummarizationDataset has it): ``encoding`` (how its rows
    are tokenised: utils/data/cache.py's Encoding), ``packed`` (whether its items are blocks of rows), ``split``,
    ``split_rows``, ``source_description``, ``cleaning``, ``source_prefix``, ``tokenizer``, ``unknown_tokens``,
    ``row_id(i)``, ``article(i)``, ``reference(i)``, ``source_lengths()``, ``target_lengths()`` and
    ``cut_note()`` (the start line's words on the rows' cuts); and of its class, ``lengths(data, encoding)``, the
    input and output lengths the settings give. ``packed_type``: the Dataset of
    --packing's blocks, built alike (and with ``packing_note()``), where the model spec packs."""

    dataset_type: type[Dataset]
    collate: Callable
    packed_type: type[Dataset] | None = None  # the Dataset of --packing's blocks, where the model spec packs


@dataclass
class EvalSet:
    """The rows generation evaluates: the first N of a split, this rank's share in order, padded with repeats
    so that every rank generates the same number of batches."""

    split: str
    dataset: Dataset  # the format's Dataset (SummarizationDataset): .article(i), .reference(i), .row_id(i)
    loader: DataLoader
    sampler: PaddedEvalSampler  # says which of this rank's samples are real


@dataclass
class FinalSplit:
    """A split scored once, after training (SplitPlan.final): its loss's loader and generation's rows."""

    loader: DataLoader  # in order, padded, as validation's
    num_real_samples: int  # this rank's samples that are not padding repeats
    evaluation: EvalSet | None  # generation's rows (--eval_rouge)


@dataclass
class Loaders:
    train: DataLoader | None  # None with --evaluate_only
    train_sampler: ResumableDistributedSampler | None
    val: DataLoader | None  # None with --run_validation false; the split of --eval_split (plan.evaluation)
    val_num_real_samples: int  # this rank's validation samples that are not padding repeats
    evaluation: EvalSet | None  # generation's rows (--eval_rouge; --evaluate_only's split)
    cleaning: str  # how the source's texts are prepared (utils/data/cache.py: CLEANINGS)
    encoding: Encoding  # how their rows were tokenised: what the run's checkpoints record, and a resume reads
    plan: SplitPlan  # which splits are evaluated (--eval_split on the source's splits)
    final: FinalSplit | None = None  # the split scored once after training (plan.final), with --run_validation

    def unknown_tokens(self) -> dict:
        """{split: its unknown-token counts} of the splits this run reads (the run record's)."""
        final = self.final.loader if self.final else None
        loaders = (self.train, self.val, self.evaluation.loader if self.evaluation else None, final)
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


def build_dataset(
    tokenizer, data_format: DataFormat, split: str, num_samples: int | None, data: DataConfig, world_size: int,
    read_as: str = "", encoding: Encoding | None = None, whole_train: bool = False,
) -> Dataset:  # fmt: skip
    """The format's Dataset of one split, the first `num_samples` rows (0: all; None: by source, rows_to_read,
    as split `read_as` would be: generation reads any split as the validation split), with at least one sample
    per rank; packed into blocks with --packing, but for generation (`read_as`). Tokenised as `encoding` (by
    default the Dataset's: a resumed run's is the one its checkpoint recorded). More rows asked for than the
    split has: all of them, said once, by rank 0. `whole_train`: train with its held-out rows (SplitPlan)."""
    tutorial_data = text_source(data).cleaning == "wikihow"
    limit = rows_to_read(num_samples, read_as or split, tutorial_data)
    dataset_type = data_format.dataset_type
    encoding = encoding or dataset_type.encoding
    lengths = dataset_type.lengths(data, encoding)
    rows = split_rows(tokenizer, split, limit, *lengths, data, encoding=encoding, whole_train=whole_train)
    if data.packing and not read_as:
        dataset_type = data_format.packed_type
    dataset = dataset_type(tokenizer, split, limit, *lengths, data, rows=rows)
    rank0 = is_rank0()
    if num_samples and num_samples > dataset.split_rows and rank0:
        warn_once(Path(dataset.source_description), f"{split} rows asked",
                  "asked for %d %s rows but the split of %s has %d: using all %d", num_samples, split,
                  dataset.source_description, dataset.split_rows, dataset.split_rows)  # fmt: skip
    if rank0:
        warn_unknown_tokens(dataset, tokenizer)
        for note in dataset.notes():
            warn_once(Path(dataset.source_description), note, "%s", note)
    if len(dataset) < world_size:
        what = "packed block" if dataset.packed else "usable sample"
        fix = "more data, a shorter --max_seq_len," if dataset.packed else "more data"
        raise DataError(
            f"the {split} split of {dataset.source_description} has {len(dataset)} {what}"
            f"{'s' if len(dataset) != 1 else ''}, fewer than the {world_size} ranks: every rank needs at least "
            f"one. Use {fix} or fewer processes."
        )
    return dataset


# Above this share of tokens that are the unknown token, the data is mostly readable only in part.
UNKNOWN_TOKEN_SHARE = 0.001


def warn_unknown_tokens(dataset: Dataset, tokenizer) -> None:
    """One warning when more than UNKNOWN_TOKEN_SHARE of a split's source or target tokens are the tokenizer's
    unknown token, with the characters of the first such row it cannot read and the likely fix."""
    counts = dataset.unknown_tokens
    if counts["first_row"] is None:
        return
    shares = {side: counts[side] / max(counts[f"{side}_total"], 1) for side in ("source", "target")}
    if max(shares.values()) <= UNKNOWN_TOKEN_SHARE:
        return
    row = counts["first_row"]

    def unreadable(text: str) -> str:
        unknown = tokenizer.unk_token_id
        characters = [c for c in dict.fromkeys(text) if not c.isspace()
                      and unknown in tokenizer(c, add_special_tokens=False)["input_ids"]]  # fmt: skip
        return " ".join(characters[:12])

    # The source prefix is in every source: what it cannot read there is the prefix's, not the data's.
    in_row = unreadable(dataset.article(row) + " " + dataset.reference(row))
    in_prefix = unreadable(dataset.source_prefix)
    where = [f"row {dataset.row_id(row)}: {in_row or '?'}"] if in_row or not in_prefix else []
    if in_prefix:
        where.append(f"--source_prefix {dataset.source_prefix!r}: {in_prefix}")
    warn_once(Path(dataset.source_description), f"{dataset.split} unknown tokens",
              "%s, %s split: %.1f%% of source and %.1f%% of target tokens are the tokenizer's unknown token "
              "(%d of %d rows hold one; the characters it cannot read in %s). The model will not see that "
              "text: use a model whose tokenizer covers it (a multilingual one such as google/mt5-base or "
              "google/umt5-base)",
              dataset.source_description, dataset.split, 100 * shares["source"], 100 * shares["target"],
              counts["rows"], counts["rows_total"], ", and in ".join(where))  # fmt: skip


def rows_phrase(dataset: Dataset, asked: int | None, flag: str, note: str = "") -> str:
    """How many rows of its split a dataset reads and why, for the start line (`asked`: the value of `flag`,
    the setting that chose them; `note`: said with them)."""
    split, rows = dataset.split, len(dataset.dataset)
    notes = (dataset.cut_note(), dataset.packing_note() if dataset.packed else "")
    packed = "".join(f", {said}" for said in notes if said)
    note = f"; {note}" if note else ""
    if rows == dataset.split_rows:
        return f"{split} {rows} (all{packed}{note})"
    why = flag if asked is not None else f"the tutorial's subset of WikiHow; {flag} 0 for all"
    return f"{split} {rows} of {dataset.split_rows} ({why}{packed}{note})"


def build_loaders(
    *, tokenizer, data_format: DataFormat, data: DataConfig, train: TrainConfig, evaluation: EvalConfig,
    info: DistInfo, encoding: Encoding | None = None,
) -> Loaders:  # fmt: skip
    """This rank's training loader (shuffled, resumable), validation loader (in order, padded) and generation
    set, on the splits --eval_split chooses (utils/data/cache.py: evaluation_plan), and the loaders of a split
    scored once after training where it chooses one; --run_validation false builds none but the first.
    --evaluate_only: its split's set alone (a test file alone will do). Their rows tokenised as `encoding` (by
    default the format's Dataset's)."""
    if not bars_shown():  # datasets' own bars (loading, tokenising) follow the package's rule, in this process
        datasets.disable_progress_bars()
    plan = evaluation_plan(data, evaluation.eval_split, evaluation.evaluate_only)
    if evaluation.evaluate_only:
        split = plan.evaluation
        if evaluation.eval_split == "auto":
            why = " (the data has no validation split of its own)" if split == "test" else ""
            get_logger().info("--eval_split auto: scoring the %s split%s", split, why)
        eval_set = build_eval_set(tokenizer, data_format, data, train, evaluation, info, split, encoding)
        get_logger().info(
            "rows: %s",
            rows_phrase(
                eval_set.dataset, generation_rows(evaluation, data.num_val_samples), generation_flag(evaluation)
            ),
        )
        return Loaders(None, None, None, 0, eval_set, eval_set.dataset.cleaning, eval_set.dataset.encoding, plan)
    train_set = build_dataset(tokenizer, data_format, "train", data.num_train_samples, data, info.world_size,
                              encoding=encoding, whole_train=plan.whole_train)  # fmt: skip
    grouping = None
    if data.group_by_length:
        targets = train_set.target_lengths() if data.length_key != "source" else None
        keys = length_keys(train_set.source_lengths(), targets, data.length_key)
        grouping = LengthGrouping(keys, train.batch_size_training)
    train_sampler = train_sampler_for(train_set, info.rank, info.world_size, train.seed, grouping)
    collate = functools.partial(data_format.collate, pad_token_id=tokenizer.pad_token_id)
    loader_args = dict(collate_fn=collate, num_workers=train.num_workers_dataloader, device=info.device)
    train_loader = build_loader(train_set, train_sampler, train.batch_size_training, **loader_args)
    val, val_num_real, eval_set, final = None, 0, None, None
    generates = evaluation.eval_rouge and not data.dataset_text_field  # whole texts: no reference to score
    if train.run_validation:
        val, val_num_real = _scored_loader(
            tokenizer, data_format, plan.evaluation, data, train, info, loader_args, encoding
        )
        if generates:
            eval_set = build_eval_set(
                tokenizer, data_format, data, train, evaluation, info, plan.evaluation, encoding
            )
        if plan.final:
            loader, num_real = _scored_loader(
                tokenizer, data_format, plan.final, data, train, info, loader_args, encoding
            )
            final_eval = None
            if generates:
                final_eval = build_eval_set(
                    tokenizer, data_format, data, train, evaluation, info, plan.final, encoding
                )
            final = FinalSplit(loader, num_real, final_eval)
    held = plan.held_out_rows
    whole = f"the {held} rows --eval_split auto holds out for validation included" if plan.whole_train else ""
    said = [rows_phrase(train_set, data.num_train_samples, "--num_train_samples", whole)]
    scored = (val, final.loader if final else None)
    said += [rows_phrase(loader.dataset, data.num_val_samples, "--num_val_samples") for loader in scored if loader]
    if not val:
        said.append("validation - (--run_validation false)")
    get_logger().info("rows: %s", ", ".join(said))
    return Loaders(
        train_loader,
        train_sampler,
        val,
        val_num_real,
        eval_set,
        train_set.cleaning,
        train_set.encoding,
        plan,
        final,
    )


def _scored_loader(
    tokenizer, data_format: DataFormat, split: str, data: DataConfig, train: TrainConfig, info: DistInfo,
    loader_args: dict, encoding: Encoding | None,
) -> tuple[DataLoader, int]:  # fmt: skip
    """The loader of a split whose loss is scored (validation's, or a final split's): its first
    --num_val_samples rows, in order, padded with repeats; and this rank's real samples."""
    dataset = build_dataset(
        tokenizer, data_format, split, data.num_val_samples, data, info.world_size, encoding=encoding
    )
    sampler = PaddedEvalSampler(len(dataset), info.rank, info.world_size)
    return build_loader(dataset, sampler, train.val_batch_size, **loader_args), sampler.num_real_samples


def generation_flag(evaluation: EvalConfig) -> str:
    """The setting that chose how many rows generation scores (generation_rows)."""
    return "--num_val_samples" if evaluation.eval_num_samples is None else "--eval_num_samples"


def build_eval_set(
    tokenizer, data_format: DataFormat, data: DataConfig, train: TrainConfig, evaluation: EvalConfig,
    info: DistInfo, split: str, encoding: Encoding | None = None,
) -> EvalSet:  # fmt: skip
    """The first --eval_num_samples rows of `split` (by default as many as the validation loss reads), each
    batch padded to its longest source only (generation needs no fixed shapes)."""
    dynamic = dataclasses.replace(data, pad_to_max_length=False)
    rows = generation_rows(evaluation, data.num_val_samples)
    dataset = build_dataset(
        tokenizer, data_format, split, rows, dynamic, info.world_size, read_as="validation", encoding=encoding
    )
    sampler = PaddedEvalSampler(len(dataset), info.rank, info.world_size)
    collate = functools.partial(data_format.collate, pad_token_id=tokenizer.pad_token_id)
    loader = build_loader(
        dataset, sampler, train.val_batch_size, collate, train.num_workers_dataloader, info.device
    )
    return EvalSet(split, dataset, loader, sampler)
