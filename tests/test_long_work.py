"""What a large run on a cluster meets: long work on one rank while the others wait, checkpoints checked by every
rank at once, a full disk, too little shared memory, an output_dir that is not shared by every node."""

import errno
import json
import logging
import os
import re
import zlib

import pytest

from configs.errors import CheckpointError, is_disk_full
from tests.dist_harness import run_ranks
from tests.dist_workers import (
    checkpoint_size_worker,
    disk_full_worker,
    long_rank0_work_worker,
    progress_bounded_worker,
    start_checks_worker,
    tiny_t5,
)
from utils.checkpoint import integrity
from utils.checkpoint.background import staging_problem
from utils.checkpoint.integrity import Piece, dealt, file_record, find_damage, hashed_file, pieces_of
from utils.checkpoint.manager import say_if_full_saves_are_large

TIMEOUT_S = 2  # the collectives' and the store's in these scenarios; every injected delay is 3x or more


# ------------------------------------------------------------------------------------ long work on one rank


@pytest.mark.slow
def test_a_wait_on_a_rank_that_works_outlasts_the_timeout_one_that_does_not_is_named_and_a_failure_ends_it():
    waiter = run_ranks(progress_bounded_worker, TIMEOUT_S, replace_after=True)[1]
    assert waiter["busy"] == "done" and waiter["busy_s"] >= 3 * TIMEOUT_S, waiter
    # Asleep: no CPU, no bytes. Named as stuck once the timeout has passed without progress, not at the end of
    # its 3x sleep.
    assert waiter["asleep"].startswith("PeerStalled: rank(s) 0 showed no progress"), waiter
    assert "in the asleep case" in waiter["asleep"] and waiter["asleep_s"] < 3 * TIMEOUT_S, waiter
    assert waiter["failing"] == "PeerFailed: stopped: rank 0 failed in the failing case (its error is above)"
    assert waiter["failing_s"] < TIMEOUT_S, waiter  # told at once, not after a timeout
    # An input error of that rank alone, which only rank 0 says (T5_training.py: refusal): the waiters get it, so
    # that a waiting rank 0 says another rank's (a crash, the control, prints its own traceback: none carried)
    assert waiter["refusing_refusal"] == "rank 0: data/train.csv is not on this node: copy it there", waiter
    assert waiter["failing_refusal"] is None and waiter["refusing_s"] < TIMEOUT_S, waiter


@pytest.mark.slow
def test_rank0s_loading_full_save_and_checkpoint_check_outlast_the_collective_timeout(tmp_path):
    ranks = run_ranks(long_rank0_work_worker, str(tmp_path / "run"), TIMEOUT_S, replace_after=True)
    for rank, seen in enumerate(ranks):
        seconds = seen["seconds"]
        for phase in ("loading", "save", "check"):  # each 3x the timeout on rank 0, waited for by rank 1
            assert seconds[phase] >= 3 * TIMEOUT_S, (rank, seconds)
        assert seen["saved"] == seen["start"] == str(tmp_path / "run" / "checkpoints" / "step_00000001"), seen
    # The control: the same wait in a collective times out, so the injected work did outlast the timeout.
    assert ranks[1]["control"].startswith(("RuntimeError", "DistError")), ranks[1]["control"]
    assert "Timed out" in ranks[1]["control"] or "timeout" in ranks[1]["control"].lower(), ranks[1]["control"]


# ------------------------------------------------------------------------ checkpoints checked piece by piece


def write_pieced_file(folder, name: str, size: int, records: dict) -> bytes:
    data = os.urandom(size)
    with hashed_file(str(folder), name, records) as f:
        f.write(data[: size // 3])  # writes that straddle the pieces' bounds
        f.write(memoryview(data)[size // 3 :])
    return data


def test_pieces_are_recorded_as_written_dealt_evenly_and_damage_is_named_by_its_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "PIECE_BYTES", 1000)
    records = {}
    data = write_pieced_file(tmp_path, "optimizer.pt", 4500, records)
    write_pieced_file(tmp_path, "model.pt", 1500, records)
    record = records["optimizer.pt"]
    assert record == file_record(str(tmp_path / "optimizer.pt"))  # written, or read again: the same record
    assert record["bytes"] == 4500 and record["piece_bytes"] == 1000
    assert record["crc32_pieces"] == [zlib.crc32(data[i : i + 1000]) for i in range(0, 4500, 1000)]

    pieces = [piece for name, rec in records.items() for piece in pieces_of(name, rec)]
    assert len(pieces) == 7
    shares = dealt(pieces, 2)
    assert sorted(sum(p.length for p in share) for share in shares) == [3000, 3000]  # each rank reads half
    assert sorted(map(repr, pieces)) == sorted(repr(p) for share in shares for p in share)  # every piece, once

    state = {"files": records}
    assert find_damage(str(tmp_path), state) is None
    damaged = bytearray(data)
    damaged[2500] ^= 0xFF
    (tmp_path / "optimizer.pt").write_bytes(bytes(damaged))
    assert find_damage(str(tmp_path), state) == (
        "optimizer.pt does not hold the bytes that were written (its CRC-32 differs in bytes 2000-3000): "
        "overwritten or corrupted"
    )
    # A record of a checkpoint written before pieces (one CRC-32 for the file) is still checked, as one piece.
    legacy = {"bytes": 4500, "crc32": zlib.crc32(data)}
    assert pieces_of("optimizer.pt", legacy) == [Piece("optimizer.pt", 0, 4500, zlib.crc32(data))]
    assert "CRC-32 differs in bytes 0-4500" in find_damage(str(tmp_path), {"files": {"optimizer.pt": legacy}})


# ---------------------------------------------------------------------------------------------- a full disk


@pytest.mark.slow
def test_a_full_disk_ends_each_save_with_one_message_keeping_the_previous_checkpoint(tmp_path):
    ranks = run_ranks(disk_full_worker, str(tmp_path))
    for case in ("FULL", "SHARDED", "background"):
        root = tmp_path / case / "checkpoints"
        said = ranks[0][case]
        assert said.startswith(
            f"CheckpointError: no space left on the disk of {root} for the checkpoint of step 2: "
            "a checkpoint needs about "
        ), said
        assert re.search(
            r"needs about [\d.]+ MB \(the size of the newest checkpoint\), [\d.]+ [MG]B are free there", said
        )
        assert f"the newest complete checkpoint, {root / 'step_00000001'}, is kept as it was" in said, said
        assert "resume with --resume true" in said and "Traceback" not in said, said
        # The partial write is gone, the previous checkpoint is as it was.
        assert ranks[0][f"{case}_left"] == ["step_00000001"], ranks[0]
        found = find_damage(
            str(root / "step_00000001"), json.loads((root / "step_00000001" / "train_state.json").read_text())
        )
        assert found is None
    # Rank 0 wrote a FULL save alone: rank 1 stopped because it failed, and says only that.
    assert ranks[1]["FULL"] == (
        "PeerFailed: stopped: rank 0 failed in checkpoint save (rank 0 writes model.pt and optimizer.pt) (its "
        "error is above)"
    )
    for case in ("SHARDED", "background"):  # every rank failed to write, and says the same (rank 0 prints it)
        assert (
            ranks[1][case].split(" are free there")[0].rsplit(", ", 1)[0]
            == ranks[0][case].split(" are free there")[0].rsplit(", ", 1)[0]
        ), (ranks[0][case], ranks[1][case])


def test_the_size_a_full_disks_message_gives_counts_replicas_once(tmp_path):
    whole = sum(p.numel() for p in tiny_t5().parameters()) * 4 * 3  # fp32 parameters and AdamW's two moments
    sizes = run_ranks(checkpoint_size_worker, str(tmp_path))[0]
    # FULL_SHARD's shards add up to the model; NO_SHARD's replicas are written once, not once per rank
    assert sizes == {name: (whole, "the model and optimizer in fp32") for name in sizes}, sizes
    assert len(sizes) == 3


def test_a_full_disk_is_recognised_in_each_wording():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(Exception("No space left on device (os error 28)"))  # the tokenizers library (Rust)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as cause:
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64") from cause
    except RuntimeError as wrapped:  # torch's writer, raised from the file's error
        assert is_disk_full(wrapped)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(CheckpointError("model.pt is missing"))


# --------------------------------------------------------------------------------- background saves' room


def test_background_saves_that_would_not_fit_are_refused_with_the_fix():
    gb = 10**9
    # FSDP2's writer process reads shared memory: 8 ranks of 16 GB against a container's 64 MB /dev/shm.
    said = staging_problem(16 * gb, 8, shared=True, free_shared=64 * 2**20, available=2000 * gb)
    assert said == (
        "--async_checkpoint true: a background save stages 8 rank(s) x 16.00 GB (each rank's model and optimizer "
        "shards) in shared memory, 128.00 GB, and /dev/shm has 67.1 MB free. Give it more (docker run "
        "--shm-size=141g; Kubernetes: an emptyDir of medium Memory mounted at /dev/shm), or save synchronously: "
        "--async_checkpoint false"
    )
    assert staging_problem(16 * gb, 8, shared=True, free_shared=200 * gb, available=2000 * gb) is None
    # FSDP1's writer thread reads host memory.
    said = staging_problem(16 * gb, 8, shared=False, free_shared=64 * 2**20, available=100 * gb)
    assert said.startswith("--async_checkpoint true: a background save copies 8 rank(s) x 16.00 GB"), said
    assert "100.00 GB available" in said and said.endswith(
        "--async_checkpoint false (or fewer ranks per host, a larger host)"
    )
    assert (
        staging_problem(16 * gb, 8, shared=False, free_shared=None, available=None) is None
    )  # unknown: no refusal


# ------------------------------------------------------------------------------ output_dir on several nodes


def test_an_output_dir_that_not_every_node_sees_and_a_host_without_room_are_refused_at_the_start(tmp_path):
    ranks = run_ranks(start_checks_worker, str(tmp_path))
    # One host's /dev/shm too small (a faked reading on rank 1): every rank stops, with that host's message.
    assert ranks[0]["room"] == ranks[1]["room"], ranks
    room = ranks[0]["room"]
    assert room.startswith("--async_checkpoint true: a background save stages 2 rank(s) x 50.0 MB"), room
    assert "and /dev/shm has 1.0 MB free" in room, room
    said = ranks[0]["relative"]
    assert said.startswith("output_dir 'out' is not shared by every node: rank(s) 1 ("), said
    assert "do not see the run.lock that rank 0 (" in said and "relative path is relative to each node's" in said
    assert ranks[1]["relative"] == said  # every rank stops, with the same message
    assert ranks[0]["absolute"] == ranks[1]["absolute"] == "claimed"
    assert not (tmp_path / "node_1" / "out").exists()  # nothing was written where rank 1 looked
    assert not (tmp_path / "node_0" / "out").exists()  # the folder the refused run made is gone with its lock


def test_full_saves_of_a_large_model_are_said_with_the_fix(log_records):
    say_if_full_saves_are_large(9 * 10**9)  # t5-large's model and AdamW: nothing said
    say_if_full_saves_are_large(34 * 10**9)  # t5-3b's
    [said] = [record.getMessage() for record in log_records if record.levelno == logging.WARNING]
    assert "each checkpoint, about 34 GB (model and optimizer in fp32), is gathered into rank 0" in said, said
    assert "--checkpoint_type SHARDED_STATE_DICT has every rank write its share at once" in said, said
