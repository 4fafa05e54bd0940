"""WikiHow 'all' as the original builder made it: the default source of a run (utils/data/cache.py's
text_source picks it where --data_dir holds wikihowAll.csv).

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
warning says so); see ``hash_split``. The rows go to the text cache (utils/data/cache.py), read once per
machine; ``clean_text``, the tutorial's cleaning of a WikiHow text, is applied when they are tokenised.
"""

import contextlib
import csv
import functools
import hashlib
import io
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

from configs.errors import DataError, DataFileNotFoundError
from utils.base.log import ProgressLines, get_logger, progress_bar
from utils.data.sources import WIKIHOW_CSV, SplitWriter, TextSource, file_fingerprint, how_to_get_wikihow, not_utf8

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

# Bump when the reading or cleaning below changes: the text cache is rebuilt. (A change of clean_text
# bumps utils/data/cache.py's ENCODING_VERSION: the token cache is rebuilt.)
CLEANING_VERSION = 2


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

    Cheap: the file is found, not read.
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


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
    files = {path.name: path for path in [csv_path, *(lists or {}).values()]}
    return TextSource(
        f"WikiHow ({csv_path})", key, write, "wikihow", data_dir / "cache", add_split="", files=files
    )


def clean_text(text: str) -> str:
    """The tutorial's clean_text, except that a newline becomes a space.

    The tutorial deleted '\\n', which glued the last word of a paragraph to the first word of the next
    ("bowl.Knead"); a space keeps them apart. Runs of spaces are collapsed.
    """
    for noise in ("Example of text:", "Example of Summary:", "``", '"'):
        text = text.replace(noise, "")
    text = text.replace("\n", " ")
    return _SPACES.sub(" ", text).strip()
