"""The memory-mapped WikiHow cache (utils/data/shared_cache.py, utils/data/cache.py): what it is keyed
by, what happens to a damaged or half-built cache, and several processes asking for it at once."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from configs.data import DataConfig
from configs.errors import DataError
from configs.paths import REPO_ROOT
from summarization_dataset import SummarizationDataset
from tests.test_dataset import EXPECTED, FIXTURE_CSV, FIXTURE_LISTS, CountingTokenizer, write_data
from utils.data import shared_cache
from utils.data.cache import load_wikihow

ADDED_ROW = "Sow it.,How to Sow,Put the seeds in the soil in spring.\n"


def _folders(cache: Path, name: str) -> list[str]:
    return sorted(path.name for path in cache.glob(f"{name}-*") if path.is_dir())


def _warnings(records) -> list[str]:
    return [record.getMessage() for record in records if record.levelname == "WARNING"]


def test_the_cache_is_under_data_dir_and_keyed_by_the_file_and_the_lists(tmp_path):
    data_dir = write_data(tmp_path / "data")
    assert load_wikihow(data_dir, "train").to_list() == EXPECTED["train"]
    cache = data_dir / "cache"
    first = _folders(cache, "text")
    assert len(first) == 1
    assert load_wikihow(data_dir, "train").to_list() == EXPECTED["train"]
    assert _folders(cache, "text") == first  # reused
    # A changed file: a new cache with the new row.
    write_data(data_dir, FIXTURE_CSV + ADDED_ROW, {**FIXTURE_LISTS, "all_train.txt": "HowtoSow\n"})
    titles = list(load_wikihow(data_dir, "train")["title"])
    assert titles == ["How to Sow"]
    assert len(_folders(cache, "text")) == 2
    # A changed split list alone: another.
    write_data(data_dir, FIXTURE_CSV + ADDED_ROW, {**FIXTURE_LISTS, "all_train.txt": "HowtoSow\nZebraCare\n"})
    assert list(load_wikihow(data_dir, "train")["title"]) == ["Zebra Care", "How to Sow"]
    assert len(_folders(cache, "text")) == 3


def test_cache_dir_moves_the_cache_and_an_unwritable_one_is_named(tmp_path):
    data_dir = write_data(tmp_path / "data")
    elsewhere = tmp_path / "elsewhere"
    assert load_wikihow(data_dir, "test", cache_dir=elsewhere).to_list() == EXPECTED["test"]
    assert _folders(elsewhere, "text") and not (data_dir / "cache").exists()
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    with pytest.raises(DataError, match=r"cannot create the data cache folder .*a_file/cache.*--cache_dir"):
        load_wikihow(data_dir, "test", cache_dir=blocked / "cache")


def test_a_read_only_cache_dir_is_read_when_complete_and_named_when_it_lacks_the_cache(tmp_path):
    """--cache_dir on a read-only mount (a real read-only bind mount as root): a complete cache is read as it is
    (the control); one that lacks this data's cache stops with one message naming the folder, found by a real
    write before the build (filelock's OSError traceback before)."""
    from tests.test_sources import read_only_folder

    data_dir = write_data(tmp_path / "data")
    cache = tmp_path / "cache"
    assert load_wikihow(data_dir, "test", cache_dir=cache).to_list() == EXPECTED["test"]
    built = _folders(cache, "text")
    with read_only_folder(cache):
        assert load_wikihow(data_dir, "test", cache_dir=cache).to_list() == EXPECTED["test"]
        write_data(data_dir, FIXTURE_CSV + ADDED_ROW, FIXTURE_LISTS)  # other data, whose cache is not there
        refused = rf"cannot write the data cache folder {cache} \(Read-only file system\), which lacks the text"
        with pytest.raises(DataError, match=rf"{refused} cache of .*: point --cache_dir at a writable folder"):
            load_wikihow(data_dir, "test", cache_dir=cache)
    assert _folders(cache, "text") == built


def test_the_token_cache_is_keyed_by_tokenizer_and_lengths_and_serves_fewer_rows(tokenizer, tmp_path):
    from transformers import T5Tokenizer

    from configs.paths import EMBEDDED_MODEL_DIR

    data = DataConfig(data_dir=str(write_data(tmp_path / "data")))
    counting = CountingTokenizer(tokenizer)
    SummarizationDataset(counting, "train", None, 16, 8, data)
    assert len(counting.texts) == 8
    SummarizationDataset(counting, "train", 2, 16, 8, data)  # fewer rows: the cache of all four serves them
    SummarizationDataset(
        counting, "train", None, 16, 8, DataConfig(data_dir=data.data_dir, pad_to_max_length=True)
    )
    assert len(counting.texts) == 8
    SummarizationDataset(counting, "train", None, 16, 9, data)  # another target length
    assert len(counting.texts) == 16
    SummarizationDataset(
        counting, "train", None, 16, 8, DataConfig(data_dir=data.data_dir, source_prefix="summarize: ")
    )
    assert len(counting.texts) == 24
    other = CountingTokenizer(T5Tokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR)))  # another vocabulary
    SummarizationDataset(other, "train", None, 16, 8, data)
    assert len(other.texts) == 8
    # Two rows first, then all four: the two-row cache does not serve them, so a second one is made (a
    # complete cache is never changed: another rank or run may be reading it); then both sizes reuse one.
    fresh = DataConfig(data_dir=str(write_data(tmp_path / "fresh")))
    counting = CountingTokenizer(tokenizer)
    SummarizationDataset(counting, "train", 2, 16, 8, fresh)
    assert len(counting.texts) == 4
    assert len(SummarizationDataset(counting, "train", None, 16, 8, fresh)) == 4
    assert len(counting.texts) == 12
    SummarizationDataset(counting, "train", 3, 16, 8, fresh)
    SummarizationDataset(counting, "train", 2, 16, 8, fresh)
    assert len(counting.texts) == 12
    assert len(_folders(Path(fresh.data_dir) / "cache", "tokens")) == 2
    # A folder whose key has another shape (an older version's: no row count) is passed over, not misread.
    older = Path(fresh.data_dir) / "cache" / _folders(Path(fresh.data_dir) / "cache", "tokens")[0]
    manifest = json.loads((older / shared_cache.MANIFEST).read_text(encoding="utf-8"))
    del manifest["key"]["rows"]
    (older / shared_cache.MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    assert len(SummarizationDataset(counting, "train", 1, 16, 8, fresh)) == 1
    assert len(counting.texts) == 12


def test_tokenising_in_worker_processes_gives_the_same_ids(tokenizer, tmp_path, monkeypatch):
    from utils.data import cache

    data = DataConfig(data_dir=str(write_data(tmp_path / "data")), pad_to_max_length=False)
    in_process = SummarizationDataset(tokenizer, "train", None, 16, 8, data)
    monkeypatch.setattr(cache, "_ROWS_PER_TOKENISING_PROCESS", 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    elsewhere = dataclasses.replace(data, cache_dir=str(tmp_path / "elsewhere"))
    workers = SummarizationDataset(
        tokenizer, "train", None, 16, 8, elsewhere
    )  # a new cache, tokenised in 2 processes
    (folder,) = (tmp_path / "elsewhere").glob("tokens-*[0-9a-f]")
    assert sorted(path.name for path in folder.glob("*.arrow")) == [
        "ids_00000_of_00002.arrow",
        "ids_00001_of_00002.arrow",
    ]
    assert len(workers) == len(in_process) == 4
    for index in range(4):
        assert torch.equal(workers[index]["source_ids"], in_process[index]["source_ids"])
        assert torch.equal(workers[index]["target_ids"], in_process[index]["target_ids"])


@pytest.mark.parametrize("damage", ["a truncated Arrow file", "a missing manifest", "a deleted Arrow file"])
def test_a_damaged_cache_is_rebuilt_and_says_so(tmp_path, log_records, damage):
    data_dir = write_data(tmp_path / "data")
    load_wikihow(data_dir, "train")
    (folder,) = (data_dir / "cache").glob("text-*[0-9a-f]")
    if damage == "a truncated Arrow file":
        content = (folder / "train.arrow").read_bytes()
        (folder / "train.arrow").write_bytes(content[: len(content) // 2])
        expected = "damaged: train.arrow has"
    elif damage == "a missing manifest":
        (folder / shared_cache.MANIFEST).unlink()
        expected = "damaged: it has no readable manifest"
    else:
        (folder / "validation.arrow").unlink()
        expected = "damaged: validation.arrow is missing"
    assert load_wikihow(data_dir, "train").to_list() == EXPECTED["train"]
    assert load_wikihow(data_dir, "validation").to_list() == EXPECTED["validation"]
    (warning,) = [w for w in _warnings(log_records) if "building it again" in w]
    assert expected in warning and str(folder) in warning


# A build that sleeps in the middle of reading the CSV, so that the test can kill it there.
SLOW_BUILD = """
import sys, time
from utils.data import cache, wikihow
clean = wikihow.filter_and_clean
def slow(headline, text):
    time.sleep(60)
    return clean(headline, text)
wikihow.filter_and_clean = slow
cache.load_wikihow(sys.argv[1], "train")
"""


def _python(code: str, *args: str, local_rank: int = 0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "LOCAL_RANK": str(local_rank)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow  # a build process killed half way, then a rebuild (6 s)
def test_a_build_killed_half_way_is_never_used_and_the_next_run_rebuilds_and_says_so(tmp_path, log_records):
    data_dir = write_data(tmp_path / "data")
    cache = data_dir / "cache"
    builder = _python(SLOW_BUILD, str(data_dir))
    try:
        _wait_for(lambda: any(cache.glob("text-*.partial-*")))
        builder.send_signal(signal.SIGKILL)
        builder.wait(timeout=30)
    finally:
        builder.kill()
    left = _folders(cache, "text")
    assert left and all(".partial-" in name for name in left)
    assert load_wikihow(data_dir, "train").to_list() == EXPECTED["train"]
    (warning,) = [w for w in _warnings(log_records) if "did not finish" in w]
    assert ".partial" in warning and "removing it and building again" in warning
    assert not any(cache.glob("*.partial-*"))


PRINT_TITLES = """
import json, sys
from utils.data.cache import load_wikihow
print("TITLES", json.dumps(list(load_wikihow(sys.argv[1], "train")["title"])))
"""


@pytest.mark.slow  # 10-13 s in the fast subset (docs/development.md: the time budget)
def test_two_runs_and_a_waiting_rank_at_once_build_the_cache_once(tmp_path):
    """Two LOCAL_RANK 0 processes (two runs started together) and a LOCAL_RANK 1 process (a rank waiting for
    its node's builder) start on an empty cache: one build, the same rows for all three."""
    data_dir = write_data(tmp_path / "data")
    processes = [_python(PRINT_TITLES, str(data_dir), local_rank=rank) for rank in (1, 0, 0)]
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output
        titles = next(line for line in output.splitlines() if line.startswith("TITLES"))
        assert titles == 'TITLES ["How to Bake Bread", "Zebra Care", "Boundary Keep", "Apple Picking"]'
    assert len(_folders(data_dir / "cache", "text")) == 1


def test_a_waiting_rank_takes_a_larger_token_cache_as_its_builder_does(tokenizer, tmp_path, monkeypatch):
    """A rank that waits for the token ids of 2 articles while a cache of 4 exists uses that one, as LOCAL_RANK
    0 does (it builds no 2-article cache, so waiting for one would never end)."""
    data = DataConfig(data_dir=str(write_data(tmp_path / "data")))
    SummarizationDataset(tokenizer, "train", None, 16, 8, data)
    monkeypatch.setattr(shared_cache, "is_folder_builder", lambda: False)
    done = []
    waiter = threading.Thread(
        target=lambda: done.append(SummarizationDataset(tokenizer, "train", 2, 16, 8, data)), daemon=True
    )
    waiter.start()
    waiter.join(timeout=30)
    assert not waiter.is_alive() and len(done[0]) == 2
    assert len(_folders(Path(data.data_dir) / "cache", "tokens")) == 1


def test_a_waiting_rank_ends_with_the_builders_data_error(tmp_path, monkeypatch):
    """The builder's DataError (a bad header here) reaches the ranks that wait for its cache: they stop with
    the same message instead of waiting for a cache that will not come."""
    data_dir = write_data(tmp_path / "data", "title,headline,text\nA.,How to A,Some long text.\n")
    waiting = threading.Event()
    monkeypatch.setattr(shared_cache, "is_folder_builder", lambda: threading.current_thread().name != "waiter")
    errors = []

    def wait() -> None:
        waiting.set()
        try:
            load_wikihow(data_dir, "train")
        except DataError as err:
            errors.append(str(err))

    waiter = threading.Thread(target=wait, name="waiter")
    waiter.start()
    waiting.wait()
    with pytest.raises(DataError) as built:
        load_wikihow(data_dir, "train")
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert errors == [str(built.value)] and "headline,title,text" in errors[0]


def test_a_folder_another_node_completed_during_the_build_is_kept(tmp_path, monkeypatch):
    """Where file locks do not reach other nodes, two builders may run at once: the one that finishes second
    finds the other's complete folder (which that node's ranks may be reading) and keeps it, its own build
    discarded, instead of deleting it and renaming its own into place."""
    key = {"rows": "demo"}
    folder = shared_cache.folder_for(tmp_path, "demo", key)

    def build_while_another_node_finishes(partial: Path) -> dict:
        theirs = tmp_path / "the-other-nodes-build"
        theirs.mkdir()
        (theirs / "rows.arrow").write_bytes(b"theirs")
        (theirs / shared_cache.MANIFEST).write_text(json.dumps({"key": key, "files": {"rows.arrow": 6}}))
        os.replace(theirs, folder)  # their rename, while this builder still writes
        (partial / "rows.arrow").write_bytes(b"mine, longer")
        return {}

    monkeypatch.setenv("LOCAL_RANK", "0")
    found, manifest = shared_cache.shared_folder(tmp_path, "demo", key, build_while_another_node_finishes, "rows")
    assert found == folder and manifest["files"] == {"rows.arrow": 6}
    assert (folder / "rows.arrow").read_bytes() == b"theirs"
    assert [path.name for path in tmp_path.iterdir() if path.is_dir()] == [folder.name]  # no partial folder left
