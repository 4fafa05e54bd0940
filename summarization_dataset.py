"""WikiHow reader with the original builder's semantics, and the tutorial's ``wikihow`` Dataset.

The Advanced FSDP tutorial loads WikiHow with ``nlp.load_dataset('wikihow', 'all', data_dir='data/')``.
That package (2020, superseded by ``datasets``) downloads the builder script and the split lists at run
time, and ``datasets`` >= 4 refuses dataset scripts altogether, so neither works offline or today
(docs/pitfalls.md #11). This module re-implements what that builder (TFDS ``wikihow``, version 1.2.0, config
'all') does, on the same two inputs, so the splits and texts are the published ones:

* ``data_dir/wikihowAll.csv``, the authors' file. Its header must be exactly ``headline,title,text``.
  It is read with Python's ``csv`` module, as the builder did: rows with another number of fields
  (blank lines, broken rows) are skipped, and every field is stripped.
* A row is kept only if ``len(headline) < 0.75 * len(text)`` (removes short articles with long
  summaries, and articles without text); then ``.,`` in the headline becomes ``.`` (the bold lines were
  joined with ``.,\\n``) and ``.\\n,`` (one or more dots, one or more newlines, a comma) in the text
  becomes ``.\\n`` (the paragraphs were joined with ``\\n,``). Rows whose headline or text is then empty
  are dropped.
* Split membership: the title without surrounding whitespace and without spaces must be a line of
  ``all_train.txt``, ``all_val.txt`` or ``all_test.txt`` (the authors' lists). Published sizes: train
  157,252, validation 5,599, test 5,577.

Without any of the three lists, a deterministic split by a hash of the title is used instead (and a
warning says so); see ``hash_split``.

The ``wikihow`` Dataset keeps the tutorial's constructor and items; ``pad_collate`` and
``labels_for_loss`` are what the training loop needs around it.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import pandas as pd
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from configs.data import DataConfig
from configs.errors import ConfigError, DataError, DataFileNotFoundError
from configs.evaluation import EvalConfig
from configs.training import TrainConfig
from utils.data.loaders import EvalSet, Loaders, build_loader
from utils.data.samplers import LengthGrouping, PaddedEvalSampler, train_sampler_for
from utils.distributed.process_group import DistInfo
from utils.log import get_logger

CSV_NAME = "wikihowAll.csv"
EXPECTED_HEADER = ["headline", "title", "text"]
# Split name -> the authors' list of titles for it (names as the builder and the tutorial use them).
SPLIT_FILES = {"train": "all_train.txt", "validation": "all_val.txt", "test": "all_test.txt"}
CSV_SOURCE_URL = "https://ucsb.app.box.com/s/ap23l8gafpezf4tq3wapr6u8241zz358"

# Some articles are longer than csv's default field limit of 131,072 characters. 2**31 - 1 fits the C
# long of every platform (sys.maxsize overflows it on Windows).
_CSV_FIELD_SIZE_LIMIT = 2**31 - 1
# Hash split used when the split lists are missing: buckets 0-93 train, 94-96 validation, 97-99 test,
# close to the published proportions (157,252 / 5,599 / 5,577).
_HASH_BUCKETS = 100
_HASH_TRAIN_BELOW = 94
_HASH_VALIDATION_BELOW = 97

_PARAGRAPH_COMMA = re.compile(r"[.]+[\n]+[,]")
_SPACES = re.compile(r" {2,}")
ITEM_KEYS = ("source_ids", "source_mask", "target_ids", "target_mask")


# ---------------------------------------------------------------------------------------------------
# The builder's reading and cleaning
# ---------------------------------------------------------------------------------------------------


def _how_to_get_data(data_dir: Path) -> str:
    return (
        f"Download it with `python scripts/download_wikihow.py --data_dir {data_dir}`, or follow the "
        f"manual steps in the README (download {CSV_NAME} from {CSV_SOURCE_URL} in a browser and put it "
        f"in {data_dir})."
    )


def check_header(header: Sequence[str] | None, csv_path: str | os.PathLike) -> None:
    """Raise DataError unless ``header`` is the header of the original wikihowAll.csv."""
    if header is None or list(header) != EXPECTED_HEADER:
        found = "nothing (the file is empty)" if header is None else ",".join(header)
        raise DataError(
            f"{csv_path} has the header {found!r}, expected {','.join(EXPECTED_HEADER)!r}: the file must "
            f"be the original {CSV_NAME} of the WikiHow dataset (config 'all')."
        )


def check_csv_header(csv_path: str | os.PathLike) -> None:
    """Check the header of a wikihowAll.csv on disk (used by scripts/download_wikihow.py). The decoder reads
    a block ahead, so a bad byte near the start is a DataError here too, not a UnicodeDecodeError."""
    csv.field_size_limit(_CSV_FIELD_SIZE_LIMIT)
    try:
        with open(csv_path, encoding="utf-8", newline="") as f:
            header = next(csv.reader(f), None)
    except UnicodeDecodeError:
        raise _not_utf8(Path(csv_path)) from None
    check_header(header, csv_path)


def filter_and_clean(headline: str, text: str) -> tuple[str, str]:
    """The builder's filter and cleaning of one (stripped) row; ('', '') means "drop the row"."""
    # Long summaries of short articles (and articles without text) are not summarization examples.
    if not len(headline) < 0.75 * len(text):
        return "", ""
    # The bold lines were joined with ".,\n"; the paragraphs with "\n," after a full stop.
    return headline.replace(".,", "."), _PARAGRAPH_COMMA.sub(".\n", text)


def normalise_title(title: str) -> str:
    """The form in which titles appear in the split lists: stripped, spaces removed."""
    return title.strip().replace(" ", "")


def _read_title_list(path: Path) -> set[str]:
    with open(path, encoding="utf-8") as f:
        return {line.strip() for line in f if line.strip()}


def hash_split(title: str) -> str:
    """Split of a title when the published lists are missing: stable across ranks, runs and machines.

    sha1 of the normalised title rather than ``hash()``, which is salted per process (PYTHONHASHSEED)
    and would give every rank a different split.
    """
    digest = hashlib.sha1(normalise_title(title).encode("utf-8")).hexdigest()
    bucket = int(digest, 16) % _HASH_BUCKETS
    if bucket < _HASH_TRAIN_BELOW:
        return "train"
    if bucket < _HASH_VALIDATION_BELOW:
        return "validation"
    return "test"


def _split_titles(data_dir: Path, split: str) -> set[str] | None:
    """Titles of ``split`` from its list, or None when no list exists (then the hash split applies)."""
    paths = {name: data_dir / file_name for name, file_name in SPLIT_FILES.items()}
    missing = [path for path in paths.values() if not path.is_file()]
    if len(missing) == len(paths):
        get_logger().warning(
            "None of the WikiHow split lists %s exists: using a deterministic split by a hash of the title "
            "(about 94%% train, 3%% validation, 3%% test). It differs from the published split; "
            "`python scripts/download_wikihow.py --data_dir %s` downloads the lists.",
            ", ".join(str(path) for path in missing),
            data_dir,
        )
        return None
    if missing:
        raise DataFileNotFoundError(
            f"WikiHow split list(s) missing: {', '.join(str(path) for path in missing)} (the others exist; "
            f"a mix of published and hashed splits would overlap). {_how_to_get_data(data_dir)}"
        )
    return _read_title_list(paths[split])


def require_csv(data_dir: str | os.PathLike) -> Path:
    """Path of data_dir/wikihowAll.csv, or DataFileNotFoundError with the way to get it.

    Cheap: the training script calls it before loading a (possibly huge) model, so missing data is
    reported in seconds.
    """
    csv_path = Path(data_dir) / CSV_NAME
    if not csv_path.is_file():
        raise DataFileNotFoundError(
            f"WikiHow data file not found: {csv_path.resolve()}. {_how_to_get_data(Path(data_dir))}"
        )
    return csv_path


def _csv_rows(csv_path: Path) -> Iterator[list[str]]:
    """The data rows of wikihowAll.csv that have the header's number of fields, as the builder read them.

    The builder opened the file in text mode (universal newlines), so the published file's "\r\n" line ends,
    inside quoted fields too, reached its clean-up and its length filter as "\n" (docs/pitfalls.md #17); so
    here. Blank lines and broken rows are skipped, as the builder did.
    """
    csv.field_size_limit(_CSV_FIELD_SIZE_LIMIT)
    warn_if_truncated(csv_path)
    with open(csv_path, encoding="utf-8") as f:
        reader = csv.reader(f)
        try:
            check_header(next(reader, None), csv_path)
            for fields in reader:
                if len(fields) == len(EXPECTED_HEADER):
                    yield fields
        except UnicodeDecodeError:
            raise _not_utf8(csv_path) from None


def _not_utf8(csv_path: Path) -> DataError:
    """The error for a wikihowAll.csv that does not decode, naming its first bad line and the fix."""
    return DataError(
        f"{csv_path} is not UTF-8 text (line {_first_undecodable_line(csv_path)}): the file is damaged or not "
        f"the original {CSV_NAME}. {_how_to_get_data(csv_path.parent)}"
    )


def _first_undecodable_line(path: Path) -> int:
    """The number of the first line of `path` that is not UTF-8 (the decoder reads ahead in blocks, so
    the csv reader's position does not say where the bad byte is)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 0


def warn_if_truncated(csv_path: Path) -> None:
    """Warn when the file ends inside a quoted field (an odd number of quote characters), as an interrupted
    download does: the csv module would silently keep the cut-off last row. A run loads three splits from
    the same file: it is read (600 MB for the real one) and warned about once per version of the file."""
    stat = csv_path.stat()
    _warn_if_truncated(csv_path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _warn_if_truncated(csv_path: Path, size: int, mtime_ns: int) -> None:  # noqa: ARG001 - the cache key
    quotes = 0
    with open(csv_path, "rb") as f:
        while chunk := f.read(1 << 24):
            quotes += chunk.count(b'"')
    if quotes % 2:
        get_logger().warning(
            "%s ends inside a quoted field: it looks truncated (an interrupted download?). Its last row is "
            "incomplete; download it again. %s",
            csv_path,
            _how_to_get_data(csv_path.parent),
        )


def load_wikihow(data_dir: str | os.PathLike, split: str) -> pd.DataFrame:
    """One split of WikiHow 'all' as the original builder makes it: columns title, headline, text.

    Rows keep the order of the CSV; the index is 0..n-1.
    """
    if split not in SPLIT_FILES:
        raise ConfigError(f"Unknown WikiHow split {split!r}; valid splits: {', '.join(SPLIT_FILES)}.")
    data_dir = Path(data_dir)
    csv_path = require_csv(data_dir)
    titles = _split_titles(data_dir, split)

    rows: dict[str, list[str]] = {"title": [], "headline": [], "text": []}
    n_read = n_clean = 0
    for fields in _csv_rows(csv_path):
        n_read += 1
        headline, title, text = (field.strip() for field in fields)
        headline, text = filter_and_clean(headline, text)
        if not (headline and text):
            continue
        n_clean += 1
        in_split = hash_split(title) == split if titles is None else normalise_title(title) in titles
        if in_split:
            rows["title"].append(title)
            rows["headline"].append(headline)
            rows["text"].append(text)
    if not rows["title"]:
        source = "the hash split" if titles is None else str(data_dir / SPLIT_FILES[split])
        raise DataError(
            f"{csv_path} yields no usable rows for split {split!r}: {n_read} rows of 3 fields, {n_clean} "
            f"passed the builder's filter, none of them in {source}."
        )
    return pd.DataFrame(rows, columns=["title", "headline", "text"])


# ---------------------------------------------------------------------------------------------------
# The tutorial's Dataset
# ---------------------------------------------------------------------------------------------------


def clean_text(text: str) -> str:
    """The tutorial's clean_text, except that a newline becomes a space.

    The tutorial deleted '\\n', which glued the last word of a paragraph to the first word of the next
    ("bowl.Knead"); a space keeps them apart. Runs of spaces are collapsed.
    """
    for noise in ("Example of text:", "Example of Summary:", "``", '"'):
        text = text.replace(noise, "")
    text = text.replace("\n", " ")
    return _SPACES.sub(" ", text).strip()


class wikihow(Dataset):  # noqa: N801 - the tutorial's name, kept so that its code reads the same
    """WikiHow split as the tutorial's items: 1-D int64 source_ids/source_mask/target_ids/target_mask.

    Source is ``source_prefix + clean_text(text)``, target ``clean_text(headline)``. Items are tokenised
    in ``__getitem__`` the first time they are asked for, and their token ids kept for the rest of the run:
    start-up does not tokenise 157k articles, and later epochs do not tokenise again (the tutorial did, in
    every epoch). The ids are kept unpadded in int32, about 2 KB per article at 512 tokens, in the process
    that reads the items (each DataLoader worker when there are workers). The first five arguments are the
    tutorial's; its ``print_text`` moved into ``options``.
    """

    def __init__(
        self,
        tokenizer,
        type_path: str,
        num_samples: int | None,
        input_length: int,
        output_length: int,
        options: DataConfig | None = None,
    ) -> None:
        # Without options: the embedded sample, padded to the max lengths as the tutorial's Dataset did.
        options = options or DataConfig(pad_to_max_length=True)
        if num_samples is not None and num_samples < 1:
            raise ConfigError(f"num_samples must be None (all) or at least 1, got {num_samples}.")
        for name, length in (("input_length", input_length), ("output_length", output_length)):
            if length < 1:
                raise ConfigError(f"{name} must be at least 1, got {length}.")
        self.dataset = self._select(load_wikihow(options.data_dir, type_path), num_samples, type_path)
        # Plain lists: indexing them is much cheaper than DataFrame.iloc in every __getitem__.
        self._texts: list[str] = self.dataset["text"].tolist()
        self._headlines: list[str] = self.dataset["headline"].tolist()
        self.tokenizer = tokenizer
        self.input_length = input_length
        self.output_length = output_length
        self.print_text = options.print_text
        self.source_prefix = options.source_prefix
        self.pad_to_max_length = options.pad_to_max_length
        self._token_ids: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # index -> (source, target) ids

    @staticmethod
    def _select(frame: pd.DataFrame, num_samples: int | None, split: str) -> pd.DataFrame:
        if num_samples is None:
            return frame
        if num_samples > len(frame):
            get_logger().warning(
                "Asked for %d %s samples but the split has only %d; using all %d.",
                num_samples,
                split,
                len(frame),
                len(frame),
            )
            return frame
        return frame.iloc[:num_samples].reset_index(drop=True)

    def __len__(self) -> int:
        return len(self._texts)

    def clean_text(self, text: str) -> str:
        return clean_text(text)

    def title(self, index: int) -> str:
        return self.dataset["title"].iat[index]

    def article(self, index: int) -> str:
        """The article as the builder left it: one paragraph (step) per line, not yet cleaned."""
        return self._texts[index]

    def reference(self, index: int) -> str:
        """The summary as the model is trained to write it (cleaned, untruncated): what ROUGE scores against."""
        return self.clean_text(self._headlines[index])

    def _encode(self, text: str, max_length: int) -> torch.Tensor:
        # Called directly: transformers 5 removed batch_encode_plus (docs/pitfalls.md #9). T5's tokenizer appends
        # </s> itself, also after truncation.
        ids = self.tokenizer(text, max_length=max_length, truncation=True)["input_ids"]
        return torch.tensor(ids, dtype=torch.int32)

    def _features(self, ids: torch.Tensor, max_length: int) -> dict[str, torch.Tensor]:
        """input_ids and attention_mask, right-padded to max_length with pad_to_max_length (else unpadded)."""
        width = max_length if self.pad_to_max_length else len(ids)
        input_ids = torch.full((width,), self.tokenizer.pad_token_id, dtype=torch.long)
        input_ids[: len(ids)] = ids
        return {"input_ids": input_ids, "attention_mask": (torch.arange(width) < len(ids)).long()}

    def convert_to_features(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if index not in self._token_ids:
            source_text = self.source_prefix + self.clean_text(self._texts[index])
            if self.print_text:
                get_logger().info("Input Text: %s", source_text)
            target_text = self.clean_text(self._headlines[index])
            self._token_ids[index] = (
                self._encode(source_text, self.input_length),
                self._encode(target_text, self.output_length),
            )
        source, target = self._token_ids[index]
        return self._features(source, self.input_length), self._features(target, self.output_length)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        source, target = self.convert_to_features(index)
        return {
            "source_ids": source["input_ids"],
            "source_mask": source["attention_mask"],
            "target_ids": target["input_ids"],
            "target_mask": target["attention_mask"],
        }


# ---------------------------------------------------------------------------------------------------
# Batching and labels
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# Each rank's datasets and loaders (needs the process group: the samplers read rank and world size)
# ---------------------------------------------------------------------------------------------------


def build_dataset(tokenizer, split: str, num_samples: int, data: DataConfig, world_size: int) -> wikihow:
    """The tutorial's wikihow Dataset of one split, with at least one sample per rank."""
    num_or_all = num_samples or None  # 0 means all
    dataset = wikihow(tokenizer, split, num_or_all, data.max_source_length, data.max_target_length, data)
    if len(dataset) < world_size:
        raise DataError(
            f"the {split} split of {data.data_dir} has {len(dataset)} usable samples, fewer than the "
            f"{world_size} ranks: every rank needs at least one. Use more data or fewer processes."
        )
    return dataset


def build_loaders(
    tokenizer, data: DataConfig, train: TrainConfig, evaluation: EvalConfig, info: DistInfo
) -> Loaders:
    """This rank's training loader (shuffled, resumable), validation loader (in order, padded) and ROUGE
    set; --run_validation false builds neither of the last two."""
    train_set = build_dataset(tokenizer, "train", data.num_train_samples, data, info.world_size)
    grouping = None
    if data.group_by_length:
        lengths = [len(article) for article in train_set.dataset["text"].tolist()]
        grouping = LengthGrouping(lengths, train.batch_size_training)
    train_sampler = train_sampler_for(train_set, info.rank, info.world_size, train.seed, grouping)
    collate = functools.partial(pad_collate, pad_token_id=tokenizer.pad_token_id)
    loader_args = dict(collate_fn=collate, num_workers=train.num_workers_dataloader, device=info.device)
    train_loader = build_loader(train_set, train_sampler, train.batch_size_training, **loader_args)
    val, val_num_real, rouge_set = None, 0, None
    if train.run_validation:
        val_set = build_dataset(tokenizer, "validation", data.num_val_samples, data, info.world_size)
        val_sampler = PaddedEvalSampler(len(val_set), info.rank, info.world_size)
        val = build_loader(val_set, val_sampler, train.val_batch_size, **loader_args)
        val_num_real = val_sampler.num_real_samples
        if evaluation.eval_rouge:
            rouge_set = build_eval_set(tokenizer, data, train, evaluation, info, "validation")
    get_logger().info("samples: train %d, validation %s", len(train_set), len(val.dataset) if val else "-")
    return Loaders(train_loader, train_sampler, val, val_num_real, rouge_set)


def build_eval_set(
    tokenizer, data: DataConfig, train: TrainConfig, evaluation: EvalConfig, info: DistInfo, split: str
) -> EvalSet:
    """The first --eval_num_samples articles of `split`, each batch padded to its longest source only
    (generation needs no fixed shapes)."""
    dynamic = dataclasses.replace(data, pad_to_max_length=False)
    dataset = build_dataset(tokenizer, split, evaluation.eval_num_samples, dynamic, info.world_size)
    sampler = PaddedEvalSampler(len(dataset), info.rank, info.world_size)
    collate = functools.partial(pad_collate, pad_token_id=tokenizer.pad_token_id)
    loader = build_loader(
        dataset, sampler, train.val_batch_size, collate, train.num_workers_dataloader, info.device
    )
    return EvalSet(split, dataset, loader, sampler)
