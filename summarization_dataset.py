"""The tutorial's Dataset over any source of rows, and the WikiHow reader with the original builder's semantics.

Every source (WikiHow here; files, a saved dataset or a named one in utils/data/sources.py) is reduced to the
text cache, one memory-mapped Arrow file per split with the columns id, source and target; from there, the
token cache, `SummarizationDataset` (the tutorial's ``wikihow`` Dataset, for every source), sampling, resume
and evaluation are one path. `text_source` says which source a run reads. WikiHow is the default:

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

The data is read once per machine, not once per rank and split: the first run's LOCAL_RANK 0 writes the
splits into memory-mapped Arrow files under ``--cache_dir`` (default beside the data), and every rank and
later run reads them from there; the token ids of the rows a run uses are cached beside them the same way,
keyed by the text cache, the tokenizer, the lengths and the prefix (utils/data/shared_cache.py says how the
processes share the build, and what happens to a damaged or half-built cache).

``pad_collate`` batches its items for the training loop.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import hashlib
import io
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from datasets.fingerprint import Hasher
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset
from tqdm import tqdm

from configs.data import DataConfig, rows_to_read
from configs.errors import ConfigError, DataError, DataFileNotFoundError
from configs.evaluation import EvalConfig, generation_rows
from configs.training import TrainConfig
from utils.data import sources
from utils.data.loaders import EvalSet, Loaders, build_loader
from utils.data.samplers import LengthGrouping, PaddedEvalSampler, length_keys, train_sampler_for
from utils.data.shared_cache import checked_manifest, complete_folders, folder_for, shared_folder
from utils.data.sources import (
    SPLITS,
    WIKIHOW_CSV,
    SplitWriter,
    TextSource,
    file_fingerprint,
    how_to_get_wikihow,
    not_utf8,
)
from utils.distributed.process_group import DistInfo, is_rank0, usable_cpus
from utils.files import writable
from utils.log import ProgressLines, bars_shown, get_logger, progress_bar

EXPECTED_HEADER = ["headline", "title", "text"]
# Split name -> the authors' list of titles for it (names as the builder and the tutorial use them).
SPLIT_FILES = {"train": "all_train.txt", "validation": "all_val.txt", "test": "all_test.txt"}

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


def check_header(header: Sequence[str] | None, csv_path: str | os.PathLike) -> None:
    """Raise DataError unless ``header`` is the header of the original wikihowAll.csv."""
    if header is None or list(header) != EXPECTED_HEADER:
        found = "nothing (the file is empty)" if header is None else ",".join(header)
        raise DataError(
            f"{csv_path} has the header {found!r}, expected {','.join(EXPECTED_HEADER)!r}: the file must "
            f"be the original {WIKIHOW_CSV} of the WikiHow dataset (config 'all')."
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


def _split_lists(data_dir: Path) -> dict[str, Path] | None:
    """The authors' split lists, or None when none exists (then the hash split applies)."""
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
            f"a mix of published and hashed splits would overlap). {how_to_get_wikihow(data_dir)}"
        )
    return paths


def require_csv(data_dir: str | os.PathLike) -> Path:
    """Path of data_dir/wikihowAll.csv, or DataFileNotFoundError with the way to get it.

    Cheap: the training script calls it before loading a (possibly huge) model, so missing data is
    reported in seconds.
    """
    csv_path = Path(data_dir) / WIKIHOW_CSV
    if not csv_path.is_file():
        raise DataFileNotFoundError(
            f"WikiHow data file not found: {csv_path.resolve()}. {how_to_get_wikihow(Path(data_dir))}"
        )
    return csv_path


def _csv_rows(csv_path: Path, progress: tqdm | ProgressLines | None = None) -> Iterator[list[str]]:
    """The data rows of wikihowAll.csv that have the header's number of fields, as the builder read them.

    The builder opened the file in text mode (universal newlines), so the published file's "\r\n" line ends,
    inside quoted fields too, reached its clean-up and its length filter as "\n" (docs/pitfalls.md #17); so
    here. Blank lines and broken rows are skipped, as the builder did. `progress` counts the bytes read.
    """
    csv.field_size_limit(_CSV_FIELD_SIZE_LIMIT)
    with open(csv_path, "rb") as raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
        reader = csv.reader(f)
        try:
            check_header(next(reader, None), csv_path)
            for number, fields in enumerate(reader):
                if progress is not None and number % 4096 == 0:
                    progress.update(raw.tell() - progress.n)
                if len(fields) == len(EXPECTED_HEADER):
                    yield fields
        except UnicodeDecodeError:
            raise _not_utf8(csv_path) from None
    if progress is not None:
        progress.update(progress.total - progress.n)


def _not_utf8(csv_path: Path) -> DataError:
    """The error for a wikihowAll.csv that does not decode, naming its first bad line and the fix."""
    return not_utf8(
        csv_path, f"The file is damaged or not the original {WIKIHOW_CSV}. {how_to_get_wikihow(csv_path.parent)}"
    )


def _ends_inside_a_quoted_field(csv_path: Path) -> bool:
    """An odd number of quote characters: the file was cut inside a quoted field, as an interrupted download
    leaves it, and the csv module would silently keep the cut-off last row."""
    quotes = 0
    with open(csv_path, "rb") as f:
        while chunk := f.read(1 << 24):
            quotes += chunk.count(b'"')
    return quotes % 2 == 1


# ---------------------------------------------------------------------------------------------------
# The cache: the builder's splits, then their token ids, in memory-mapped Arrow files
# ---------------------------------------------------------------------------------------------------

# Bump when the reading or cleaning above changes (the text cache is rebuilt), or when clean_text or the
# encoding of items below changes (the token cache is rebuilt).
CLEANING_VERSION = 2
ENCODING_VERSION = 2
_TOKEN_FEATURES = datasets.Features(
    {"source_ids": datasets.List(datasets.Value("int32")), "target_ids": datasets.List(datasets.Value("int32"))}
)
# Starting a tokenising process (a fork, the tokenizer pickled) pays off from about this many rows.
_ROWS_PER_TOKENISING_PROCESS = 10_000
# Each is a fork of a rank (after its process group is set up) holding a tokenizer: a few suffice.
_MAX_TOKENISING_PROCESSES = 8

# Warnings about a cache's content, once per process and folder (not once per split or dataset).
_WARNED: set[tuple[Path, str]] = set()


def _write_wikihow_cache(csv_path: Path, lists: dict[str, Path] | None, folder: Path) -> dict:
    """Read wikihowAll.csv once and write each split's rows (the builder's, in file order) to <split>.arrow:
    id the title, source the text, target the headline."""
    titles = {split: _read_title_list(path) for split, path in lists.items()} if lists else None
    n_read = n_clean = 0
    writers = {split: SplitWriter(folder / f"{split}.arrow") for split in SPLIT_FILES}
    with contextlib.ExitStack() as stack:
        for writer in writers.values():
            stack.callback(writer.close)
        progress = stack.enter_context(progress_bar(csv_path.stat().st_size, f"Caching {WIKIHOW_CSV}", unit="B"))
        for fields in _csv_rows(csv_path, progress):
            n_read += 1
            headline, title, text = (field.strip() for field in fields)
            headline, text = filter_and_clean(headline, text)
            if not (headline and text):
                continue
            n_clean += 1
            if titles is None:
                splits = [hash_split(title)]
            else:  # as the builder: a split takes every row whose title is in its list
                splits = [split for split, names in titles.items() if normalise_title(title) in names]
            for split in splits:
                writers[split].add(title, text, headline)
    origin = {split: "the hash split" if lists is None else str(lists[split]) for split in SPLIT_FILES}
    return {
        "rows": {split: writer.rows for split, writer in writers.items()},
        "skipped": dict.fromkeys(SPLIT_FILES, 0),  # the builder's filter drops rows silently, as it did
        "origin": origin,
        "rows_read": n_read,
        "rows_clean": n_clean,
        "truncated": _ends_inside_a_quoted_field(csv_path),
    }


def wikihow_source(data_dir: Path) -> TextSource:
    """WikiHow 'all' in data_dir, as the original builder made it."""
    csv_path = require_csv(data_dir)
    lists = _split_lists(data_dir)
    key = {
        "csv": file_fingerprint(csv_path),
        "split_lists": {name: _file_sha256(path) for name, path in lists.items()} if lists else "hash split",
        "cleaning": CLEANING_VERSION,
    }
    write = functools.partial(_write_wikihow_cache, csv_path, lists)
    return TextSource(f"WikiHow ({csv_path})", key, write, "wikihow", data_dir / "cache", add_split="")


def text_source(data: DataConfig) -> TextSource:
    """Where the run's rows come from: files or a dataset the flags name, else what --data_dir holds
    (WikiHow, split files, a save_to_disk folder). Cheap: the files are found, not read."""
    sources.check_data_found(data)  # each missing file or folder said with the way to get it
    named = sources.named_source(data)
    if named is not None:
        return named
    folder = Path(data.data_dir)
    if (folder / WIKIHOW_CSV).is_file():
        return wikihow_source(folder)
    return sources.folder_source(folder, data)


def cache_root(data: DataConfig, source: TextSource) -> Path:
    """Where the text cache lives: --cache_dir, by default beside the data (TextSource.default_cache)."""
    return Path(data.cache_dir) if data.cache_dir else source.default_cache


def usable_cache_root(root: Path, ready: Callable[[Path], bool]) -> Path:
    """`root`, where this process can write it or `ready(root)` says what is needed is built there already (a
    shared, read-only dataset mount with its cache); else a folder of this user's cache, said once."""
    if writable(root) or ready(root):
        return root
    fallback = user_cache_dir() / hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    if is_rank0():
        _warn_once(root, "read-only",
                   "%s cannot be written: the data's cache goes to %s instead (--cache_dir chooses another)",
                   root, fallback)  # fmt: skip
    return fallback


def is_built(root: Path, name: str, key: dict) -> bool:
    """Whether the cache folder of `key` under `root` is complete."""
    return checked_manifest(folder_for(root, name, key), key)[0] is not None


def user_cache_dir() -> Path:
    """This user's cache folder for data caches that cannot go beside their data (XDG_CACHE_HOME's)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "t5_fsdp_data"


@dataclasses.dataclass(frozen=True)
class CachedSplit:
    rows: datasets.Dataset  # id, source, target; memory-mapped
    cache: Path  # the text cache folder: its name identifies the content
    cleaning: str  # how a text is prepared (CLEANINGS)
    what: str  # the source, for messages


def _warn_once(folder: Path, topic: str, message: str, *args) -> None:
    if (folder, topic) not in _WARNED:
        _WARNED.add((folder, topic))
        get_logger().warning(message, *args)


def _text_cache(data: DataConfig) -> tuple[TextSource, Path, dict]:
    """The run's source, its text cache folder and the cache's manifest (the cache built first if needed)."""
    source = text_source(data)
    root = cache_root(data, source)
    if not data.cache_dir:  # a --cache_dir is where the user wants it, or a clear error
        root = usable_cache_root(root, lambda root: is_built(root, "text", source.key))
    folder, manifest = shared_folder(root, "text", source.key, source.write, f"the text cache of {source.what}")
    return source, folder, manifest


def evaluation_split(data: DataConfig, asked: str) -> str:
    """The split --evaluate_only scores: --eval_split, or for auto the validation split where the data has
    one of its own, else its test split (a test file alone will do)."""
    if asked != "auto":
        return asked
    origin = _text_cache(data)[2]["origin"]
    # A validation split held out of train is no better than a test split the data has.
    held_out = "held out" in origin.get("validation", "held out")
    return "test" if "test" in origin and held_out else "validation"


def _cached_split(data: DataConfig, split: str) -> CachedSplit:
    """One split of the run's source, memory-mapped from the text cache (built first if needed)."""
    if split not in SPLITS:
        raise ConfigError(f"Unknown split {split!r}; valid splits: {', '.join(SPLITS)}.")
    source, folder, manifest = _text_cache(data)
    if manifest.get("truncated"):
        _warn_once(folder, "truncated",
                   "%s ends inside a quoted field: it looks truncated (an interrupted download?). Its last row is "
                   "incomplete; download it again.", source.what)  # fmt: skip
    skipped = sum(manifest["skipped"].values())
    if skipped:
        per_split = ", ".join(f"{name} {n}" for name, n in manifest["skipped"].items() if n)
        _warn_once(folder, "skipped", "%s: skipped %d rows whose text or target is empty (%s)", source.what,
                   skipped, per_split)  # fmt: skip
    if split not in manifest["origin"]:  # WikiHow has every split
        raise DataError(f"no {split} split in {source.what}: {source.add_split.format(split=split)}.")
    if manifest["rows"][split] == 0:
        if "rows_read" in manifest:  # WikiHow
            raise DataError(
                f"{source.what} yields no usable rows for split {split!r}: {manifest['rows_read']} rows of 3 "
                f"fields, {manifest['rows_clean']} passed the builder's filter, none of them in "
                f"{manifest['origin'][split]}."
            )
        held_out = "held out" in manifest["origin"][split]
        fix = "Give it rows, or train at least 2 rows to hold 1 out." if held_out else "Give it rows."
        raise DataError(
            f"the {split} split of {source.what} is empty ({manifest['origin'][split]}; "
            f"{manifest['skipped'][split]} rows with an empty text or target skipped). {fix}"
        )
    rows = datasets.Dataset.from_file(str(folder / f"{split}.arrow"))
    return CachedSplit(rows, folder, source.cleaning, source.what)


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_wikihow(data_dir: str | os.PathLike, split: str, cache_dir: str | os.PathLike = "") -> datasets.Dataset:
    """One split of WikiHow 'all' as the original builder makes it: columns title, headline, text, in the
    order of the CSV; memory-mapped from the cache under `cache_dir` (default <data_dir>/cache)."""
    cached = _cached_split(DataConfig(data_dir=str(data_dir), cache_dir=str(cache_dir)), split)
    builder_names = cached.rows.rename_columns({"id": "title", "source": "text", "target": "headline"})
    return builder_names.select_columns(["title", "headline", "text"])


def tokenizer_fingerprint(tokenizer) -> str:
    """What makes two tokenizers give the same ids: a fast tokenizer's definition (vocabulary, normaliser,
    special tokens; not the truncation and padding state that each call sets), else datasets' hash of it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return Hasher.hash(tokenizer)
    definition = json.loads(backend.to_str())
    for per_call_state in ("truncation", "padding"):
        definition.pop(per_call_state, None)
    text = json.dumps([type(tokenizer).__name__, definition], sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _encode_batch(
    batch: dict, tokenizer, clean: Callable[[str], str], source_prefix: str, input_length: int, output_length: int
) -> dict:
    """Token ids of a batch of rows: the source is the prefix and the cleaned text, the target the cleaned
    target. The tokenizer is called directly: transformers 5 removed batch_encode_plus (docs/pitfalls.md #9).
    T5's tokenizer appends </s> itself, also after truncation."""
    sources = [source_prefix + clean(text) for text in batch["source"]]
    targets = [clean(target) for target in batch["target"]]
    return {
        "source_ids": tokenizer(sources, max_length=input_length, truncation=True)["input_ids"],
        "target_ids": tokenizer(targets, max_length=output_length, truncation=True)["input_ids"],
    }


def _tokenising_processes(rows: int) -> int | None:
    """Worker processes for tokenising `rows` articles: one per _ROWS_PER_TOKENISING_PROCESS, at most one per
    CPU this process may use; None (in this process) below two. The fast tokenizer already encodes a batch
    on several threads, but the cleaning and the Arrow conversion around it are Python, one core each: on
    2 CPUs, two processes tokenise 152k articles in 95 s instead of 113 s."""
    processes = min(usable_cpus(), rows // _ROWS_PER_TOKENISING_PROCESS, _MAX_TOKENISING_PROCESSES)
    return processes if processes >= 2 else None


def _write_token_cache(rows: datasets.Dataset, split: str, encode: functools.partial, folder: Path) -> dict:
    rows.map(
        encode,
        batched=True,
        batch_size=1000,
        num_proc=_tokenising_processes(len(rows)),
        remove_columns=rows.column_names,
        features=_TOKEN_FEATURES,
        cache_file_name=str(folder / "ids.arrow"),  # with worker processes: ids_0000i_of_0000n.arrow
        load_from_cache_file=False,
        new_fingerprint=folder.name.split(".partial")[0],  # the cache is this folder, not datasets' own
        desc=f"Tokenising {len(rows)} {split} rows",
    )
    return {}


def unknown_token_counts(ids: datasets.Dataset, unk_id: int | None) -> dict:
    """How many source and target tokens of `ids` (a split's token ids, the rows a run reads) are the
    tokenizer's unknown token, how many rows hold one, and the first such row (text the tokenizer cannot read:
    the wrong model for the language, say). Chunk by chunk: a column's chunks stay as the cache holds them."""
    counts = {"source": 0, "target": 0, "source_total": 0, "target_total": 0, "rows": 0, "first_row": None,
              "rows_total": len(ids)}  # fmt: skip
    holding = np.zeros(len(ids), dtype=bool)
    for side in ("source", "target"):
        start = 0
        for chunk in ids.data.column(f"{side}_ids").chunks:
            flat = chunk.flatten().to_numpy(zero_copy_only=False)
            counts[f"{side}_total"] += len(flat)
            if unk_id is not None and len(flat):
                hits = np.flatnonzero(flat == unk_id)
                counts[side] += len(hits)
                offsets = chunk.offsets.to_numpy()  # a slice's start at offsets[0], not 0
                rows_hit = np.searchsorted(offsets - offsets[0], hits, side="right") - 1
                holding[start + rows_hit] = True
            start += len(chunk)
    counts["rows"] = int(holding.sum())
    counts["first_row"] = int(holding.argmax()) if holding.any() else None
    return counts


def _cached_token_ids(
    rows: datasets.Dataset, cached: CachedSplit, split: str, tokenizer, data: DataConfig, input_length: int,
    output_length: int,
) -> datasets.Dataset:  # fmt: skip
    """Token ids (unpadded, int32) of `rows`, the first rows of a split, from the token cache: tokenised once
    per machine, and reused by every epoch, every rank and every later run with the same text cache (the
    source's files, columns and split), tokenizer, lengths and prefix. A cache of more rows (a run that used
    more of them) serves too. Where the text cache's folder cannot be written and lacks these ids, they go to
    this user's cache (usable_cache_root)."""
    key = {
        "text_cache": cached.cache.name,
        "split": split,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "truncation_side": getattr(tokenizer, "truncation_side", "right"),
        "source_prefix": data.source_prefix,
        "input_length": input_length,
        "output_length": output_length,
        "encoding": ENCODING_VERSION,
    }

    def larger_cache(root: Path) -> tuple[Path, dict] | None:
        for folder, manifest in complete_folders(root, "tokens"):
            saved = dict(manifest["key"])
            # A folder written by another version of this key (no row count) never matches.
            if saved.pop("rows", -1) > len(rows) and saved == key:
                return folder, manifest
        return None

    sized_key = {**key, "rows": len(rows)}
    root = cached.cache.parent
    if not data.cache_dir:  # beside the text cache, unless that cannot be written and lacks these ids
        root = usable_cache_root(
            root, lambda root: is_built(root, "tokens", sized_key) or larger_cache(root) is not None
        )

    encode = functools.partial(
        _encode_batch, tokenizer=tokenizer, clean=CLEANINGS[cached.cleaning], source_prefix=data.source_prefix,
        input_length=input_length, output_length=output_length,
    )  # fmt: skip
    build = functools.partial(_write_token_cache, rows, split, encode)
    what = f"the token ids of {len(rows)} {split} rows"
    reuse = functools.partial(larger_cache, root)
    folder, manifest = shared_folder(root, "tokens", sized_key, build, what, reuse=reuse)
    parts = [datasets.Dataset.from_file(str(folder / part)) for part in sorted(manifest["files"])]
    return datasets.concatenate_datasets(parts).select(range(len(rows)))


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


# How a source's texts are prepared for the tokenizer and for scoring, by the name a TextSource gives: WikiHow's
# cleaning, or the text as it is (surrounding white space aside). Models record the name (scripts/summarize.py).
CLEANINGS: dict[str, Callable[[str], str]] = {"wikihow": clean_text, "plain": str.strip}


class SummarizationDataset(Dataset):
    """One split of the run's source as the tutorial's `wikihow` Dataset made its items: 1-D int64
    source_ids/source_mask/target_ids/target_mask.

    Source is ``source_prefix + clean(source text)``, target ``clean(target text)``, where `clean` is the
    source's (WikiHow's clean_text, or the text as it is). ``self.dataset`` holds the rows (id, source, target)
    and ``self.token_ids`` their token ids (unpadded, int32), both memory-mapped from the cache under
    --cache_dir: the data is read and tokenised once per machine and kept once, in the OS page cache, for every
    rank, epoch and later run, not copied into each process. The first five arguments are the tutorial's; its
    ``print_text`` moved into ``options``.
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
        cached = _cached_split(options, type_path)
        self.split = type_path
        self.split_rows = len(cached.rows)  # the whole split's, before num_samples
        self.dataset = self._select(cached.rows, num_samples)
        self.token_ids = _cached_token_ids(
            self.dataset, cached, type_path, tokenizer, options, input_length, output_length
        )
        self.source_description = cached.what
        self.cleaning = cached.cleaning
        self.clean_text = CLEANINGS[cached.cleaning]
        self.tokenizer = tokenizer
        self.input_length = input_length
        self.output_length = output_length
        self.print_text = options.print_text
        self.source_prefix = options.source_prefix
        self.pad_to_max_length = options.pad_to_max_length

    @functools.cached_property
    def unknown_tokens(self) -> dict:
        """unknown_token_counts of the rows this dataset reads, counted when first asked: by rank 0 alone, for
        its warning and the run record."""
        return unknown_token_counts(self.token_ids, self.tokenizer.unk_token_id)

    @staticmethod
    def _select(rows: datasets.Dataset, num_samples: int | None) -> datasets.Dataset:
        """The first num_samples rows (all where None or more than the split has: build_dataset says so)."""
        if num_samples is None or num_samples >= len(rows):
            return rows
        return rows.select(range(num_samples))  # a slice of the memory-mapped table, not a copy

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


def build_dataset(
    tokenizer, split: str, num_samples: int | None, data: DataConfig, world_size: int, read_as: str = ""
) -> SummarizationDataset:
    """The tutorial's Dataset of one split, the first `num_samples` rows (0: all; None: by source,
    rows_to_read, as split `read_as` would be: generation reads any split as the validation split), with at
    least one sample per rank. More rows asked for than the split has: all of them, said once, by rank 0."""
    tutorial_data = text_source(data).cleaning == "wikihow"
    limit = rows_to_read(num_samples, read_as or split, tutorial_data)
    dataset = SummarizationDataset(tokenizer, split, limit, data.max_source_length, data.max_target_length, data)
    rank0 = is_rank0()
    if num_samples and num_samples > dataset.split_rows and rank0:
        _warn_once(Path(dataset.source_description), f"{split} rows asked",
                   "asked for %d %s rows but the split of %s has %d: using all %d", num_samples, split,
                   dataset.source_description, dataset.split_rows, dataset.split_rows)  # fmt: skip
    if rank0:
        warn_unknown_tokens(dataset, tokenizer)
    if len(dataset) < world_size:
        raise DataError(
            f"the {split} split of {dataset.source_description} has {len(dataset)} usable "
            f"sample{'s' if len(dataset) != 1 else ''}, fewer than the "
            f"{world_size} ranks: every rank needs at least one. Use more data or fewer processes."
        )
    return dataset


# Above this share of tokens that are the unknown token, the data is mostly readable only in part.
UNKNOWN_TOKEN_SHARE = 0.001


def warn_unknown_tokens(dataset: SummarizationDataset, tokenizer) -> None:
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
    _warn_once(Path(dataset.source_description), f"{dataset.split} unknown tokens",
               "%s, %s split: %.1f%% of source and %.1f%% of target tokens are the tokenizer's unknown token "
               "(%d of %d rows hold one; the characters it cannot read in %s). The model will not see that "
               "text: use a model whose tokenizer covers it (a multilingual one such as google/mt5-base or "
               "google/umt5-base)",
               dataset.source_description, dataset.split, 100 * shares["source"], 100 * shares["target"],
               counts["rows"], counts["rows_total"], ", and in ".join(where))  # fmt: skip


def rows_phrase(dataset: SummarizationDataset, asked: int | None, flag: str) -> str:
    """How many rows of its split a dataset reads and why, for the start line (`asked`: the value of `flag`,
    the setting that chose them)."""
    split = dataset.split
    if len(dataset) == dataset.split_rows:
        return f"{split} {len(dataset)} (all)"
    why = flag if asked is not None else f"the tutorial's subset of WikiHow; {flag} 0 for all"
    return f"{split} {len(dataset)} of {dataset.split_rows} ({why})"


def build_loaders(
    tokenizer, data: DataConfig, train: TrainConfig, evaluation: EvalConfig, info: DistInfo
) -> Loaders:
    """This rank's training loader (shuffled, resumable), validation loader (in order, padded) and generation
    set; --run_validation false builds neither of the last two. --evaluate_only: its split's set alone (a test
    file alone will do)."""
    if not bars_shown():  # datasets' own bars (loading, tokenising) follow the package's rule, in this process
        datasets.disable_progress_bars()
    if evaluation.evaluate_only:
        split = evaluation_split(data, evaluation.eval_split)
        if evaluation.eval_split == "auto":
            why = " (the data has no validation split of its own)" if split == "test" else ""
            get_logger().info("--eval_split auto: scoring the %s split%s", split, why)
        eval_set = build_eval_set(tokenizer, data, train, evaluation, info, split)
        get_logger().info(
            "rows: %s",
            rows_phrase(
                eval_set.dataset, generation_rows(evaluation, data.num_val_samples), generation_flag(evaluation)
            ),
        )
        return Loaders(None, None, None, 0, eval_set, eval_set.dataset.cleaning)
    train_set = build_dataset(tokenizer, "train", data.num_train_samples, data, info.world_size)
    grouping = None
    if data.group_by_length:
        targets = train_set.target_lengths() if data.length_key != "source" else None
        keys = length_keys(train_set.source_lengths(), targets, data.length_key)
        grouping = LengthGrouping(keys, train.batch_size_training)
    train_sampler = train_sampler_for(train_set, info.rank, info.world_size, train.seed, grouping)
    collate = functools.partial(pad_collate, pad_token_id=tokenizer.pad_token_id)
    loader_args = dict(collate_fn=collate, num_workers=train.num_workers_dataloader, device=info.device)
    train_loader = build_loader(train_set, train_sampler, train.batch_size_training, **loader_args)
    val, val_num_real, eval_set = None, 0, None
    if train.run_validation:
        val_set = build_dataset(tokenizer, "validation", data.num_val_samples, data, info.world_size)
        val_sampler = PaddedEvalSampler(len(val_set), info.rank, info.world_size)
        val = build_loader(val_set, val_sampler, train.val_batch_size, **loader_args)
        val_num_real = val_sampler.num_real_samples
        if evaluation.eval_rouge:
            eval_set = build_eval_set(tokenizer, data, train, evaluation, info, "validation")
    said = [
        rows_phrase(train_set, data.num_train_samples, "--num_train_samples"),
        rows_phrase(val.dataset, data.num_val_samples, "--num_val_samples")
        if val
        else "validation - (--run_validation false)",
    ]
    get_logger().info("rows: %s", ", ".join(said))
    return Loaders(train_loader, train_sampler, val, val_num_real, eval_set, train_set.cleaning)


def generation_flag(evaluation: EvalConfig) -> str:
    """The setting that chose how many rows generation scores (generation_rows)."""
    return "--num_val_samples" if evaluation.eval_num_samples is None else "--eval_num_samples"


def build_eval_set(
    tokenizer, data: DataConfig, train: TrainConfig, evaluation: EvalConfig, info: DistInfo, split: str
) -> EvalSet:
    """The first --eval_num_samples rows of `split` (by default as many as the validation loss reads), each
    batch padded to its longest source only (generation needs no fixed shapes)."""
    dynamic = dataclasses.replace(data, pad_to_max_length=False)
    rows = generation_rows(evaluation, data.num_val_samples)
    dataset = build_dataset(tokenizer, split, rows, dynamic, info.world_size, read_as="validation")
    sampler = PaddedEvalSampler(len(dataset), info.rank, info.world_size)
    collate = functools.partial(pad_collate, pad_token_id=tokenizer.pad_token_id)
    loader = build_loader(
        dataset, sampler, train.val_batch_size, collate, train.num_workers_dataloader, info.device
    )
    return EvalSet(split, dataset, loader, sampler)
