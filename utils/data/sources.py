"""Where a run's rows come from, and the one form every source is reduced to.

Every source becomes the text cache: one memory-mapped Arrow file per split, `<split>.arrow`, with the columns
`id`, `source` (the text the model reads) and `target` (the text it learns to write), built once per machine
under --cache_dir (utils/data/shared_cache.py). From there on, token ids, sampling, resume and evaluation are
one path for every source (utils/data/cache.py). This module holds the sources that are not WikiHow
(whose builder-exact reader is utils/data/wikihow.py):

* **Local files** (--train_file/--validation_file/--test_file, or a --data_dir holding `train.*`,
  `validation.*` (or `val.*`, `valid.*`, `dev.*`) and `test.*`): CSV (with a header row), JSON lines, JSON (a
  list of objects, or an object whose "data" key holds one) and Parquet; and FinancialPhraseBank's own format,
  `.txt` files of `sentence@label` lines (UTF-8, else Latin-1, its original encoding).
* **A folder written by `datasets`' `save_to_disk`** (--data_dir): a DatasetDict, or one Dataset (train).
* **A dataset `datasets.load_dataset` finds** (--dataset_name, --dataset_config_name): a hub name, or a local
  dataset folder.

The columns are --text_column and --summary_column; left empty, a known dataset's (KNOWN_COLUMNS), else the
first of the common names present. A class-label column (FinancialPhraseBank's label) becomes its names.
--dataset_text_field names one column of whole texts instead (a decoder-only model's): each row's text goes in
the target column, its source left empty. Rows whose text or target is empty are skipped and counted (the
manifest keeps the count, one warning says it). Without a validation split, a share of train
(--validation_split_percentage, at least one row) becomes validation, drawn by --validation_split_seed: the
same on every rank, every run and machine.
Bad input is a DataError that names the file, the line or row, and the fix.
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import itertools
import json
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from configs.data import DataConfig
from configs.errors import DataError, DataFileNotFoundError, UserError
from utils.base.files import WRITE_PROBE_PREFIX, closest_folder

SPLITS = ("train", "validation", "test")
TEXT_SCHEMA = pa.schema([("id", pa.string()), ("source", pa.string()), ("target", pa.string())])
# Bump when the reading below changes: every source's text cache is rebuilt.
READING_VERSION = 2

# File types by suffix, with the name messages use.
FILE_TYPES = {
    ".csv": "CSV",
    ".jsonl": "JSON lines",
    ".json": "JSON",
    ".parquet": "Parquet",
    ".txt": "FinancialPhraseBank (sentence@label lines)",
}
# The names a split's file may have in a --data_dir (HF's and the usual abbreviations).
SPLIT_FILE_STEMS = {"train": ("train",), "validation": ("validation", "val", "valid", "dev"), "test": ("test",)}
# (text column, target column) of well-known datasets, by the last part of their name.
KNOWN_COLUMNS = {
    "cnn_dailymail": ("article", "highlights"),
    "xsum": ("document", "summary"),
    "samsum": ("dialogue", "summary"),
    "billsum": ("text", "summary"),
    "multi_news": ("document", "summary"),
    "big_patent": ("description", "abstract"),
    "wikihow": ("text", "headline"),
    "financial_phrasebank": ("sentence", "label"),
}
# Otherwise the first of these present (in this order).
TEXT_COLUMN_NAMES = ("text", "document", "article", "source", "sentence", "dialogue", "input", "content")
TARGET_COLUMN_NAMES = ("summary", "highlights", "target", "label", "headline", "output", "abstract")
# The columns of a FinancialPhraseBank file.
PHRASEBANK_COLUMNS = ("sentence", "label")
# Rows per Arrow record batch: small enough that the builder holds little, large enough to write fast.
ROWS_PER_BATCH = 2048
# The file's identity without reading it all: its size, modification time and first and last MiB.
_FINGERPRINT_BYTES = 1 << 20
# WikiHow's data file in a --data_dir, and where it is published (its reader: utils/data/wikihow.py).
WIKIHOW_CSV = "wikihowAll.csv"
WIKIHOW_CSV_URL = "https://ucsb.app.box.com/s/ap23l8gafpezf4tq3wapr6u8241zz358"


@dataclass(frozen=True)
class TextSource:
    """A source of rows: what it is (for messages), what identifies its content (the text cache's key), how to
    write its splits into a folder (`write(folder) -> manifest fields`: rows, skipped and origin per split),
    the name of the cleaning its texts get (utils/data/cache.py: CLEANINGS; models record it, so
    scripts/summarize.py prepares texts the same way), where its cache goes without --cache_dir, how to
    give it a split it lacks (a sentence with {split}, for messages), and the files its rows are read from, each
    under a name that stays when the file moves (its split, or its name in the data folder): what a resume checks
    against its checkpoint (utils/checkpoint/inputs.py); none for a hub dataset, which its name identifies."""

    what: str
    key: dict
    write: Callable[[Path], dict]
    cleaning: str
    default_cache: Path
    add_split: str
    files: dict[str, Path]


def file_fingerprint(path: Path) -> dict:
    stat = path.stat()
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        sha.update(f.read(_FINGERPRINT_BYTES))
        f.seek(max(stat.st_size - _FINGERPRINT_BYTES, 0))
        sha.update(f.read(_FINGERPRINT_BYTES))
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "head_and_tail_sha256": sha.hexdigest()}


def first_undecodable_line(path: Path) -> int:
    """The number of the first line of `path` that is not UTF-8 (a decoder reads ahead in blocks, so a
    reader's position does not say where the bad byte is)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 0


def not_utf8(path: Path, fix: str) -> DataError:
    return DataError(f"{path}, line {first_undecodable_line(path)}: bytes that are not UTF-8. {fix}")


class SplitWriter:
    """The rows of one split into `<split>.arrow` (TEXT_SCHEMA), a record batch at a time."""

    def __init__(self, path: Path) -> None:
        self._writer = pa.ipc.new_stream(str(path), TEXT_SCHEMA)
        self._batch: dict[str, list[str]] = {name: [] for name in TEXT_SCHEMA.names}
        self.rows = 0

    def add(self, row_id: str, source: str, target: str) -> None:
        for name, value in (("id", row_id), ("source", source), ("target", target)):
            self._batch[name].append(value)
        if len(self._batch["id"]) == ROWS_PER_BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._batch["id"]:
            self._writer.write_batch(pa.RecordBatch.from_pydict(self._batch, schema=TEXT_SCHEMA))
            self.rows += len(self._batch["id"])
            self._batch = {name: [] for name in TEXT_SCHEMA.names}

    def add_batch(self, batch: pa.RecordBatch) -> None:
        """Whole rows at once (already in TEXT_SCHEMA), after the ones added one by one."""
        self._flush()
        self._writer.write_batch(batch)
        self.rows += batch.num_rows

    def close(self) -> None:
        self._flush()
        self._writer.close()


# ---------------------------------------------------------------------------------------------------
# Columns
# ---------------------------------------------------------------------------------------------------


def resolve_column(found: list[str], flag: str, given: str, known: str | None, common: tuple[str, ...], where: str,
                   taken: str | None = None) -> str:  # fmt: skip
    """The column for `flag`: the one given, else the known dataset's, else the first common name present (other
    than `taken`). A missing one is a DataError listing the columns and the closest."""
    name = given or known or next((name for name in common if name in found and name != taken), None)
    role = {"--text_column": "the text", "--summary_column": "the target"}.get(flag, "the texts")
    if name is None:
        raise DataError(
            f"{where} has the columns {', '.join(found) or '(none)'}: none is a usual name for {role}. Name it "
            f"with {flag} COLUMN."
        )
    if name not in found:
        closest = difflib.get_close_matches(name, found, n=1, cutoff=0.5)
        hint = f" Did you mean {flag} {closest[0]}?" if closest else f" Name {role}'s column with {flag}."
        raise DataError(f"{where} has no column {name!r}; its columns: {', '.join(found)}.{hint}")
    return name


def resolve_columns(
    found: list[str], data: DataConfig, where: str, dataset_name: str = ""
) -> tuple[str | None, str]:
    """(text column, target column) of a source whose columns are `found`: the flags, else a known dataset's
    (by the last part of `dataset_name`), else the first common names present. With --dataset_text_field:
    (None, that column): every row is a whole text, trained on as a completion of nothing."""
    if data.dataset_text_field:
        return None, resolve_column(found, "--dataset_text_field", data.dataset_text_field, None, (), where)
    if MESSAGES_COLUMN in found and not (data.text_column or data.summary_column):
        return None, MESSAGES_COLUMN  # conversations: each row's prompt and reply come from its messages
    known = KNOWN_COLUMNS.get(dataset_name.rstrip("/").rsplit("/", 1)[-1].lower(), (None, None))
    known = tuple(name if name in found else None for name in known)  # a folder's name may only look known
    text = resolve_column(found, "--text_column", data.text_column, known[0], TEXT_COLUMN_NAMES, where)
    target = resolve_column(
        found, "--summary_column", data.summary_column, known[1], TARGET_COLUMN_NAMES, where, text
    )
    if text == target:
        raise DataError(f"{where}: the text and the target are both the column {text!r}; give the other one.")
    return text, target


def as_text(value, column: str, where: str) -> str:
    """A field as text: None (a missing value) is empty, bytes are decoded, numbers are written as they read
    (JSON's true/false as such); a list or an object is not a text (DataError naming the column)."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{where}: column {column!r} holds bytes that are not UTF-8 text.") from None
    raise DataError(
        f"{where}: column {column!r} holds a {type(value).__name__}, not a text. Choose a column of texts with "
        "--text_column/--summary_column, or flatten it into one."
    )


MESSAGES_COLUMN = "messages"  # a column of conversations (TRL's conversational format), found by its name


class ChatPrompt(str):
    """A row's prompt that is a conversation: the JSON of its messages before the last ({"role", "content"}
    each), which the tokenizer's chat template renders (utils/data/cache.py). The row's target is the last
    message's content, an assistant's reply: what the model learns to write."""


def whole_text_row(value, column: str, at: str, data: DataConfig) -> tuple[str, str]:
    """(source, target) of a row read by one column (resolve_columns: (None, column)): a conversation's
    (chat_row) or a whole text's (no source: the text is all target)."""
    if isinstance(value, list):
        return chat_row(value, column, at)
    if not data.dataset_text_field:  # a `messages` column found by its name (resolve_columns), no conversation
        raise DataError(
            f"{at}: column {column!r} holds a {type(value).__name__}, not a conversation (a list of role/content "
            "messages; a CSV cell cannot hold one). Name the columns to read: --text_column and --summary_column, "
            "or --dataset_text_field."
        )
    return "", as_text(value, column, at)


def chat_row(messages: list, column: str, at: str) -> tuple[ChatPrompt, str]:
    """(the conversation before its last message, that message's content) of one row's `messages`."""
    if not messages or not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages):
        raise DataError(
            f"{at}: column {column!r} holds a list that is no conversation: each element must be a "
            '{"role": ..., "content": ...} message.'
        )
    if messages[-1]["role"] != "assistant":
        raise DataError(
            f"{at}: the conversation ends with a {messages[-1]['role']!r} message; its last message is what the "
            "model learns to write, an assistant's reply. End each conversation with one."
        )
    return ChatPrompt(json.dumps(messages[:-1], ensure_ascii=False)), as_text(messages[-1]["content"], column, at)


# ---------------------------------------------------------------------------------------------------
# Reading files: each reader yields (where, record) with `where` the line or row for messages
# ---------------------------------------------------------------------------------------------------


def _csv_records(path: Path) -> Iterator[tuple[str, dict]]:
    csv.field_size_limit(2**31 - 1)  # long documents; 2**31 - 1 fits every platform's C long
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: the byte-order mark spreadsheets write
            reader = csv.reader(f)
            header = next(reader, None)
            if not header:
                raise DataError(f"{path} is empty: a CSV file needs a header row naming its columns, then rows.")
            yield "header", {name: None for name in header}
            first_line = reader.line_num + 1  # where the next row starts (a quoted field may span lines)
            for fields in reader:
                row_line, first_line = first_line, reader.line_num + 1
                if not fields:
                    continue  # a blank line
                if len(fields) != len(header):
                    raise DataError(
                        f"{path}, line {row_line}: {len(fields)} fields, the header has {len(header)}. "
                        "Quote every field that holds a comma, a quote or a line break (as spreadsheets "
                        "and pandas' to_csv do)."
                    )
                yield f"line {row_line}", dict(zip(header, fields, strict=True))
    except UnicodeDecodeError:
        raise not_utf8(path, "Save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`).") from None
    except csv.Error as err:
        raise DataError(f"{path}, line {reader.line_num}: does not parse as CSV ({err}).") from None


def _json_lines_records(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark, as some editors write
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                yield f"line {number}", _json_object(path, f"line {number}", line)
    except UnicodeDecodeError:
        raise not_utf8(path, "Save it as UTF-8.") from None


def _json_object(path: Path, where: str, text: str) -> dict:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(
            f"{path}, {where}: not valid JSON ({err.msg} at column {err.colno}). A JSON-lines file holds one "
            "object per line."
        ) from None
    if not isinstance(record, dict):
        raise DataError(
            f"{path}, {where}: a JSON {type(record).__name__}, where an object of columns is expected."
        )
    return record


def _json_records(path: Path) -> Iterator[tuple[str, dict]]:
    """A list of objects, an object whose "data" key holds one, or one object (one row); a .json file of one
    object per line is read as JSON lines (what datasets' json loader does too)."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise not_utf8(path, "Save it as UTF-8.") from None
    try:
        content = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # a second value after the first: JSON lines
            yield from _json_lines_records(path)
            return
        raise DataError(f"{path}, line {err.lineno}: not valid JSON ({err.msg} at column {err.colno}).") from None
    if isinstance(content, dict):
        content = content["data"] if isinstance(content.get("data"), list) else [content]
    if not isinstance(content, list):
        raise DataError(
            f"{path} holds a JSON {type(content).__name__}; expected a list of objects (one per row), an object "
            'whose "data" key holds that list, or one object per line.'
        )
    for number, record in enumerate(content, start=1):
        if not isinstance(record, dict):
            raise DataError(f"{path}, row {number}: a JSON {type(record).__name__}, where an object is expected.")
        yield f"row {number}", record


def _parquet_records(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        parquet = pq.ParquetFile(path)
        yield "header", dict.fromkeys(parquet.schema_arrow.names)
        row = 0
        for batch in parquet.iter_batches():
            for record in batch.to_pylist():
                row += 1
                yield f"row {row}", record
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path} is not a Parquet file that pyarrow can read ({err}).") from None


def _phrasebank_records(path: Path) -> Iterator[tuple[str, dict]]:
    """FinancialPhraseBank's format: `sentence@label` per line, Latin-1 in the original files."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")  # every byte decodes: the original's encoding
    yield "header", dict.fromkeys(PHRASEBANK_COLUMNS)
    # Lines end at "\n" only: str.splitlines would also split at U+0085, which Latin-1 decodes byte 0x85 to.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        sentence, at, label = line.rpartition("@")
        if not at:
            raise DataError(
                f"{path}, line {number}: no '@'. A .txt file is read as FinancialPhraseBank's format, "
                "one `sentence@label` per line; other text data goes in a CSV, JSON lines or Parquet file."
            )
        yield f"line {number}", {"sentence": sentence.strip(), "label": label.strip()}


def file_records(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, record) for every row of a data file, after one ("header", {column: None, ...}) where the
    type has a header."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return _csv_records(path)
    if suffix == ".jsonl":
        return _json_lines_records(path)
    if suffix == ".json":
        return _json_records(path)
    if suffix == ".parquet":
        return _parquet_records(path)
    if suffix == ".txt":
        return _phrasebank_records(path)
    raise DataError(unknown_type(path))


def unknown_type(path: Path) -> str:
    return (
        f"{path}: unknown file type {path.suffix or '(no suffix)'!r}; data files are "
        + ", ".join(f"{suffix} ({name})" for suffix, name in FILE_TYPES.items())
        + "."
    )


def columns_and_records(path: Path) -> tuple[list[str], str, Iterator[tuple[str, dict]]]:
    """The columns of a file (its header, else its first row's keys), where they were read (for messages),
    and an iterator over its records."""
    records = file_records(path)
    first = next(records, None)
    if first is None:
        return [], str(path), iter(())
    where, record = first
    if where == "header":
        return list(record), str(path), records
    return list(record), f"{path} (its first row)", itertools.chain([first], records)


# ---------------------------------------------------------------------------------------------------
# Writing the splits of any source
# ---------------------------------------------------------------------------------------------------


def write_splits(
    folder: Path, splits: dict[str, tuple[str, Iterable[tuple[str, str, str]]]], data: DataConfig
) -> dict:
    """Write each split's rows, given as `split -> (origin, iterable of (id, source, target))`, to
    `<split>.arrow`; rows with an empty text or target are skipped and counted. Without a validation split, a
    share of train becomes validation (_hold_out). The manifest fields: rows, skipped and origin per split."""
    holdout = "validation" not in splits and "train" in splits
    kinds = set()  # conversations (ChatPrompt), or texts
    rows = dict.fromkeys(SPLITS, 0)
    skipped = dict.fromkeys(SPLITS, 0)
    origin = {}
    for split, (where, split_rows) in splits.items():
        origin[split] = where
        name = _BEFORE_HOLDOUT if holdout and split == "train" else f"{split}.arrow"
        writer = SplitWriter(folder / name)
        try:
            for row_id, source, target in split_rows:
                kinds.add(isinstance(source, ChatPrompt))
                # A --dataset_text_field row is its text alone, in the target column (resolve_columns).
                if target.strip() and (source.strip() or data.dataset_text_field):
                    writer.add(row_id, source, target)
                else:
                    skipped[split] += 1
        finally:
            writer.close()
        rows[split] = writer.rows
    if holdout:
        rows["train"], rows["validation"] = _hold_out(folder, rows["train"], data.validation_split_percentage,
                                                      data.validation_split_seed)  # fmt: skip
        origin["validation"] = (
            f"{data.validation_split_percentage}% of {origin['train']} held out "
            f"(--validation_split_seed {data.validation_split_seed})"
        )
    if len(kinds) > 1:
        where = ", ".join(origin.values())
        raise DataError(f"{where}: some rows are conversations and some are texts: give one kind.")
    # Conversations are rendered by the tokenizer's chat template (utils/data/cache.py: the "chat" cleaning).
    return {"rows": rows, "skipped": skipped, "origin": origin, **({"chat": True} if True in kinds else {})}


_BEFORE_HOLDOUT = "train_before_holdout.arrow"


def held_out_positions(count: int, percentage: int, seed: int) -> list[int]:
    """The positions among train's `count` usable rows that become validation (_hold_out): `percentage` of
    them, at least one where there are two or more, drawn by `seed`. utils/data/cache.py puts them back where a
    run evaluates on another split (--eval_split test)."""
    if count < 2:
        return []
    return random.Random(seed).sample(range(count), max(1, count * percentage // 100))


def _hold_out(folder: Path, count: int, percentage: int, seed: int) -> tuple[int, int]:
    """Split the `count` usable train rows into train and validation: `percentage` of them (at least one,
    where there are two or more), drawn by `seed`, the same on every rank, run and machine; both keep the
    file's order. Reads the rows back a record batch at a time, so the builder never holds the split."""
    source = folder / _BEFORE_HOLDOUT
    held = [False] * count
    for position in held_out_positions(count, percentage, seed):
        held[position] = True
    writers = {False: SplitWriter(folder / "train.arrow"), True: SplitWriter(folder / "validation.arrow")}
    try:
        with pa.memory_map(str(source)) as mapped:
            offset = 0
            for batch in pa.ipc.open_stream(mapped):
                mask = pa.array(held[offset : offset + batch.num_rows], pa.bool_())
                writers[False].add_batch(batch.filter(pc.invert(mask)))
                writers[True].add_batch(batch.filter(mask))
                offset += batch.num_rows
    finally:
        for writer in writers.values():
            writer.close()
    source.unlink()
    return writers[False].rows, writers[True].rows


def _file_rows(path: Path, data: DataConfig) -> Iterator[tuple[str, str, str]]:
    """(id, text, target) of every row of a file: the id is the row's "id" column, else its line or row number
    (1-based) in the file."""
    columns, columns_from, records = columns_and_records(path)
    if not columns:
        raise DataError(f"{path} holds no rows: give a file with data, or leave this split out.")
    text_column, target_column = resolve_columns(columns, data, columns_from, path.parent.name)
    for where, record in records:
        at = f"{path}, {where}"
        row_id = as_text(record.get("id"), "id", at) or f"{path.name}:{where.split(' ')[-1]}"
        if text_column is None:
            yield row_id, *whole_text_row(record.get(target_column), target_column, at, data)
        else:
            yield (
                row_id,
                as_text(record.get(text_column), text_column, at),
                as_text(record.get(target_column), target_column, at),
            )


def _dataset_rows(dataset, data: DataConfig, where: str, name: str) -> Iterator[tuple[str, str, str]]:
    """(id, text, target) of every row of a `datasets.Dataset`; class labels become their names."""
    text_column, target_column = resolve_columns(list(dataset.column_names), data, where, name)
    names = {column: feature.names for column, feature in dataset.features.items() if hasattr(feature, "names")}

    def field(column: str, value, at: str) -> str:
        if column in names and isinstance(value, int):
            if value == -1:  # no label (datasets' unlabelled test splits): skipped as an empty target
                return ""
            if not 0 <= value < len(names[column]):
                raise DataError(
                    f"{at}: label {value} of column {column!r} is not one of its {len(names[column])} names."
                )
            return names[column][value]
        return as_text(value, column, at)

    wanted = [column for column in (text_column, target_column, "id") if column in dataset.column_names]
    position = 0
    for batch in dataset.select_columns(wanted).iter(batch_size=ROWS_PER_BATCH):
        ids = batch.get("id")
        targets = batch[target_column]
        texts = batch[text_column] if text_column else [None] * len(targets)
        for index, (text, target) in enumerate(zip(texts, targets, strict=True)):
            position += 1
            at = f"{where}, row {position}"
            row_id = as_text(ids[index], "id", at) if ids is not None else f"{where}:row {position}"
            if text_column is None:
                yield row_id, *whole_text_row(target, target_column, at, data)
            else:
                yield row_id, field(text_column, text, at), field(target_column, target, at)


# ---------------------------------------------------------------------------------------------------
# The sources
# ---------------------------------------------------------------------------------------------------


def split_files_in(folder: Path) -> dict[str, Path]:
    """The split files of a data folder: `train.csv`, `validation.jsonl`, `dev.parquet`, ..."""
    found = {}
    for split, stems in SPLIT_FILE_STEMS.items():
        for stem in stems:
            candidates = [folder / f"{stem}{suffix}" for suffix in FILE_TYPES if suffix != ".txt"]
            present = [path for path in candidates if path.is_file()]
            if len(present) > 1:
                raise DataError(
                    f"{folder} has {len(present)} {split} files ({', '.join(map(str, present))}): keep one."
                )
            if present:
                found[split] = present[0]
                break
    return found


def is_saved_dataset(folder: Path) -> bool:
    """A folder `datasets`' save_to_disk wrote: a DatasetDict's dataset_dict.json, or a Dataset's state.json."""
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def _dataset_files(folder: Path) -> dict[str, Path]:
    """Every file of a dataset folder (its cache/ folder aside, and the write probes another rank may be making
    there: utils/base/files.py write_problem), by its path inside the folder."""
    return {
        str(path.relative_to(folder)): path
        for path in sorted(folder.rglob("*"))
        if not path.name.startswith(WRITE_PROBE_PREFIX)
        and path.is_file()
        and "cache" not in path.relative_to(folder).parts[:1]
    }


def _folder_fingerprint(files: dict[str, Path]) -> list:
    """A dataset folder's files (_dataset_files) by name, size and modification time (cheap: no content is
    read)."""
    return [[name, path.stat().st_size, path.stat().st_mtime_ns] for name, path in files.items()]


def _key(data: DataConfig, inputs: dict) -> dict:
    return {
        **inputs,
        "columns": [data.text_column, data.summary_column]
        + ([data.dataset_text_field] if data.dataset_text_field else []),
        "holdout": [data.validation_split_percentage, data.validation_split_seed],
        "reading": READING_VERSION,
    }


def file_source(files: dict[str, Path], data: DataConfig, add_split: str) -> TextSource:
    """Local files, one per split (any may be absent); `add_split` says how to give a missing one."""
    for path in files.values():
        if path.suffix.lower() not in FILE_TYPES:
            raise DataError(unknown_type(path))
    inputs = {split: [str(path.resolve()), file_fingerprint(path)] for split, path in files.items()}

    def write(folder: Path) -> dict:
        splits = {split: (str(path), _file_rows(path, data)) for split, path in files.items()}
        return write_splits(folder, splits, data)

    what = "the files " + ", ".join(str(path) for path in files.values())
    default_cache = next(iter(files.values())).parent / "cache"
    return TextSource(what, _key(data, {"files": inputs}), write, "plain", default_cache, add_split, files)


def _dataset_splits(loaded, where: str, name: str, data: DataConfig) -> dict:
    """The train/validation/test splits of what load_dataset or load_from_disk returned (one Dataset: train)."""
    if not hasattr(loaded, "keys"):  # a Dataset, not a DatasetDict
        return {"train": (where, _dataset_rows(loaded, data, where, name))}
    splits = {}
    for split, names in SPLIT_FILE_STEMS.items():
        present = next((found for found in names if found in loaded), None)
        if present is not None:
            origin = f"{where} split {present!r}"
            splits[split] = (origin, _dataset_rows(loaded[present], data, origin, name))
    if not splits:
        raise DataError(
            f"{where} has the splits {', '.join(loaded)}; none is train, validation (or val, valid, dev) or "
            "test. Save the splits under those names."
        )
    return splits


def _hf_datasets_cache() -> Path:
    import datasets  # noqa: PLC0415 - only where a named dataset is used: it sets up its cache paths

    return Path(datasets.config.HF_DATASETS_CACHE) / "t5_fsdp_text"


def saved_dataset_source(folder: Path, data: DataConfig) -> TextSource:
    """A folder written by `datasets`' save_to_disk."""
    files = _dataset_files(folder)
    inputs = {"saved_dataset": [str(folder.resolve()), _folder_fingerprint(files)]}

    def write(out: Path) -> dict:
        import datasets  # noqa: PLC0415

        loaded = datasets.load_from_disk(str(folder))
        return write_splits(out, _dataset_splits(loaded, str(folder), folder.name, data), data)

    add_split = "save the dataset with a '{split}' split"
    return TextSource(
        f"the saved dataset {folder}", _key(data, inputs), write, "plain", folder / "cache", add_split, files
    )


def named_dataset_source(data: DataConfig) -> TextSource:
    """What `datasets.load_dataset(--dataset_name, --dataset_config_name)` returns: a hub dataset (keyed by
    its name and config: delete the cache to pick up a new version) or a local dataset folder (keyed by
    its files). A local folder of split files or a saved dataset is read as --data_dir reads it, which also
    keeps load_dataset from taking the Arrow files of a cache/ folder inside it for data."""
    name, config_name = data.dataset_name, data.dataset_config_name or None
    inputs = {"dataset": [name, config_name]}
    files = {}
    if Path(name).is_dir():
        if config_name is None and (found := folder_source(Path(name), data)) is not None:
            return found
        files = _dataset_files(Path(name))
        inputs["files"] = _folder_fingerprint(files)

    def write(out: Path) -> dict:
        import datasets  # noqa: PLC0415

        try:
            loaded = datasets.load_dataset(name, config_name)
        except (OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as err:
            # Not a DataError: the same name may load later (the network back), so the waiting ranks must not
            # take this failure for the key's (utils/data/shared_cache.py).
            raise UserError(
                f"datasets.load_dataset({name!r}, {config_name!r}) failed: {' '.join(str(err).split())[:400]}. "
                "Check the name and config (a hub name needs the network; offline, give a local folder, "
                "files with --train_file, or a save_to_disk folder with --data_dir)."
            ) from None
        where = name if config_name is None else f"{name} ({config_name})"
        return write_splits(out, _dataset_splits(loaded, where, name, data), data)

    what = f"the dataset {name}" + (f" ({config_name})" if config_name else "")
    add_split = "the dataset has none under that name (train, validation or val/valid/dev, test)"
    return TextSource(what, _key(data, inputs), write, "plain", _hf_datasets_cache(), add_split, files)


def named_source(data: DataConfig) -> TextSource | None:
    """The source the flags name: files (--train_file, ...) or a dataset (--dataset_name); None: --data_dir."""
    files = {
        split: Path(path)
        for split, path in (
            ("train", data.train_file),
            ("validation", data.validation_file),
            ("test", data.test_file),
        )
        if path
    }
    if files:
        return file_source(files, data, "give one with --{split}_file")
    if data.dataset_name:
        return named_dataset_source(data)
    return None


def folder_source(folder: Path, data: DataConfig) -> TextSource | None:
    """The source a --data_dir holds, other than WikiHow: a save_to_disk folder, or split files; None: neither."""
    if is_saved_dataset(folder):
        return saved_dataset_source(folder, data)
    files = split_files_in(folder)
    types = ", ".join(suffix for suffix in FILE_TYPES if suffix != ".txt")
    return file_source(files, data, f"add a {{split}} file ({types}) to {folder}") if files else None


def how_to_get_wikihow(data_dir: Path) -> str:
    return (
        f"Download it with `python scripts/download_wikihow.py --data_dir {data_dir}`, or follow the "
        f"manual steps in the README (download {WIKIHOW_CSV} from {WIKIHOW_CSV_URL} in a browser and put it "
        f"in {data_dir})."
    )


def check_data_found(data: DataConfig) -> None:
    """DataFileNotFoundError, with the way to get them, where the files or the folder the settings name are not
    there. Cheap (names are looked at, nothing is read): the entry point checks it before it imports torch, so
    missing data is said in about a second. A --dataset_name is looked up when it is loaded."""
    named = [Path(path) for path in (data.train_file, data.validation_file, data.test_file) if path]
    for path in named:
        if path.is_dir():
            raise DataFileNotFoundError(
                f"{path.resolve()} is a folder, not a data file: give a file (.csv, .jsonl, .json, .parquet), or "
                f"--data_dir {path} for a folder of train/validation/test files or a saved dataset"
            )
        if path.suffix.lower() in FILE_TYPES and not path.is_file():  # another type: file_source says so
            raise DataFileNotFoundError(f"data file not found: {path.resolve()}")
    if named or data.dataset_name:
        return
    folder = Path(data.data_dir)
    if not folder.is_dir():
        close = closest_folder(folder)
        hint = f" Did you mean --data_dir {close}?" if close else ""
        raise DataFileNotFoundError(f"--data_dir {data.data_dir}: no such folder ({folder.resolve()}).{hint}")
    if not ((folder / WIKIHOW_CSV).is_file() or is_saved_dataset(folder) or split_files_in(folder)):
        raise DataFileNotFoundError(
            f"no data found in {folder.resolve()}: it holds neither {WIKIHOW_CSV} (WikiHow; "
            f"{how_to_get_wikihow(folder)}), nor train/validation/test files (.csv, .jsonl, .json, .parquet), nor "
            "a dataset written by datasets' save_to_disk. Or name files with --train_file/--validation_file/"
            "--test_file, or a dataset with --dataset_name."
        )
