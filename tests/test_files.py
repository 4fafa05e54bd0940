"""utils/base/files.py: a file or folder appears complete under its final name, or not at all."""

import errno
import json
import os

import pytest

from tests.test_sources import read_only_folder
from utils.base.files import atomic_path, disk_bytes, write_json, write_problem


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    write_json(path, {"version": 1})
    with pytest.raises(RuntimeError), atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write('{"version": 2, "trunc')
        raise RuntimeError("crash mid-write")
    assert json.loads(path.read_text()) == {"version": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_folder_is_replaced_whole(tmp_path):
    folder = tmp_path / "hf_model"
    for version in (1, 2):
        with atomic_path(folder) as tmp:
            (tmp_path / "hf_model.tmp").mkdir()
            (tmp_path / "hf_model.tmp" / f"weights_v{version}").write_text("x" * version)
            assert tmp == str(tmp_path / "hf_model.tmp")
    assert sorted(p.name for p in folder.iterdir()) == ["weights_v2"]  # nothing of version 1 survives
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]
    assert disk_bytes(str(folder)) == 2


def test_a_leftover_temporary_of_a_crashed_write_is_replaced(tmp_path):
    path = tmp_path / "config.json"
    (tmp_path / "config.json.tmp").write_text("half of an old write")
    write_json(path, {"ok": True})
    assert json.loads(path.read_text()) == {"ok": True}
    assert not (tmp_path / "config.json.tmp").exists()


def test_a_checkpoint_written_before_metric_for_best_still_reads(tmp_path):
    """train_state.json of the previous format kept the best validation loss as best_val_loss."""
    from utils.checkpoint.start import read_train_state

    progress = {"epoch": 2, "samples_consumed": 0, "global_step": 12, "best_val_loss": 2.5,
                "epoch_totals": None, "epoch_train_seconds": 0.0}  # fmt: skip
    state = {"format_version": 1, "checkpoint_type": "FULL_STATE_DICT", "progress": progress}
    write_json(tmp_path / "train_state.json", state)
    assert read_train_state(str(tmp_path))["progress"]["best_metric"] == 2.5


def test_the_write_probe_says_what_os_access_misses_and_leaves_nothing(tmp_path, monkeypatch):
    """A read-only mount (a real one: a read-only bind mount as root) and a full quota (injected at fsync, where a
    quota or NFS says it; os.access passes it) are found by writing; a writable folder passes, and the probe
    leaves no file."""
    folder = tmp_path / "out"
    folder.mkdir()
    assert write_problem(folder) is None  # control
    assert write_problem(folder / "checkpoints" / "step_1") is None  # probed where it will be created
    assert not (folder / "checkpoints").exists() and list(folder.iterdir()) == []
    with read_only_folder(folder):
        assert write_problem(folder) == "Read-only file system"
        assert write_problem(folder / "checkpoints") == "Read-only file system"
    assert list(folder.iterdir()) == []

    def quota_exceeded(descriptor):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(os, "fsync", quota_exceeded)
    assert os.access(folder, os.W_OK)  # what os.access says of a full quota
    assert write_problem(folder) == "Disk quota exceeded"
    assert list(folder.iterdir()) == []  # the created file removed
