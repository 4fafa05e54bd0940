"""What a large run on a cluster meets: long work on one rank while the others wait, checkpoints checked by every
rank at once, a full disk, too little shared memory, an output_dir that is not shared by every node."""

import contextlib
import datetime
import errno
import json
import logging
import os
import re
import time
import zlib
from unittest import mock

import pytest
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout
from transformers import T5Tokenizer

from configs.checkpointing import CheckpointConfig
from configs.errors import CheckpointError, ConfigError, is_disk_full
from configs.paths import EMBEDDED_MODEL_DIR
from policies.private_api import default_store
from tests.dist_harness import run_ranks
from tests.dist_workers import CPU, FP32, _fsdp_config, batch_seed, make_batch, plain_manager, sharded, tiny_t5
from utils.base import layout
from utils.checkpoint import background as background_writing
from utils.checkpoint import integrity
from utils.checkpoint import manager as checkpoint_manager
from utils.checkpoint.background import staging_problem
from utils.checkpoint.integrity import Piece, dealt, file_record, find_damage, hashed_file, pieces_of
from utils.checkpoint.manager import say_if_full_saves_are_large
from utils.checkpoint.progress import TrainProgress
from utils.checkpoint.run_lock import claimed_output_dir
from utils.checkpoint.start import resolve_start
from utils.distributed.process_group import DistInfo
from utils.distributed.progress_bounded import PeerFailed, PeerStalled, progress_bounded
from utils.spec import SEQ2SEQ
from utils.train.step import StepSettings, train_step

TIMEOUT_S = 2  # the collectives' and the store's in these scenarios; every injected delay is 3x or more


# ------------------------------------------------------------------------------------ long work on one rank


def busy_for(seconds: float) -> None:
    """Legitimate work that takes `seconds`: the CPU kept busy (a long write or read shows progress alike)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


def short_timeouts(seconds: float) -> None:
    """This group's collectives and its store give up after `seconds` (as --dist_timeout_s would set them)."""
    _set_pg_timeout(datetime.timedelta(seconds=seconds))
    default_store().set_timeout(datetime.timedelta(seconds=seconds))


def progress_bounded_worker(rank: int, world_size: int, timeout_s: float) -> dict:
    """Rank 0's part of a progress-bounded block, while rank 1 waits: busy for 3x the timeout; asleep (no progress)
    for 3x; failing; refusing an input of its own (a UserError). What each rank saw and how long it waited."""
    from configs.errors import DataError

    def refuse():
        raise DataError("data/train.csv is not on this node: copy it there")

    short_timeouts(timeout_s)
    seen = {}
    for case, part in (
        ("busy", lambda: busy_for(3 * timeout_s)),
        ("asleep", lambda: time.sleep(3 * timeout_s)),
        ("failing", lambda: 1 / 0),
        ("refusing", refuse),
    ):
        started = time.monotonic()
        try:
            with progress_bounded(f"the {case} case"):
                if rank == 0:
                    part()
            seen[case] = "done"
        except (PeerStalled, PeerFailed, ZeroDivisionError, DataError) as err:
            seen[case] = f"{type(err).__name__}: {err}"
            seen[f"{case}_refusal"] = getattr(err, "refusal", None)
        seen[f"{case}_s"] = time.monotonic() - started
        _set_pg_timeout(datetime.timedelta(seconds=60))  # the next case starts together (rank 0 may still sleep)
        dist.barrier()
        short_timeouts(timeout_s)
    return seen


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


def long_rank0_work_worker(rank: int, world_size: int, output_dir: str, timeout_s: float) -> dict:
    """With collectives that give up after `timeout_s`: rank 0 reads the model alone (FSDP2 rank-0-only
    loading), writes a FULL checkpoint and checks its share of it on resume, each taking 3x the timeout, while
    rank 1 waits. Then the control: the same wait in a plain barrier."""
    short_timeouts(timeout_s)
    info = DistInfo(rank, rank, world_size, CPU, "gloo")
    fsdp = _fsdp_config({"fsdp_version": 2, "cpu_ram_efficient_loading": True, "checkpoint_type": layout.FULL})
    seconds = {}

    started = time.monotonic()
    with progress_bounded("model loading"):  # as T5_training.fsdp_main loads the model
        if rank == 0:
            busy_for(3 * timeout_s)  # a large from_pretrained
        model = tiny_t5(seed=5) if rank == 0 else tiny_t5(on_meta=True)
    model, parallelism = sharded(model, fsdp, FP32)
    seconds["loading"] = time.monotonic() - started

    tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    checkpointing = CheckpointConfig(save_every_n_steps=0, keep_last_n=2)
    real_hashed_file = checkpoint_manager.hashed_file

    @contextlib.contextmanager
    def slow_hashed_file(*args, **kwargs):
        busy_for(3 * timeout_s / 2)  # model.pt and optimizer.pt: 3x the timeout in all
        with real_hashed_file(*args, **kwargs) as stream:
            yield stream

    manager = plain_manager(model, parallelism, fsdp, checkpointing, output_dir, info, tokenizer)
    optimizer, settings = manager.optimizer, StepSettings(parallelism, spec=SEQ2SEQ)
    train_step(model, make_batch(batch_seed(1, rank)), optimizer, None, world_size, settings)
    started = time.monotonic()
    with mock.patch.object(checkpoint_manager, "hashed_file", slow_hashed_file if rank == 0 else real_hashed_file):
        saved = manager.save(TrainProgress(epoch=1, samples_consumed=1, global_step=1))
    seconds["save"] = time.monotonic() - started

    real_problem_with = integrity.problem_with
    checked = []

    def slow_problem_with(*args, **kwargs):
        if not checked:
            busy_for(3 * timeout_s)  # the first piece: a large file on slow storage
        checked.append(args[1])
        return real_problem_with(*args, **kwargs)

    started = time.monotonic()
    with mock.patch.object(integrity, "problem_with", slow_problem_with if rank == 0 else real_problem_with):
        start = resolve_start("true", output_dir)
    seconds["check"] = time.monotonic() - started

    started = time.monotonic()
    try:
        if rank == 0:
            busy_for(3 * timeout_s)
        dist.barrier()
        control = "done"
    except RuntimeError as err:
        control = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    seconds["control"] = time.monotonic() - started
    return {"seconds": seconds, "saved": saved, "start": start.path, "control": control}


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


def disk_full_worker(rank: int, world_size: int, output_root: str) -> dict:
    """A disk that fills up during a checkpoint save, after a first complete one: a FULL save (rank 0 writes),
    a SHARDED one (rank 1's shard fails), and an FSDP1 background one (written by a thread). Each rank's error,
    and what checkpoints are left."""
    info = DistInfo(rank, rank, world_size, CPU, "gloo")
    tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    real_write = integrity.HashingFile.write
    full = {"fail": False}

    def write(stream, data):
        if full["fail"] and (rank == 1 or stream.hashes.bytes > 1000):  # a part written before the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(stream, data)

    out = {}
    for case, overrides, background in (
        ("FULL", {"checkpoint_type": layout.FULL}, False),
        ("SHARDED", {"checkpoint_type": layout.SHARDED}, False),
        ("background", {"checkpoint_type": layout.SHARDED}, True),
    ):
        fsdp = _fsdp_config({"fsdp_version": 1, **overrides})
        output_dir = os.path.join(output_root, case)
        model, parallelism = sharded(tiny_t5(), fsdp, FP32)
        checkpointing = CheckpointConfig(save_every_n_steps=0, keep_last_n=2, async_checkpoint=background)
        manager = plain_manager(model, parallelism, fsdp, checkpointing, output_dir, info, tokenizer)
        optimizer, settings = manager.optimizer, StepSettings(parallelism, spec=SEQ2SEQ)
        full["fail"] = False
        with manager, mock.patch.object(integrity.HashingFile, "write", write):
            train_step(model, make_batch(batch_seed(1, rank)), optimizer, None, world_size, settings)
            manager.save(TrainProgress(epoch=1, samples_consumed=1, global_step=1))
            manager.finish_pending()
            dist.barrier()
            full["fail"] = rank == 0 if case == "FULL" else rank == 1
            try:
                manager.save(TrainProgress(epoch=1, samples_consumed=2, global_step=2))
                manager.finish_pending()
                out[case] = "saved"
            except Exception as err:  # what the run would end with
                out[case] = f"{type(err).__name__}: {err}"
            full["fail"] = False
        dist.barrier()
        out[f"{case}_left"] = sorted(os.listdir(layout.checkpoint_root(output_dir)))
    return out


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


def checkpoint_size_worker(rank: int, world_size: int, output_root: str) -> dict:
    """The checkpoint manager's size of a checkpoint before any is written (the one a full disk's message gives),
    for sharded and replicated models."""
    info = DistInfo(rank, rank, world_size, CPU, "gloo")
    tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    out = {}
    for name, overrides in (
        ("FSDP1 FULL_SHARD", {}),
        ("FSDP1 NO_SHARD", {"sharding_strategy": "NO_SHARD"}),
        ("FSDP2 NO_SHARD", {"fsdp_version": 2, "sharding_strategy": "NO_SHARD"}),
    ):
        fsdp = _fsdp_config(overrides)
        model, parallelism = sharded(tiny_t5(), fsdp, FP32)
        output_dir = os.path.join(output_root, name.replace(" ", "_"))
        with plain_manager(model, parallelism, fsdp, CheckpointConfig(), output_dir, info, tokenizer) as manager:
            out[name] = manager._checkpoint_bytes()
    return out


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


def start_checks_worker(rank: int, world_size: int, root: str) -> dict:
    """The checks a multi-node run makes at start. The run lock's, that every rank sees output_dir: each rank in
    a working directory of its own, as a node is, given a relative --output_dir (each its own folder) and then
    an absolute one (shared). The background saves' room: rank 1's host reads 1 MB free in /dev/shm (faked)."""
    seen = {}
    with mock.patch.object(background_writing, "free_shared_memory", lambda: 2**20 if rank == 1 else 10**12):
        try:
            background_writing.check_room_to_stage(50 * 10**6, shared=True)
            seen["room"] = "enough"
        except ConfigError as err:
            seen["room"] = str(err)
    here = os.path.join(root, f"node_{rank}")
    os.makedirs(here)
    os.chdir(here)  # put back by the rank pool after the scenario
    for case, output_dir in (("relative", "out"), ("absolute", os.path.join(root, "shared_out"))):
        try:
            with claimed_output_dir(output_dir):
                seen[case] = "claimed"
        except ConfigError as err:
            seen[case] = str(err)
        dist.barrier()
    return seen


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
