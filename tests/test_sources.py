"""Your own data: every source reduces to the same text cache, and bad input gets one message naming the file.

The embedded WikiHow sample, written out as CSV, JSON lines, JSON and Parquet (its rows cleaned as the
WikiHow path cleans them, in split order), gives the same training batches and the same per-step losses as
the WikiHow path under FSDP1 and FSDP2 (one spawned process group for all). Then each reader, the column
defaults, the held-out validation split, datasets' save_to_disk folders and load_dataset on a local folder,
the cache keys, and a test per bad-input message.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import T5Tokenizer

from configs.data import DataConfig
from configs.errors import ConfigError, DataError, DataFileNotFoundError, UserError
from configs.evaluation import EvalConfig
from configs.paths import EMBEDDED_DATA_DIR, EMBEDDED_MODEL_DIR, REPO_ROOT
from configs.run import RunConfig
from configs.training import TrainConfig
from configs.validate import check_data_source, check_evaluation
from summarization_dataset import FORMAT, SummarizationDataset
from tests.dist_harness import run_ranks
from tests.dist_workers import CPU, FP32, LR, _fsdp_config, sharded, tiny_t5
from tests.test_dataset import CountingTokenizer
from utils.data import sources
from utils.data.cache import cached_split, load_wikihow
from utils.data.loaders import build_loaders, move_batch
from utils.data.wikihow import clean_text
from utils.distributed.process_group import DistInfo
from utils.eval.scores import accuracy_scores
from utils.spec import SEQ2SEQ
from utils.train.step import StepSettings, train_step
from utils.train.step_log import StepLog

FORMATS = ("csv", "jsonl", "json", "parquet")
ONE_CPU_RANK = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")


def one_rank_loaders(tokenizer, data: DataConfig, evaluation: EvalConfig | None = None):
    """The loaders of a single CPU rank over `data`, with the tutorial's train_config."""
    evaluation = evaluation or EvalConfig()
    return build_loaders(
        tokenizer=tokenizer,
        data_format=FORMAT,
        data=data,
        train=TrainConfig(),
        evaluation=evaluation,
        info=ONE_CPU_RANK,
    )


def wikihow_rows(split: str) -> list[dict]:
    """The embedded sample's split as the WikiHow path trains on it: cleaned text and summary, titles as ids."""
    rows = load_wikihow(EMBEDDED_DATA_DIR, split)
    return [
        {"id": row["title"], "document": clean_text(row["text"]), "summary": clean_text(row["headline"])}
        for row in rows
    ]


def write_rows(path: Path, rows: list[dict]) -> Path:
    """`rows` in the file type of `path`'s suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix
    if suffix == ".csv":
        with open(path, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["document", "summary"])
            writer.writeheader()
            writer.writerows(rows)
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    elif suffix == ".json":
        path.write_text(json.dumps(rows, ensure_ascii=False, indent=1), encoding="utf-8")
    elif suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def sample_as_files(tmp_path_factory) -> dict[str, Path]:
    """format -> a folder holding train.<format> and validation.<format>, the embedded sample's rows."""
    root = tmp_path_factory.mktemp("formats")
    rows = {split: wikihow_rows(split) for split in ("train", "validation")}
    folders = {}
    for file_type in FORMATS:
        folder = root / file_type
        for split, split_rows in rows.items():
            write_rows(folder / f"{split}.{file_type}", split_rows)
        folders[file_type] = folder
    return folders


# ---------------------------------------------------------------------------------------------------
# Parity: the same rows in any format train exactly as WikiHow does
# ---------------------------------------------------------------------------------------------------


def source_parity_worker(rank: int, world_size: int, sources: dict, steps: int) -> dict:
    """For FSDP1 and FSDP2: the first `steps` training batches of each source (`name -> DataConfig fields`),
    built by utils/data/loaders.py: build_loaders, and the per-step reported losses of tiny_t5 trained on them.
    Every source builds its caches on this process group (LOCAL_RANK 0 builds, the other rank waits)."""
    info = DistInfo(rank, rank, world_size, CPU, "gloo")
    tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    train = TrainConfig(batch_size_training=4, run_validation=False)
    out = {"batches": {}, "losses": {}}
    for name, fields in sources.items():
        data = DataConfig(num_train_samples=32, max_source_length=64, max_target_length=16, **fields)
        loaders = build_loaders(
            tokenizer=tokenizer, data_format=FORMAT, data=data, train=train, evaluation=EvalConfig(), info=info
        )
        batches = [batch for _, batch in zip(range(steps), loaders.train, strict=False)]
        out["batches"][name] = batches
        for version in (1, 2):
            model, parallelism = sharded(tiny_t5(seed=3), _fsdp_config({"fsdp_version": version}), FP32)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            records: list[dict] = []
            step_log = StepLog(every=steps, on_flush=records.extend)
            settings = StepSettings(parallelism, spec=SEQ2SEQ)
            for step, batch in enumerate(batches):
                step_log.add(
                    step + 1, LR, train_step(model, move_batch(batch, CPU), optimizer, None, world_size, settings)
                )
            step_log.flush()
            out["losses"][(name, version)] = [record["loss"] for record in records]
    return out


@pytest.mark.slow  # a whole run per format (6 s); the fast subset keeps each format's rows
def test_every_format_trains_exactly_as_the_wikihow_path(sample_as_files):
    steps = 3
    sources_ = {"wikihow": {}}
    for file_type, folder in sample_as_files.items():
        if file_type == "json":  # found in a --data_dir; the others named as files
            sources_[file_type] = {"data_dir": str(folder)}
        else:
            sources_[file_type] = {
                "train_file": str(folder / f"train.{file_type}"),
                "validation_file": str(folder / f"validation.{file_type}"),
            }
    results = run_ranks(source_parity_worker, sources_, steps, timeout_s=300)
    for rank, result in enumerate(results):
        reference = result["batches"]["wikihow"]
        assert len(reference) == steps
        for name in sources_:
            for batch, expected in zip(result["batches"][name], reference, strict=True):
                assert all(torch.equal(batch[key], expected[key]) for key in expected), (name, rank)
            for version in (1, 2):
                losses, wikihow = result["losses"][(name, version)], result["losses"][("wikihow", version)]
                assert len(losses) == steps and all(loss > 0 for loss in losses)
                max_relative = max(abs(a - b) / abs(b) for a, b in zip(losses, wikihow, strict=True))
                assert max_relative == 0, (name, version, losses, wikihow)


# ---------------------------------------------------------------------------------------------------
# Readers, columns, splits
# ---------------------------------------------------------------------------------------------------

ROWS = [
    {"id": "a", "document": "First text, with a comma.", "summary": "One."},
    {"id": "b", "document": 'A "quoted" text\nover two lines.', "summary": "Two."},
    {"id": "c", "document": "Ünïcödé text.", "summary": "Three."},
]


@pytest.mark.parametrize("file_type", FORMATS)
def test_each_file_type_gives_the_same_rows(tmp_path, file_type):
    path = write_rows(tmp_path / f"train.{file_type}", ROWS)
    cached = cached_split(DataConfig(train_file=str(path), validation_file=str(path)), "train")
    assert cached.rows.to_list() == [
        {"id": r["id"], "source": r["document"], "target": r["summary"]} for r in ROWS
    ]
    assert cached.cleaning == "plain" and cached.cache.parent == tmp_path / "cache"


def test_ids_are_the_file_and_line_without_an_id_column(tmp_path):
    rows = [{"text": r["document"], "summary": r["summary"]} for r in ROWS]
    path = write_rows(tmp_path / "train.csv", rows)
    data = DataConfig(train_file=str(path), validation_file=str(path))
    ids = cached_split(data, "train").rows["id"]
    assert ids == ["train.csv:2", "train.csv:3", "train.csv:5"]  # the second row spans lines 3 and 4


def test_the_issue_example_a_data_dir_of_jsonl_files(tmp_path):
    """`--data_dir my_data` with train.jsonl and validation.jsonl of {"document", "summary"}."""
    write_rows(tmp_path / "my_data" / "train.jsonl", ROWS)
    write_rows(tmp_path / "my_data" / "validation.jsonl", ROWS[:1])
    data = DataConfig(data_dir=str(tmp_path / "my_data"))
    assert len(cached_split(data, "train").rows) == 3
    assert cached_split(data, "validation").rows["id"] == ["a"]
    with pytest.raises(DataError, match=r"no test split in the files .*validation.jsonl: add a test file \(.csv"):
        cached_split(data, "test")


def test_known_and_flagged_columns(tmp_path):
    rows = [{"article": "A news article.", "highlights": "A highlight.", "other": "x"}]
    path = write_rows(tmp_path / "cnn_dailymail" / "train.jsonl", rows)  # the folder names the dataset
    assert sources.resolve_columns(
        ["article", "highlights", "other"], DataConfig(), "f", "abisee/cnn_dailymail"
    ) == (
        "article",
        "highlights",
    )
    data = DataConfig(train_file=str(path), validation_file=str(path), text_column="other")
    assert cached_split(data, "train").rows.to_list() == [
        {"id": "train.jsonl:1", "source": "x", "target": "A highlight."}
    ]


def test_the_held_out_validation_share_is_fixed_by_seed(tmp_path):
    rows = [{"text": f"text {i}", "summary": f"summary {i}"} for i in range(400)]
    path = write_rows(tmp_path / "train.parquet", rows)

    def split_ids(seed: int, cache: str) -> tuple[list, list]:
        data = DataConfig(train_file=str(path), validation_split_seed=seed, cache_dir=str(tmp_path / cache))
        return cached_split(data, "train").rows["id"], cached_split(data, "validation").rows["id"]

    train, validation = split_ids(0, "a")
    assert (train, validation) == split_ids(0, "b")  # another cache, another build: the same rows
    assert len(validation) == 20 and len(train) == 380 and not set(train) & set(validation)
    assert train == sorted(train, key=lambda i: int(i.split(":")[-1]))  # file order kept
    assert split_ids(1, "c")[1] != validation


def test_a_saved_dataset_dict_with_class_labels(tmp_path):
    """FinancialPhraseBank as datasets has it: integer labels with names; save_to_disk, then --data_dir."""
    features = datasets.Features(
        {
            "sentence": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["negative", "neutral", "positive"]),
        }
    )
    train = datasets.Dataset.from_dict({"sentence": ["Sales fell .", "Profit rose ."], "label": [0, 2]}, features)
    unlabelled = datasets.Dataset.from_dict(
        {"sentence": ["Profit rose .", "Unknown ."], "label": [2, -1]}, features
    )
    datasets.DatasetDict({"train": train, "test": unlabelled}).save_to_disk(str(tmp_path / "fpb"))
    data = DataConfig(data_dir=str(tmp_path / "fpb"), validation_split_percentage=50)
    rows = cached_split(data, "train").rows.to_list() + cached_split(data, "validation").rows.to_list()
    assert sorted((row["source"], row["target"]) for row in rows) == [
        ("Profit rose .", "positive"),
        ("Sales fell .", "negative"),
    ]
    assert cached_split(data, "test").rows["target"] == ["positive"]  # label -1 (none): skipped


def test_load_dataset_on_a_local_folder(tmp_path):
    write_rows(tmp_path / "local" / "train.csv", ROWS)
    write_rows(tmp_path / "local" / "dev.csv", ROWS[1:])
    write_rows(tmp_path / "local" / "test.csv", ROWS[2:])
    data = DataConfig(dataset_name=str(tmp_path / "local"), cache_dir=str(tmp_path / "cache"))
    assert cached_split(data, "test").rows["source"] == ["Ünïcödé text."]
    assert cached_split(data, "validation").rows["id"] == ["b", "c"]  # datasets names dev.csv "validation"
    assert cached_split(data, "train").rows["target"] == ["One.", "Two.", "Three."]


def test_a_hub_name_offline_is_one_message(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    data = DataConfig(dataset_name="no_such_user/no_such_dataset", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(UserError, match=r"datasets.load_dataset\('no_such_user/no_such_dataset', None\) failed"):
        cached_split(data, "train")


def test_phrasebank_lines_in_latin_1_and_the_committed_sample(tmp_path):
    path = tmp_path / "Sentences_AllAgree.txt"
    path.write_bytes("Metsä Board 's sales rose .@positive\r\nOrion is in Vaasa .@neutral\r\n".encode("latin-1"))
    data = DataConfig(train_file=str(path), validation_file=str(path))
    assert cached_split(data, "train").rows.to_list() == [
        {"id": "Sentences_AllAgree.txt:1", "source": "Metsä Board 's sales rose .", "target": "positive"},
        {"id": "Sentences_AllAgree.txt:2", "source": "Orion is in Vaasa .", "target": "neutral"},
    ]
    out = tmp_path / "regenerated.txt"
    subprocess.run(
        [sys.executable, "scripts/make_phrasebank_sample.py", "--out", str(out)], cwd=REPO_ROOT, check=True
    )
    committed = REPO_ROOT / "data" / "financial_phrasebank" / "Sentences_AllAgree.txt"
    assert out.read_bytes() == committed.read_bytes()


@pytest.mark.parametrize("eval_split", ["test", "auto"])
def test_evaluate_only_needs_only_the_split_it_scores(tmp_path, eval_split, log_records):
    """A test file alone: --eval_split test scores it, and so does auto (the default), saying so."""
    path = write_rows(tmp_path / "test.jsonl", ROWS)
    evaluation = EvalConfig(evaluate_only=True, eval_split=eval_split, eval_metric="accuracy")
    tokenizer = T5Tokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR))
    loaders = one_rank_loaders(tokenizer, DataConfig(test_file=str(path)), evaluation)
    assert loaders.train is None and loaders.evaluation.split == "test" and len(loaders.evaluation.dataset) == 3
    assert loaders.cleaning == "plain"
    said = [record.getMessage() for record in log_records]
    assert ("--eval_split auto: scoring the test split (the data has no validation split of its own)" in said) == (
        eval_split == "auto"
    )
    assert "rows: test 3 (all)" in said


def test_evaluate_only_auto_scores_the_validation_split_where_there_is_one(tmp_path):
    files = {split: str(write_rows(tmp_path / f"{split}.jsonl", ROWS[: 2 + (split == "test")]))
             for split in ("validation", "test")}  # fmt: skip
    data = DataConfig(validation_file=files["validation"], test_file=files["test"])
    evaluation = EvalConfig(evaluate_only=True, eval_metric="accuracy")
    tokenizer = T5Tokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR))
    loaders = one_rank_loaders(tokenizer, data, evaluation)
    assert loaders.evaluation.split == "validation" and len(loaders.evaluation.dataset) == 2
    # A validation split held out of train is no better than the data's own test split: auto takes the test.
    held_out = DataConfig(train_file=str(write_rows(tmp_path / "train.jsonl", ROWS * 4)), test_file=files["test"])
    loaders = one_rank_loaders(tokenizer, held_out, evaluation)
    assert loaders.evaluation.split == "test" and len(loaders.evaluation.dataset) == 3


def test_token_ids_follow_the_cleaning_of_the_source(tmp_path):
    """A file's texts are tokenised and scored as they are; WikiHow's cleaning would drop the quotes."""
    rows = [{"document": 'A "quoted" text\nover two lines.', "summary": ' Say "hi". '}]
    path = write_rows(tmp_path / "train.jsonl", rows)
    tokenizer = CountingTokenizer(T5Tokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR)))
    data = DataConfig(train_file=str(path), validation_file=str(path))
    dataset = SummarizationDataset(tokenizer, "train", None, 64, 16, data)
    assert tokenizer.texts == ['A "quoted" text\nover two lines.', 'Say "hi".']
    assert dataset.reference(0) == 'Say "hi".' and clean_text(' Say "hi". ') == "Say hi."


def test_odd_but_valid_files(tmp_path):
    """A byte-order mark in JSON; a .json file of one object; bytes, numbers and booleans as texts; a folder
    named like a known dataset whose columns are not that dataset's; a Latin-1 byte 0x85 in a FinancialPhraseBank
    line (U+0085 is a line break to str.splitlines, not to the file)."""
    bom = tmp_path / "bom" / "train.jsonl"
    bom.parent.mkdir()
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "t", "summary": "s"}).encode() + b"\n")
    assert cached_split(DataConfig(train_file=str(bom), validation_file=str(bom)), "train").rows["source"] == ["t"]
    one = tmp_path / "one" / "train.json"
    one.parent.mkdir()
    one.write_text(json.dumps({"text": "only", "label": True}), encoding="utf-8")
    rows = cached_split(DataConfig(train_file=str(one), validation_file=str(one)), "train").rows.to_list()
    assert rows == [{"id": "train.json:1", "source": "only", "target": "true"}]
    table = pa.table({"text": [b"bytes a", b"bytes b"], "summary": [1.5, 2]})
    pq.write_table(table, tmp_path / "one" / "numbers.parquet")
    data = DataConfig(train_file=str(tmp_path / "one" / "numbers.parquet"), validation_file=str(one))
    assert cached_split(data, "train").rows["target"] == ["1.5", "2.0"]
    assert cached_split(data, "train").rows["source"] == ["bytes a", "bytes b"]
    xsum = write_rows(tmp_path / "xsum" / "train.csv", [{"text": "t", "headline": "h"}])  # not xsum's columns
    assert cached_split(DataConfig(train_file=str(xsum), validation_file=str(xsum)), "train").rows["target"] == [
        "h"
    ]
    fpb = tmp_path / "Sentences_50Agree.txt"
    fpb.write_bytes("Sales fell \x85 sharply .@negative\n".encode("latin-1"))
    rows = cached_split(DataConfig(train_file=str(fpb), validation_file=str(fpb)), "train").rows.to_list()
    assert rows == [{"id": "Sentences_50Agree.txt:1", "source": "Sales fell \x85 sharply .", "target": "negative"}]


def test_a_held_out_share_needs_two_rows_and_holds_at_least_one(tmp_path):
    one = write_rows(tmp_path / "one" / "train.jsonl", ROWS[:1])
    message = _error(DataConfig(train_file=str(one)), "validation")
    assert message.endswith("Give it rows, or train at least 2 rows to hold 1 out.")
    two = write_rows(tmp_path / "two" / "train.jsonl", ROWS[:2])
    data = DataConfig(train_file=str(two), validation_split_percentage=1)
    assert len(cached_split(data, "train").rows) == len(cached_split(data, "validation").rows) == 1


def test_values_that_are_not_texts(tmp_path):
    nested = write_rows(tmp_path / "train.jsonl", [{"text": ["a", "list"], "summary": "s"}])
    assert _error(DataConfig(train_file=str(nested))) == (
        f"{nested}, line 1: column 'text' holds a list, not a text. Choose a column of texts with "
        "--text_column/--summary_column, or flatten it into one."
    )
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["a"])})
    saved = datasets.Dataset.from_dict({"text": ["x"], "label": [0]}, features)
    table = saved.data.table.set_column(1, "label", pa.array([5], pa.int64()))  # a label past the names
    datasets.Dataset(table, info=saved.info).save_to_disk(str(tmp_path / "saved"))
    message = _error(DataConfig(data_dir=str(tmp_path / "saved")))
    assert message == f"{tmp_path / 'saved'}, row 1: label 5 of column 'label' is not one of its 1 names."


def test_dataset_name_on_a_folder_with_a_cache_reads_the_files_not_the_cache(tmp_path):
    folder = tmp_path / "my_data"
    write_rows(folder / "train.jsonl", [{"text": f"t{i}", "summary": "s"} for i in range(20)])
    assert len(cached_split(DataConfig(data_dir=str(folder)), "train").rows) == 19  # writes my_data/cache/
    write_rows(folder / "train.jsonl", [{"text": f"t{i}", "summary": "s"} for i in range(5)])
    data = DataConfig(dataset_name=str(folder))
    assert len(cached_split(data, "train").rows) + len(cached_split(data, "validation").rows) == 5


# ---------------------------------------------------------------------------------------------------
# Cache keys
# ---------------------------------------------------------------------------------------------------


def _text_caches(root: Path) -> list[str]:
    return sorted(path.name for path in root.glob("text-*") if path.is_dir())


def test_the_text_cache_is_keyed_by_the_files_the_columns_and_the_split(tmp_path):
    rows = [{"text": f"text {i}", "summary": f"summary {i}", "other": "o"} for i in range(100)]
    path = write_rows(tmp_path / "train.jsonl", rows)
    base = DataConfig(train_file=str(path))
    cached_split(base, "train")
    cached_split(base, "validation")
    assert len(_text_caches(tmp_path / "cache")) == 1  # both splits from one build, reused
    cached_split(DataConfig(train_file=str(path), text_column="other"), "train")
    assert len(_text_caches(tmp_path / "cache")) == 2
    cached_split(DataConfig(train_file=str(path), validation_split_percentage=10), "train")
    assert len(_text_caches(tmp_path / "cache")) == 3
    write_rows(path, rows[:50])  # the file changed
    assert len(cached_split(base, "train").rows) + len(cached_split(base, "validation").rows) == 50
    assert len(_text_caches(tmp_path / "cache")) == 4


def test_the_token_cache_is_keyed_by_the_text_cache(tmp_path):
    path = write_rows(tmp_path / "train.jsonl", ROWS)
    tokenizer = CountingTokenizer(T5Tokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR)))
    data = DataConfig(train_file=str(path), validation_split_percentage=1)
    SummarizationDataset(tokenizer, "train", None, 32, 8, data)
    tokenised = len(tokenizer.texts)
    SummarizationDataset(tokenizer, "train", None, 32, 8, data)
    assert len(tokenizer.texts) == tokenised  # reused
    SummarizationDataset(
        tokenizer,
        "train",
        None,
        32,
        8,
        DataConfig(
            train_file=str(path), text_column="summary", summary_column="document", validation_split_percentage=1
        ),
    )
    assert len(tokenizer.texts) == 2 * tokenised  # other columns: another text cache, so new ids


# ---------------------------------------------------------------------------------------------------
# Bad input: one message naming the file and the fix; nothing already cached is touched
# ---------------------------------------------------------------------------------------------------


def _error(data: DataConfig, split: str = "train") -> str:
    with pytest.raises((DataError, DataFileNotFoundError)) as info:
        cached_split(data, split)
    return str(info.value)


def test_a_missing_column_lists_the_columns_and_the_closest(tmp_path):
    path = write_rows(tmp_path / "train.csv", [{"document": "text", "sumary": "typo"}])
    message = _error(DataConfig(train_file=str(path), summary_column="summary"))
    assert (
        f"{path} has no column 'summary'; its columns: document, sumary. Did you mean --summary_column sumary?"
        == message
    )
    message = _error(DataConfig(train_file=str(path)))
    assert (
        "columns document, sumary: none is a usual name for the target. Name it with --summary_column" in message
    )


def test_an_empty_split_and_empty_rows(tmp_path, caplog):
    rows = [
        {"text": "kept", "summary": "yes"},
        {"text": "  ", "summary": "no text"},
        {"text": "no target", "summary": ""},
    ]
    path = write_rows(tmp_path / "train.jsonl", rows)
    empty = write_rows(tmp_path / "validation.jsonl", rows[1:])
    data = DataConfig(train_file=str(path), validation_file=str(empty))
    with caplog.at_level(logging.WARNING):
        assert len(cached_split(data, "train").rows) == 1
    assert "skipped 4 rows whose text or target is empty (train 2, validation 2)" in caplog.text
    message = _error(data, "validation")
    assert message.startswith(f"the validation split of the files {path}, {empty} is empty ({empty}; 2 rows")
    header_only = tmp_path / "header_only.csv"
    header_only.write_text("text,summary\n", encoding="utf-8")
    assert "is empty" in _error(DataConfig(train_file=str(header_only), validation_file=str(path)))


def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path):
    for suffix in (".csv", ".jsonl", ".json"):
        path = tmp_path / f"train{suffix}"
        lines = ['{"text": "a", "summary": "b"}', '{"text": "caf\xe9", "summary": "c"}']
        if suffix == ".csv":
            lines = ["text,summary", "a,b", "caf\xe9,c"]
        elif suffix == ".json":
            lines = ["[", lines[0] + ",", lines[1], "]"]
        path.write_bytes("\n".join(lines).encode("latin-1"))
        line = 3 if suffix != ".jsonl" else 2
        assert _error(DataConfig(train_file=str(path))).startswith(
            f"{path}, line {line}: bytes that are not UTF-8."
        )


BAD_FILES = [
    ("train.csv", "text,summary\na,b\nc,d,e\n", "train.csv, line 3: 3 fields, the header has 2. Quote every"),
    (
        "train.jsonl",
        '{"text": "a", "summary": "b"}\n{"text": "a" "b": 1}\n',
        "line 2: not valid JSON (Expecting ',' delimiter at",
    ),
    ("train.jsonl", '["a", "b"]\n', "train.jsonl, line 1: a JSON list, where an object of columns is expected."),
    ("train.json", '[{"text": "a",\n "summary": }]', "train.json, line 2: not valid JSON (Expecting value at"),
    ("train.json", "3", "train.json holds a JSON int; expected a list of objects (one per row), an object whose"),
    ("train.parquet", "not parquet", "train.parquet is not a Parquet file that pyarrow can read"),
    ("train.txt", "no separator here\n", "train.txt, line 1: no '@'. A .txt file is read as FinancialPhraseBank"),
    ("train.tsv", "a\tb\n", "train.tsv: unknown file type '.tsv'; data files are .csv (CSV), .jsonl (JSON"),
]


@pytest.mark.parametrize("name, content, expected", BAD_FILES)
def test_files_that_do_not_parse(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    assert expected in _error(DataConfig(train_file=str(path)))


def test_a_failed_build_leaves_the_caches_as_they_were(tmp_path):
    path = write_rows(tmp_path / "train.jsonl", ROWS)
    data = DataConfig(train_file=str(path))
    cached_split(data, "train")
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("*") if not p.name.endswith(".lock")}
    path.write_text('{"text": broken\n', encoding="utf-8")
    assert "not valid JSON" in _error(data)
    after = {
        p: p.stat().st_mtime_ns
        for p in (tmp_path / "cache").rglob("*")
        if not p.name.endswith((".failed", ".lock"))
    }
    assert after == before  # the old cache intact, no partial folder left


def test_missing_files_and_folders(tmp_path):
    assert (
        _error(DataConfig(train_file=str(tmp_path / "nope.csv")))
        == f"data file not found: {tmp_path / 'nope.csv'}"
    )
    assert "no such folder" in _error(DataConfig(data_dir=str(tmp_path / "nope")))
    (tmp_path / "sample").mkdir()  # a typo of a folder that exists: named
    assert _error(DataConfig(train_file=str(tmp_path / "sample"))) == (  # a folder as a file: --data_dir named
        f"{tmp_path / 'sample'} is a folder, not a data file: give a file (.csv, .jsonl, .json, .parquet), or "
        f"--data_dir {tmp_path / 'sample'} for a folder of train/validation/test files or a saved dataset"
    )
    assert _error(DataConfig(data_dir=str(tmp_path / "sampel"))).endswith(
        f"Did you mean --data_dir {tmp_path / 'sample'}?"
    )


# ---------------------------------------------------------------------------------------------------
# Settings: one source; scores and the best epoch
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"data_dir": "x", "train_file": "t.csv"}, "--train_file and --data_dir name two sources"),
        ({"dataset_name": "xsum", "test_file": "t.csv"}, "--test_file and --dataset_name name two sources"),
        ({"dataset_config_name": "3.0.0"}, "--dataset_config_name is the config of --dataset_name"),
        ({"length_key": "target_then_source"}, "--length_key target_then_source is what --group_by_length sorts"),
    ],
)
def test_one_source_of_data(fields, message):
    with pytest.raises(ConfigError, match=message):
        check_data_source(DataConfig(**fields))
    check_data_source(DataConfig(train_file="t.csv", validation_file="v.csv", test_file="x.csv"))


def test_accuracy_and_the_best_metric():
    assert accuracy_scores(" positive", "positive ") == {"accuracy": 100.0}
    assert accuracy_scores("positive", "Positive") == {"accuracy": 0.0}
    check_evaluation(EvalConfig(eval_metric="accuracy", metric_for_best="accuracy"), TrainConfig())
    with pytest.raises(ConfigError, match="--metric_for_best accuracy is a score of --eval_metric accuracy"):
        check_evaluation(EvalConfig(metric_for_best="accuracy"), TrainConfig())
    with pytest.raises(ConfigError, match="--metric_for_best rougeL is a score of --eval_metric rouge"):
        check_evaluation(EvalConfig(eval_metric="accuracy", metric_for_best="rougeL"), TrainConfig())
    assert RunConfig().evaluation.eval_metric == "rouge"


def test_rows_by_source_wikihow_keeps_the_tutorials_subset_other_sources_use_every_row(tmp_path, log_records):
    """NONE (the default) of --num_train_samples/--num_val_samples: the tutorial's 1,500/300 of WikiHow, every
    row of a file; a number larger than the split is said once; the start line says what each split gives."""
    tokenizer = T5Tokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR))
    rows = [{"document": f"text number {i}", "summary": f"sum {i}"} for i in range(40)]
    data = DataConfig(train_file=str(write_rows(tmp_path / "train.csv", rows)))  # 5% held out: 38 and 2
    mine = one_rank_loaders(tokenizer, data)
    wikihow = one_rank_loaders(tokenizer, DataConfig())
    split_rows = len(load_wikihow(EMBEDDED_DATA_DIR, "train"))
    one_rank_loaders(tokenizer, DataConfig(train_file=data.train_file, num_train_samples=500))
    assert (len(mine.train.dataset), len(mine.val.dataset)) == (38, 2)
    assert (len(wikihow.train.dataset), len(wikihow.val.dataset)) == (1500, 300) and split_rows > 1500
    said = [record.getMessage() for record in log_records]
    assert "rows: train 38 (all), validation 2 (all)" in said
    assert (
        f"rows: train 1500 of {split_rows} (the tutorial's subset of WikiHow; --num_train_samples 0 for all), "
        f"validation 300 of {len(load_wikihow(EMBEDDED_DATA_DIR, 'validation'))} (the tutorial's subset of "
        "WikiHow; --num_val_samples 0 for all)"
    ) in said
    asked = [line for line in said if line.startswith("asked for 500 train rows")]
    assert len(asked) == 1 and asked[0].endswith("has 38: using all 38"), said


def test_text_the_tokenizer_cannot_read_is_reported_once_and_recorded(tmp_path, log_records):
    """The embedded vocabulary has no 梅 or ü: a file of such text gets one warning per split, naming the
    characters and the fix, and the counts go to the run record; English text gets none."""
    tokenizer = T5Tokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR))
    foreign = [
        {"document": f"the plum 梅 grows in zürich {'so ' * i}", "summary": "梅 in zürich"} for i in range(20)
    ]
    english = [{"document": f"the plum grows in the garden {'so ' * i}", "summary": "a plum"} for i in range(20)]
    for name, rows in (("foreign", foreign), ("english", english)):
        data = DataConfig(train_file=str(write_rows(tmp_path / name / "train.csv", rows)))
        loaders = one_rank_loaders(tokenizer, data, EvalConfig(eval_rouge=False))
        counts = loaders.unknown_tokens()
        assert set(counts) == {"train", "validation"}
        assert (counts["train"]["rows"] == counts["train"]["rows_total"] == 19) == (name == "foreign"), counts
        assert (counts["train"]["rows"] == 0) == (name == "english"), counts
    warned = [
        r.getMessage() for r in log_records if r.levelname == "WARNING" and "unknown token" in r.getMessage()
    ]
    assert len(warned) == 2 and all("foreign" in line and "mt5" in line for line in warned), warned
    assert "梅" in warned[0] and "ü" in warned[0]
    # The embedded vocabulary has no ':': with T5's usual prefix every source holds one unknown token, which
    # the warning puts on the prefix, not on the data (before, it named the row's characters: none, "?").
    log_records.clear()
    data = DataConfig(train_file=str(tmp_path / "english" / "train.csv"), source_prefix="summarize: ")
    one_rank_loaders(tokenizer, data, EvalConfig(eval_rouge=False)).unknown_tokens()
    warned = [
        r.getMessage() for r in log_records if r.levelname == "WARNING" and "unknown token" in r.getMessage()
    ]
    assert warned and all("cannot read in --source_prefix 'summarize: ': :)" in line for line in warned), warned


@contextlib.contextmanager
def read_only_folder(folder: Path):
    """`folder` as this process cannot write it: a read-only bind mount over it as root (whom file permissions
    do not stop), its permissions otherwise."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    try:
        subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"no read-only bind mount here ({err}): root ignores file permissions")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True, capture_output=True)
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)  # the run's memory maps hold it


def test_a_data_folder_that_cannot_be_written_gets_its_cache_in_the_users_cache(
    tmp_path, monkeypatch, log_records
):
    """A shared, read-only dataset folder still trains: the cache goes to this user's cache, said once."""
    data_file = write_rows(tmp_path / "shared" / "train.csv", ROWS)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    with read_only_folder(tmp_path / "shared"):
        assert not os.access(tmp_path / "shared", os.W_OK)
        for _ in range(2):
            split = cached_split(DataConfig(train_file=str(data_file)), "train")
        assert split.cache.is_relative_to(tmp_path / "home" / "t5_fsdp_data") and len(split.rows) == 2
        assert not (tmp_path / "shared" / "cache").exists()
    said = [r.getMessage() for r in log_records if "cannot be written" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path / "home" / "t5_fsdp_data") in said[0], said


def test_a_read_only_data_folder_with_its_cache_built_reads_that_cache(tmp_path, monkeypatch, log_records):
    """A shared dataset mount whose cache was built before it was made read-only: used as it is."""
    data_file = write_rows(tmp_path / "shared" / "train.csv", ROWS)
    tokenizer = T5Tokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR))
    built = SummarizationDataset(tokenizer, "train", None, 32, 8, DataConfig(train_file=str(data_file)))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    with read_only_folder(tmp_path / "shared"):
        again = SummarizationDataset(tokenizer, "train", None, 32, 8, DataConfig(train_file=str(data_file)))
    assert again.token_ids.cache_files == built.token_ids.cache_files
    assert not (tmp_path / "home").exists()
    assert not [r for r in log_records if "cannot be written" in r.getMessage()]


def test_the_lead_baseline_is_named_for_what_a_line_of_the_data_is(tmp_path):
    """WikiHow's lines are steps; a JSON-lines source's (a dialogue's turns) are lines."""
    from utils.data.cache import text_source
    from utils.eval.evaluator import lead_steps_label

    own = DataConfig(train_file=str(write_rows(tmp_path / "train.jsonl", ROWS)))
    assert lead_steps_label(text_source(DataConfig()).cleaning) == "first sentence of each step"
    assert lead_steps_label(text_source(own).cleaning) == "first sentence of each line"
