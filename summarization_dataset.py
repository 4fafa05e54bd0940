"""The tutorial's Dataset and its collate: how one split's rows become the items and batches a T5 trains on.

    dataset = SummarizationDataset(tokenizer, "train", num_samples, input_length, output_length)

is the tutorial's ``wikihow`` Dataset, for every source: WikiHow by default (utils/data/wikihow.py, the original
builder's splits and texts), or your own files or datasets (utils/data/sources.py). The rows come from the
data cache (utils/data/cache.py), read and tokenised once per machine; ``pad_collate`` batches the items.
utils/data/loaders.py builds each rank's loaders of them (``FORMAT`` hands it this module's two pieces).
"""

import functools
from collections.abc import Sequence

import pyarrow.compute as pc
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from configs.data import DataConfig
from utils.base.log import get_logger
from utils.data.cache import CLEANINGS, SEQ2SEQ_ENCODING, Encoding, SplitRows, split_rows, unknown_token_counts
from utils.data.loaders import DataFormat

ITEM_KEYS = ("source_ids", "source_mask", "target_ids", "target_mask")


class SummarizationDataset(Dataset):
    """One split of the run's source as the tutorial's `wikihow` Dataset made its items: 1-D int64
    source_ids/source_mask/target_ids/target_mask.

    Source is ``source_prefix + clean(source text)``, target ``clean(target text)``, where `clean` is the
    source's (WikiHow's clean_text, or the text as it is). ``self.dataset`` holds the rows (id, source, target)
    and ``self.token_ids`` their token ids (unpadded, int32), both memory-mapped from the cache under
    --cache_dir (utils/data/cache.py: split_rows): the data is read and tokenised once per machine and kept
    once, in the OS page cache, for every rank, epoch and later run, not copied into each process. The first
    five arguments are the tutorial's; its ``print_text`` moved into ``options``. ``rows`` (split_rows of the
    same split and lengths), where the caller has them: the package's loaders do.
    """

    encoding = SEQ2SEQ_ENCODING  # how the cache tokenises its rows (utils/data/cache.py)
    packed = False  # an item is a row (a decoder-only model's may be blocks of rows: causal_lm_dataset.py)

    @staticmethod
    def lengths(data: DataConfig, encoding: Encoding | None = None) -> tuple[int, int]:  # noqa: ARG004 - causal's
        """The (source, target) token lengths the settings `data` give a split's rows (tokenised as `encoding`:
        by default the class's)."""
        return data.max_source_length, data.max_target_length

    def __init__(
        self,
        tokenizer,
        type_path: str,
        num_samples: int | None,
        input_length: int,
        output_length: int,
        options: DataConfig | None = None,
        *,
        rows: SplitRows | None = None,
    ) -> None:
        # Without options: the embedded sample, padded to the max lengths as the tutorial's Dataset did.
        options = options or DataConfig(pad_to_max_length=True)
        # The package's loaders hand the rows in (utils/data/loaders.py); the tutorial's call reads them here.
        lengths = (input_length, output_length)
        if rows is None:
            rows = split_rows(
                tokenizer, type_path, num_samples, input_length, output_length, options, encoding=self.encoding
            )
        elif (rows.split, rows.lengths, rows.encoding.name) != (type_path, lengths, self.encoding.name):
            raise ValueError(
                f"rows of split {rows.split!r} tokenised to {rows.lengths} ({rows.encoding.name}) handed to a "
                f"Dataset of split {type_path!r}, lengths {lengths} ({self.encoding.name})"
            )
        self.encoding = rows.encoding  # the class's, or an older one of its kind that a resumed run reads
        self.split = type_path
        self.split_rows = rows.split_rows  # the whole split's, before num_samples
        self.dataset = rows.rows
        self.token_ids = rows.token_ids
        self.source_description = rows.what
        self.cleaning = rows.cleaning
        self.clean_text = CLEANINGS[rows.cleaning]
        self.tokenizer = tokenizer
        self.input_length = input_length
        self.output_length = output_length
        self.options = options  # the data settings (a subclass's Dataset reads its own of them)
        self.print_text = options.print_text
        self.source_prefix = options.source_prefix
        self.pad_to_max_length = options.pad_to_max_length

    @functools.cached_property
    def unknown_tokens(self) -> dict:
        """unknown_token_counts of the rows this dataset reads, counted when first asked: by rank 0 alone, for
        its warning and the run record."""
        tokenizer = self.tokenizer
        unknown = tokenizer.unk_token_id
        # GPT-2's one special token is its start, end and unknown token: the EOS every completion ends with is
        # no text it could not read.
        if unknown in (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id):
            unknown = None
        return unknown_token_counts(self.token_ids, unknown)

    def notes(self) -> list[str]:
        """What rank 0 says once about these rows before training: nothing for an encoder-decoder's (a
        decoder-only model's conversations may have some: causal_lm_dataset.py)."""
        return []

    def cut_note(self) -> str:
        """What the start line says of the rows' cuts: nothing for an encoder-decoder's (a decoder-only model's
        rows: causal_lm_dataset.py)."""
        return ""

    def __len__(self) -> int:
        return len(self.dataset)

    def _field(self, column: str, index: int) -> str:
        return self.dataset.data.column(column)[index].as_py()  # one field, not the whole row

    def row_id(self, index: int) -> str:
        """The row's name in the predictions: WikiHow's title, the data's id column, or its file and line."""
        return self._field("id", index)

    def article(self, index: int) -> str:
        """The source text as the source gave it (WikiHow: one paragraph per line), not yet cleaned."""
        return self._field("source", index)

    def reference(self, index: int) -> str:
        """The target as the model is trained to write it (cleaned, untruncated): what is scored against."""
        return self.clean_text(self._field("target", index))

    def source_lengths(self) -> list[int]:
        """The number of source tokens of every sample (after truncation), read from the cached ids."""
        return pc.list_value_length(self.token_ids.data.column("source_ids")).to_pylist()

    def target_lengths(self) -> list[int]:
        """The number of target tokens of every sample (after truncation), read from the cached ids."""
        return pc.list_value_length(self.token_ids.data.column("target_ids")).to_pylist()

    def _ids(self, column: str, index: int) -> torch.Tensor:
        # Straight from the Arrow column: a view of the mapped file, copied once into the int64 tensor.
        return torch.from_numpy(self.token_ids.data.column(column)[index].values.to_numpy().astype("int64"))

    def _features(self, ids: torch.Tensor, max_length: int) -> dict[str, torch.Tensor]:
        """input_ids and attention_mask, right-padded to max_length with pad_to_max_length (else unpadded)."""
        width = max_length if self.pad_to_max_length else len(ids)
        input_ids = torch.full((width,), self.tokenizer.pad_token_id, dtype=torch.long)
        input_ids[: len(ids)] = ids
        return {"input_ids": input_ids, "attention_mask": (torch.arange(width) < len(ids)).long()}

    def convert_to_features(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if self.print_text:
            get_logger().info("Input Text: %s", self.source_prefix + self.clean_text(self.article(index)))
        source, target = self._ids("source_ids", index), self._ids("target_ids", index)
        return self._features(source, self.input_length), self._features(target, self.output_length)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        source, target = self.convert_to_features(index)
        return {
            "source_ids": source["input_ids"],
            "source_mask": source["attention_mask"],
            "target_ids": target["input_ids"],
            "target_mask": target["attention_mask"],
        }


def pad_collate(items: Sequence[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad each key to the longest in the batch (ids with pad_token_id, masks with 0) and stack.

    A module-level function so that ``functools.partial(pad_collate, pad_token_id=...)`` pickles into
    DataLoader worker processes.
    """
    if not items:
        raise ValueError("pad_collate got an empty batch.")
    batch = {}
    for key in ITEM_KEYS:
        padding_value = 0 if key.endswith("_mask") else pad_token_id
        batch[key] = pad_sequence([item[key] for item in items], batch_first=True, padding_value=padding_value)
    return batch


# What utils/data/loaders.py builds a run's loaders with (T5_training.py hands it in).
FORMAT = DataFormat(dataset_type=SummarizationDataset, collate=pad_collate)
