"""WikiHow reader (the original builder's semantics) and the tutorial's Dataset, on fixture files.

No network and no dependency on data/sample: every CSV and split list is written to tmp_path, and the
T5 tokenizer is a tiny sentencepiece model trained here.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from causal_lm_dataset import CausalLMDataset
from configs.data import DataConfig
from configs.errors import ConfigError, DataError, DataFileNotFoundError
from configs.paths import REPO_ROOT
from summarization_dataset import FORMAT, ITEM_KEYS, SummarizationDataset, pad_collate
from utils.data.cache import load_wikihow, split_rows
from utils.data.loaders import build_dataset
from utils.data.wikihow import clean_text, hash_split
from utils.spec import labels_for_loss


def data_options(**fields) -> DataConfig:
    """The wikihow Dataset's options: a DataConfig padded to the max lengths unless told otherwise, as the
    Dataset pads without options (what the former WikihowOptions defaulted to)."""
    return DataConfig(**{"pad_to_max_length": True, **fields})


# The real file's quirks: a quoted multi-line headline whose bold lines are joined by ".,\n"; a text
# whose paragraphs are joined by ".\n,", by ";\n," and by "..\n\n,"; a title with surrounding spaces;
# a blank line; rows of 2 and 4 fields; an empty text; an empty headline; a summary too long for its
# article; the 0.75 boundary on both sides; a title in no split list.
FIXTURE_CSV = (
    "headline,title,text\n"
    '"\nMix the flour.,\nBake the loaf.", How to Bake Bread ,'
    '" Pour flour into a bowl and add water.\n,Knead it for ten minutes;\n,'
    'Put it in the oven and wait..\n\n,Enjoy it. "\n'
    "\n"
    "Two fields only,How to Two\n"
    'Zip it.,How to Zip,"Pull the zipper up slowly, from bottom to top."\n'
    "a,How to Four,some text that is long enough,extra\n"
    'Vote.,How to Vote,"Go to the polling station and cast your ballot."\n'
    "Feed it.,Zebra Care,Give the zebra hay every morning.\n"
    "This summary is far too long for the text,How to Drop Long,Short text.\n"
    "Orphan headline,How to Empty,\n"
    ',How to No Headline,"Some text here, long enough."\n'
    "xyz,Boundary Drop,abcd\n"
    "xyz,Boundary Keep,abcde\n"
    "Lost.,How to Orphan,This article is in no split list at all.\n"
    "Pick ripe ones.,Apple Picking,Look for apples that come off the branch easily.\n"
)
# Every title of the CSV that has 3 fields, except "How to Orphan", is in a list; the train list is not
# in file order (file order must win), has trailing spaces and a blank line.
FIXTURE_LISTS = {
    "all_train.txt": (
        "ApplePicking\nHowtoBakeBread  \n\nHowtoTwo\nHowtoFour\nZebraCare\nHowtoDropLong\nHowtoEmpty\n"
        "HowtoNoHeadline\nBoundaryDrop\nBoundaryKeep\n"
    ),
    "all_val.txt": "HowtoVote\n",
    "all_test.txt": "HowtoZip\n",
}

# Worked out by hand from FIXTURE_CSV: headline ".," -> "."; text "[.]+[\n]+[,]" -> ".\n" (the ";\n,"
# join is left alone); fields stripped; titles keep their inner spaces.
BREAD_TEXT = (
    "Pour flour into a bowl and add water.\nKnead it for ten minutes;\n,Put it in the oven and wait.\nEnjoy it."
)
EXPECTED = {
    "train": [
        {"title": "How to Bake Bread", "headline": "Mix the flour.\nBake the loaf.", "text": BREAD_TEXT},
        {"title": "Zebra Care", "headline": "Feed it.", "text": "Give the zebra hay every morning."},
        {"title": "Boundary Keep", "headline": "xyz", "text": "abcde"},
        {
            "title": "Apple Picking",
            "headline": "Pick ripe ones.",
            "text": "Look for apples that come off the branch easily.",
        },
    ],
    "validation": [
        {"title": "How to Vote", "headline": "Vote.", "text": "Go to the polling station and cast your ballot."}
    ],
    "test": [
        {"title": "How to Zip", "headline": "Zip it.", "text": "Pull the zipper up slowly, from bottom to top."}
    ],
}


def write_data(data_dir: Path, csv_text: str = FIXTURE_CSV, lists: dict[str, str] | None = None) -> Path:
    data_dir.mkdir(parents=True, exist_ok=True)
    # newline="": the bytes on disk are exactly the string (as in the original file, "\n" endings).
    (data_dir / "wikihowAll.csv").write_text(csv_text, encoding="utf-8", newline="")
    for name, content in (FIXTURE_LISTS if lists is None else lists).items():
        (data_dir / name).write_text(content, encoding="utf-8")
    return data_dir


def _warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


# ---------------------------------------------------------------------------------------------------
# load_wikihow: the builder's semantics
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_split_rows_exactly_as_the_builder(tmp_path, split):
    rows = load_wikihow(write_data(tmp_path), split)
    assert rows.column_names == ["title", "headline", "text"]
    assert rows.to_list() == EXPECTED[split]


def test_file_order_not_list_order(tmp_path):
    # The train list starts with ApplePicking, the last train row of the file.
    titles = list(load_wikihow(write_data(tmp_path), "train")["title"])
    assert titles == ["How to Bake Bread", "Zebra Care", "Boundary Keep", "Apple Picking"]


def test_split_lists_do_not_warn(tmp_path, log_records):
    load_wikihow(write_data(tmp_path), "train")
    assert _warnings(log_records) == []


def test_accepts_str_data_dir(tmp_path):
    assert len(load_wikihow(str(write_data(tmp_path)), "validation")) == 1


# ---------------------------------------------------------------------------------------------------
# load_wikihow: the hash split when no list exists
# ---------------------------------------------------------------------------------------------------

N_HASH_ROWS = 300


def _hash_fixture_csv() -> str:
    rows = [
        f"Step {i} done.,Article number {i},This is the much longer text of article {i}."
        for i in range(N_HASH_ROWS)
    ]
    return "headline,title,text\n" + "\n".join(rows) + "\n"


def _titles_by_split(data_dir: Path) -> dict[str, list[str]]:
    return {split: list(load_wikihow(data_dir, split)["title"]) for split in ("train", "validation", "test")}


def test_hash_split_deterministic_disjoint_complete(tmp_path):
    data_dir = write_data(tmp_path, _hash_fixture_csv(), lists={})
    first, second = _titles_by_split(data_dir), _titles_by_split(data_dir)
    assert first == second
    train, validation, test = (set(first[s]) for s in ("train", "validation", "test"))
    assert not (train & validation or train & test or validation & test)
    assert train | validation | test == {f"Article number {i}" for i in range(N_HASH_ROWS)}
    assert validation and test
    assert len(train) > 0.8 * N_HASH_ROWS
    # Each split keeps file order.
    for titles in first.values():
        assert titles == sorted(titles, key=lambda title: int(title.rsplit(" ", 1)[1]))


def test_hash_split_ignores_spaces_like_the_lists():
    assert hash_split(" How to Bake Bread ") == hash_split("HowtoBakeBread")


def test_hash_split_warns_once_per_load(tmp_path, log_records):
    data_dir = write_data(tmp_path, _hash_fixture_csv(), lists={})
    load_wikihow(data_dir, "train")
    warnings = _warnings(log_records)
    assert len(warnings) == 1
    for name in ("all_train.txt", "all_val.txt", "all_test.txt"):
        assert name in warnings[0]
    assert "differs from the published split" in warnings[0]


def test_hash_split_independent_of_pythonhashseed(tmp_path):
    """Every title's split is the same under two hash seeds (processes of their own, each importing the
    reader alone), and the same as the split the cache built in this process holds."""
    data_dir = write_data(tmp_path, _hash_fixture_csv(), lists={})
    titles = [f"Article number {i}" for i in range(N_HASH_ROWS)]
    code = (
        "import json, sys\n"
        "from utils.data.wikihow import hash_split\n"
        "print(json.dumps([hash_split(title) for title in json.loads(sys.argv[1])]))\n"
    )
    procs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(titles)],
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    cached = {title: split for split, names in _titles_by_split(data_dir).items() for title in names}
    assert results[0] == results[1] == [cached[title] for title in titles]
    assert set(results[0]) == {"train", "validation", "test"}


# ---------------------------------------------------------------------------------------------------
# load_wikihow: errors a user can fix
# ---------------------------------------------------------------------------------------------------


def test_a_folder_without_data(tmp_path):
    """An empty --data_dir names every kind of data it could hold, and how to get WikiHow."""
    with pytest.raises(DataFileNotFoundError) as info:
        load_wikihow(tmp_path, "train")
    message = str(info.value)
    assert f"no data found in {tmp_path.resolve()}" in message
    for expected in ("wikihowAll.csv", "download_wikihow", "train/validation/test files", "save_to_disk"):
        assert expected in message


@pytest.mark.parametrize(
    "csv_text, found",
    [
        ("title,headline,text\nA.,How to A,Some long text.\n", "title,headline,text"),
        ("headline,title\nA.,How to A\n", "headline,title"),
        ("", "empty"),
    ],
)
def test_wrong_header(tmp_path, csv_text, found):
    with pytest.raises(DataError) as info:
        load_wikihow(write_data(tmp_path, csv_text), "train")
    message = str(info.value)
    assert found in message
    assert "headline,title,text" in message
    assert "original wikihowAll.csv" in message


def test_no_usable_rows(tmp_path):
    # One row dropped by the 0.75 filter, one of 4 fields, one in the test list only.
    csv_text = (
        "headline,title,text\n"
        "This summary is far too long,How to Drop Long,Short.\n"
        "a,How to Four,long enough text,extra\n"
        'Zip it.,How to Zip,"Pull the zipper up slowly, from bottom to top."\n'
    )
    lists = {"all_train.txt": "HowtoDropLong\nHowtoFour\n", "all_val.txt": "", "all_test.txt": "HowtoZip\n"}
    data_dir = write_data(tmp_path, csv_text, lists)
    with pytest.raises(DataError, match="no usable rows for split 'train'"):
        load_wikihow(data_dir, "train")
    with pytest.raises(DataError, match="no usable rows for split 'validation'"):
        load_wikihow(data_dir, "validation")
    assert list(load_wikihow(data_dir, "test")["title"]) == ["How to Zip"]


def test_partial_split_lists(tmp_path):
    data_dir = write_data(tmp_path, lists={"all_train.txt": FIXTURE_LISTS["all_train.txt"]})
    with pytest.raises(DataFileNotFoundError) as info:
        load_wikihow(data_dir, "train")
    message = str(info.value)
    assert str(data_dir / "all_val.txt") in message
    assert str(data_dir / "all_test.txt") in message


def test_bad_split_name(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_wikihow(write_data(tmp_path), "valid")
    for split in ("train", "validation", "test"):
        assert split in str(info.value)


# ---------------------------------------------------------------------------------------------------
# The tutorial's Dataset on a tiny real T5 tokenizer
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("wikihow"))


# The train rows as the Dataset feeds them to the tokenizer, worked out by hand: newline -> space.
BREAD_SOURCE = (
    "Pour flour into a bowl and add water. Knead it for ten minutes; ,Put it in the oven and wait. Enjoy it."
)
BREAD_TARGET = "Mix the flour. Bake the loaf."


def test_clean_text_keeps_words_apart():
    text = 'Example of text: He said "hi"\nthen ``left``.\n\nExample of Summary:Bye.'
    assert clean_text(text) == "He said hi then left. Bye."


def test_without_options_the_embedded_sample_is_padded_to_max_length(tokenizer):
    """options=None: the embedded sample with the tutorial's fixed shapes (a DataConfig defaults to dynamic
    padding, so None is not DataConfig())."""
    from configs.paths import EMBEDDED_DATA_DIR

    dataset = SummarizationDataset(tokenizer, "train", 2, 16, 8)
    assert list(dataset.dataset["id"]) == list(load_wikihow(EMBEDDED_DATA_DIR, "train")["title"])[:2]
    assert all(
        dataset[i]["source_ids"].shape == (16,) and dataset[i]["target_ids"].shape == (8,) for i in range(2)
    )


def test_items_padded_to_max_length(tokenizer, data_dir):
    dataset = SummarizationDataset(tokenizer, "train", None, 16, 8, data_options(data_dir=data_dir))
    assert len(dataset) == 4
    for index in range(len(dataset)):
        item = dataset[index]
        assert tuple(item) == ITEM_KEYS
        for key, length in (("source", 16), ("target", 8)):
            ids, mask = item[f"{key}_ids"], item[f"{key}_mask"]
            assert ids.dtype == mask.dtype == torch.int64
            assert ids.shape == mask.shape == (length,)
            assert set(mask.tolist()) <= {0, 1}
            # Mask 1 then 0: right padding with the pad token; </s> is the last real token.
            n_real = int(mask.sum())
            assert mask.tolist() == [1] * n_real + [0] * (length - n_real)
            assert ids[n_real:].tolist() == [tokenizer.pad_token_id] * (length - n_real)
            assert ids[n_real - 1] == tokenizer.eos_token_id
    # "abcde" / "xyz" are short: padded.
    assert dataset[2]["source_mask"].sum() < 16


def test_items_without_padding(tokenizer, data_dir):
    dataset = SummarizationDataset(
        tokenizer, "train", None, 512, 512, data_options(data_dir=data_dir, pad_to_max_length=False)
    )
    item = dataset[0]
    assert item["source_ids"].tolist() == tokenizer(BREAD_SOURCE)["input_ids"]
    assert item["target_ids"].tolist() == tokenizer(BREAD_TARGET)["input_ids"]
    for key in ("source", "target"):
        ids, mask = item[f"{key}_ids"], item[f"{key}_mask"]
        assert ids.dtype == mask.dtype == torch.int64 and ids.dim() == 1
        assert ids[-1] == tokenizer.eos_token_id
        assert mask.tolist() == [1] * len(ids)


def test_source_prefix(tokenizer, data_dir):
    dataset = SummarizationDataset(
        tokenizer,
        "train",
        None,
        512,
        512,
        data_options(data_dir=data_dir, source_prefix="summarize: ", pad_to_max_length=False),
    )
    assert dataset[0]["source_ids"].tolist() == tokenizer("summarize: " + BREAD_SOURCE)["input_ids"]
    assert dataset[0]["target_ids"].tolist() == tokenizer(BREAD_TARGET)["input_ids"]


def test_truncation_keeps_eos(tokenizer, data_dir):
    for pad in (True, False):
        dataset = SummarizationDataset(
            tokenizer, "train", None, 6, 4, data_options(data_dir=data_dir, pad_to_max_length=pad)
        )
        item = dataset[0]
        assert item["source_ids"].shape == (6,) and item["target_ids"].shape == (4,)
        assert item["source_ids"][-1] == tokenizer.eos_token_id
        assert item["target_ids"][-1] == tokenizer.eos_token_id
        assert int(item["source_mask"].sum()) == 6


def test_num_samples_takes_the_first_rows(tokenizer, data_dir, log_records):
    every = SummarizationDataset(tokenizer, "train", None, 16, 8, data_options(data_dir=data_dir))
    first_two = SummarizationDataset(tokenizer, "train", 2, 16, 8, data_options(data_dir=data_dir))
    assert len(first_two) == 2
    assert list(first_two.dataset["id"]) == ["How to Bake Bread", "Zebra Care"]
    for index in range(2):
        for key in ITEM_KEYS:
            assert torch.equal(first_two[index][key], every[index][key])
    assert _warnings(log_records) == []


def test_num_samples_more_than_available_warns_once(tokenizer, data_dir, log_records):
    """The Dataset takes all the split has; a run's build_dataset says so, once however often it is built."""
    assert len(SummarizationDataset(tokenizer, "train", 100, 16, 8, data_options(data_dir=data_dir))) == 4
    assert _warnings(log_records) == []
    options = data_options(data_dir=data_dir)
    for _ in range(2):
        assert len(build_dataset(tokenizer, FORMAT, "train", 100, options, world_size=1)) == 4
    warnings = [line for line in _warnings(log_records) if line.startswith("asked for")]
    assert len(warnings) == 1
    assert "asked for 100 train rows" in warnings[0] and "using all 4" in warnings[0]


@pytest.mark.parametrize("num_samples", [0, -3])
def test_num_samples_below_one_is_a_config_error(tokenizer, data_dir, num_samples):
    with pytest.raises(ConfigError, match="num_samples"):
        SummarizationDataset(tokenizer, "train", num_samples, 16, 8, data_options(data_dir=data_dir))


def test_print_text_logs_the_input(tokenizer, data_dir, log_records):
    SummarizationDataset(tokenizer, "train", None, 16, 8, data_options(print_text=True, data_dir=data_dir))[0]
    infos = [r.getMessage() for r in log_records if r.levelno == logging.INFO]
    assert any(BREAD_SOURCE in message for message in infos)


def test_dataset_split_and_errors_pass_through(tokenizer, data_dir):
    assert len(SummarizationDataset(tokenizer, "validation", None, 16, 8, data_options(data_dir=data_dir))) == 1
    with pytest.raises(ConfigError):
        SummarizationDataset(tokenizer, "dev", None, 16, 8, data_options(data_dir=data_dir))


# ---------------------------------------------------------------------------------------------------
# pad_collate and labels_for_loss
# ---------------------------------------------------------------------------------------------------


def _item(source: list[int], target: list[int]) -> dict[str, torch.Tensor]:
    return {
        "source_ids": torch.tensor(source),
        "source_mask": torch.ones(len(source), dtype=torch.int64),
        "target_ids": torch.tensor(target),
        "target_mask": torch.ones(len(target), dtype=torch.int64),
    }


def test_pad_collate_right_pads_to_the_longest():
    batch = pad_collate([_item([5, 6, 1], [7, 1]), _item([8, 1], [9, 10, 11, 1])], pad_token_id=3)
    assert tuple(batch) == ITEM_KEYS
    assert batch["source_ids"].tolist() == [[5, 6, 1], [8, 1, 3]]
    assert batch["source_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["target_ids"].tolist() == [[7, 1, 3, 3], [9, 10, 11, 1]]
    assert batch["target_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert all(tensor.dtype == torch.int64 for tensor in batch.values())


def test_pad_collate_in_a_dataloader(tokenizer, data_dir):
    dataset = SummarizationDataset(
        tokenizer, "train", None, 64, 16, data_options(data_dir=data_dir, pad_to_max_length=False)
    )
    collate = functools.partial(pad_collate, pad_token_id=tokenizer.pad_token_id)
    pickle.dumps(collate)  # DataLoader workers receive it pickled
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, collate_fn=collate)
    batch = next(iter(loader))
    lengths = [len(dataset[i]["source_ids"]) for i in range(4)]
    assert batch["source_ids"].shape == (4, max(lengths))
    for row, length in enumerate(lengths):
        assert batch["source_ids"][row, :length].tolist() == dataset[row]["source_ids"].tolist()
        assert batch["source_ids"][row, length:].eq(tokenizer.pad_token_id).all()
        assert batch["source_mask"][row].tolist() == [1] * length + [0] * (max(lengths) - length)


def test_labels_for_loss_ignores_exactly_the_padding():
    target_ids = torch.tensor([[7, 8, 1, 0, 0], [9, 1, 0, 0, 0]])
    target_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    labels = labels_for_loss(target_ids, target_mask)
    assert labels.dtype == torch.int64
    assert labels.tolist() == [[7, 8, 1, -100, -100], [9, 1, -100, -100, -100]]
    # A copy: the batch itself is untouched.
    assert target_ids.tolist() == [[7, 8, 1, 0, 0], [9, 1, 0, 0, 0]]


# ---------------------------------------------------------------------------------------------------
# The published file's line endings and damage
# ---------------------------------------------------------------------------------------------------

# A row whose article has a line end inside its quotes: read as the builder did ("\r\n" -> "\n"), the text
# "ab\ncd" has 5 characters and the 4-character headline fails the 0.75 filter; a reader that kept "\r"
# would count 6 and keep the row.
CRLF_BOUNDARY_ROW = 'wxyz,Boundary CRLF,"ab\ncd"\n'


def test_crlf_file_gives_the_builders_rows_and_no_carriage_return(tmp_path):
    lists = {**FIXTURE_LISTS, "all_train.txt": FIXTURE_LISTS["all_train.txt"] + "BoundaryCRLF\n"}
    crlf = (FIXTURE_CSV + CRLF_BOUNDARY_ROW).replace("\n", "\r\n")
    assert crlf.count("\r\n") > 20  # line ends inside quoted fields too
    data_dir = write_data(tmp_path / "crlf", crlf, lists)
    for split, expected in EXPECTED.items():
        rows = load_wikihow(data_dir, split).to_list()
        assert rows == expected, split
        assert not any("\r" in value for row in rows for value in row.values()), split


def test_non_utf8_csv_names_the_file_the_line_and_the_fix(tmp_path):
    data_dir = write_data(tmp_path / "latin1")
    path = data_dir / "wikihowAll.csv"
    path.write_bytes(
        FIXTURE_CSV.encode() + "Caf\u00e9 it.,How to Cafe,Brew the coffee slowly.\n".encode("latin-1")
    )
    with pytest.raises(DataError) as caught:
        load_wikihow(data_dir, "train")
    message = str(caught.value)
    bad_line = FIXTURE_CSV.count("\n") + 1  # the appended row
    assert str(path) in message and "not UTF-8" in message and f"line {bad_line}:" in message, message
    assert "download_wikihow.py" in message


def test_a_csv_cut_inside_a_quoted_field_is_reported_as_truncated(tmp_path, log_records):
    load_wikihow(write_data(tmp_path / "whole"), "train")
    assert not [w for w in _warnings(log_records) if "truncated" in w]
    cut = FIXTURE_CSV + 'Cut.,How to Cut,"This article was cut off in the mid'
    load_wikihow(write_data(tmp_path / "cut", cut), "train")
    assert [w for w in _warnings(log_records) if "looks truncated" in w and "wikihowAll.csv" in w]


class CountingTokenizer:
    """A tokenizer that records the texts it is asked to encode; the same fingerprint as the one it wraps."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.texts = tokenizer, []
        self.pad_token_id, self.unk_token_id = tokenizer.pad_token_id, tokenizer.unk_token_id
        self.backend_tokenizer = tokenizer.backend_tokenizer

    def __call__(self, texts, **kwargs):
        self.texts += texts
        return self.tokenizer(texts, **kwargs)


def test_each_item_is_tokenized_once_per_machine(tokenizer, tmp_path):
    """The token ids are cached beside the text: a second Dataset (a later epoch's, another rank's, a later
    run's) tokenises nothing and gives the same items, padded or not; other lengths tokenise again."""
    data_dir = write_data(tmp_path)
    for pad in (True, False):
        counting = CountingTokenizer(tokenizer)
        options = data_options(data_dir=data_dir, pad_to_max_length=pad)
        first = SummarizationDataset(counting, "train", None, 16, 8, options)
        # A source and a target per sample, once: padding is applied to the cached ids, so pad=False reuses them.
        tokenised = 2 * len(first) if pad else 0
        assert len(counting.texts) == tokenised
        second = SummarizationDataset(counting, "train", None, 16, 8, options)
        assert len(counting.texts) == tokenised
        for index in range(len(first)):
            a, b = first[index], second[index]
            assert all(torch.equal(a[key], b[key]) for key in a)
            assert a["source_ids"].shape == ((16,) if pad else a["source_mask"].shape)
    counting = CountingTokenizer(tokenizer)
    SummarizationDataset(counting, "train", None, 12, 8, data_options(data_dir=data_dir))
    assert len(counting.texts) == 8


def test_a_dataset_given_its_rows_reads_no_cache(tokenizer, tmp_path):
    """The loaders hand each Dataset its rows (utils/data/cache.py: split_rows): its constructor then reads no
    file and tokenises nothing, even with its data and caches gone, and gives the items of the tutorial's call."""
    data_dir = write_data(tmp_path / "data")
    options = data_options(data_dir=data_dir, cache_dir=str(tmp_path / "cache"))
    rows = split_rows(tokenizer, "train", 3, 16, 8, options)
    tutorial = SummarizationDataset(tokenizer, "train", 3, 16, 8, options)
    shutil.rmtree(data_dir)
    shutil.rmtree(tmp_path / "cache")
    counting = CountingTokenizer(tokenizer)
    handed = SummarizationDataset(counting, "train", 3, 16, 8, options, rows=rows)
    assert counting.texts == [] and not (tmp_path / "cache").exists()
    with pytest.raises(
        ValueError,
        match=r"tokenised to \(16, 8\) \(seq2seq\) handed to a Dataset of split 'train', lengths \(32, 8\)",
    ):
        SummarizationDataset(tokenizer, "train", 3, 32, 8, options, rows=rows)
    with pytest.raises(
        ValueError, match=r"\(seq2seq\) handed to a Dataset of split 'train', lengths \(16, 8\) \(causal\)"
    ):
        CausalLMDataset(tokenizer, "train", 3, 16, 8, options, rows=rows)  # tokenised for an encoder-decoder
    with pytest.raises(ValueError, match="rows of split 'train' tokenised to"):
        SummarizationDataset(tokenizer, "validation", 3, 16, 8, options, rows=rows)
    assert len(handed) == len(tutorial) == 3 and handed.split_rows == tutorial.split_rows == 4
    for index in range(3):
        assert all(torch.equal(handed[index][key], tutorial[index][key]) for key in ITEM_KEYS)


@pytest.mark.parametrize("where", ["in the header's block", "half-way through"])
def test_a_bad_byte_anywhere_in_the_real_sized_sample_is_one_data_error(tmp_path, where):
    """A 0xFF byte at offset 2000 (inside the first block the reader decodes, with the header) or half-way
    through the embedded 1 MB sample: a DataError naming the file and the line, never a raw
    UnicodeDecodeError."""
    from configs.paths import EMBEDDED_DATA_DIR

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    for name in ("all_train.txt", "all_val.txt", "all_test.txt"):
        (data_dir / name).write_bytes((EMBEDDED_DATA_DIR / name).read_bytes())
    content = bytearray((EMBEDDED_DATA_DIR / "wikihowAll.csv").read_bytes())
    offset = 2000 if where == "in the header's block" else len(content) // 2
    content[offset] = 0xFF
    (data_dir / "wikihowAll.csv").write_bytes(bytes(content))
    with pytest.raises(DataError) as caught:
        load_wikihow(data_dir, "train")
    bad_line = content[:offset].count(b"\n") + 1
    message = str(caught.value)
    assert "not UTF-8" in message and f"line {bad_line}:" in message, message
    assert str(data_dir / "wikihowAll.csv") in message


def test_the_download_scripts_header_check_reports_a_bad_byte_in_the_first_block(tmp_path):
    from utils.data.wikihow import check_csv_header

    path = write_data(tmp_path / "data") / "wikihowAll.csv"
    content = bytearray(path.read_bytes())
    offset = len("headline,title,text\n") + 5
    content[offset] = 0xFF
    path.write_bytes(bytes(content))
    bad_line = content[:offset].count(b"\n") + 1
    with pytest.raises(DataError, match=rf"line {bad_line}: bytes that are not UTF-8"):
        check_csv_header(path)


def test_a_split_with_fewer_samples_than_ranks_is_refused():
    from transformers import T5Tokenizer

    from configs.paths import EMBEDDED_DATA_DIR, EMBEDDED_MODEL_DIR

    tokenizer = T5Tokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR))
    data = DataConfig(data_dir=str(EMBEDDED_DATA_DIR))
    assert len(build_dataset(tokenizer, FORMAT, "validation", 2, data, world_size=2)) == 2
    with pytest.raises(DataError, match="has 1 usable sample, fewer than the 2 ranks") as refused:
        build_dataset(tokenizer, FORMAT, "validation", 1, data, world_size=2)
    assert "validation" in str(refused.value) and "fewer processes" in str(refused.value)
