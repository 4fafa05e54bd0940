"""Checkpoints that verify themselves: every file's size and CRC-32s, recorded as it is written, checked on resume.

A checkpoint's train_state.json (written last) lists every other file with its size and the CRC-32 of each of
its pieces of PIECE_BYTES. The large files are hashed as their bytes are written (`HashingFile`: rank 0's
model.pt and optimizer.pt, each rank's DCP shards through `RecordingWriter`); the small ones are read once more
when the checkpoint is completed. CRC-32 finds a truncated, overwritten or missing file, not a forgery.

On resume, `find_damage` checks a checkpoint before anything is loaded from it, the pieces dealt to the ranks so
that each reads about as many bytes (collective). Older checkpoints get the checks their record allows.
"""

import contextlib
import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from configs.errors import CheckpointError
from utils.base import layout
from utils.base.files import write_json
from utils.distributed.progress_bounded import progress_bounded

READ_BYTES = 16 * 2**20  # read in blocks when checking: a rank's memory stays small whatever the file
PIECE_BYTES = 256 * 2**20  # the unit of the check that ranks share: a 90 GB file is 344 of them
HASH = "crc32"  # one CRC-32 of a whole file: the records of checkpoints written before pieces
PIECE_HASHES = "crc32_pieces"  # the CRC-32 of each PIECE_BYTES piece, in order


class PieceHashes:
    """The size and the CRC-32 of each PIECE_BYTES piece of a stream of bytes, as they come."""

    def __init__(self):
        self.bytes = 0
        self.pieces: list[int] = []  # the CRC-32 of every piece begun, the last one still growing

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < view.nbytes:
            filled = self.bytes % PIECE_BYTES
            if filled == 0:
                self.pieces.append(0)
            part = view[done : done + PIECE_BYTES - filled]
            self.pieces[-1] = zlib.crc32(part, self.pieces[-1])
            self.bytes += part.nbytes
            done += part.nbytes

    def record(self) -> dict:
        return {"bytes": self.bytes, "piece_bytes": PIECE_BYTES, PIECE_HASHES: list(self.pieces)}


class HashingFile:
    """A file opened for writing whose bytes are counted and hashed piece by piece as they pass through
    (torch.save and DCP's writer call write, tell, flush, fileno and close)."""

    def __init__(self, raw):
        self.raw = raw
        self.hashes = PieceHashes()

    def write(self, data) -> int:
        self.hashes.update(data)
        return self.raw.write(data)

    def record(self) -> dict:
        return self.hashes.record()

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self.raw.close()


@contextlib.contextmanager
def hashed_file(folder: str, name: str, records: dict):
    """Open folder/name for writing through a HashingFile; once fsynced and closed, records[name] is its record."""
    with open(os.path.join(folder, name), "wb") as raw:
        stream = HashingFile(raw)
        yield stream
        raw.flush()
        os.fsync(raw.fileno())  # the record says what is on disk, not what is still in the page cache
    records[name] = stream.record()


class RecordingFileSystem(FileSystem):
    """DCP's file system, with every file it writes hashed on the way (`written`: file name -> record)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, dict] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = HashingFile(raw)
            yield stream
        self.written[Path(path).name] = stream.record()


class RecordingWriter(FileSystemWriter):
    """DCP's file writer, which also leaves the record of every shard it wrote in written/rank_<r>.json, inside
    write_data (before DCP's last step gathers every rank's result on rank 0): when a save is done every rank's
    record is on disk, and rank 0 can complete the checkpoint without another collective."""

    def __init__(self, path, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.fs = RecordingFileSystem()

    def write_data(self, plan, planner):
        self.fs.written = {}
        future = super().write_data(plan, planner)
        future.wait()  # DCP's file writer has finished by the time it returns; a failure surfaces here
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        record = layout.written_file(str(self.path), rank)
        os.makedirs(os.path.dirname(record), exist_ok=True)
        write_json(record, self.fs.written)
        return future


def file_record(path: str) -> dict:
    """A file's size and the CRC-32 of each of its pieces, read in blocks."""
    hashes = PieceHashes()
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            hashes.update(block)
    return hashes.record()


def checkpoint_files(folder: str, recorded: dict[str, dict]) -> dict[str, dict]:
    """{path relative to folder: its record} for every file of a checkpoint being completed: the one made while
    it was written (`recorded`, and the ranks' written/ records of their shards, merged and removed), else read."""
    recorded = dict(recorded)
    written = os.path.join(folder, layout.WRITTEN_DIR)
    if os.path.isdir(written):
        for name in sorted(os.listdir(written)):
            with open(os.path.join(written, name), encoding="utf-8") as f:
                recorded.update(json.load(f))
        shutil.rmtree(written)
    files = {}
    for directory, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, folder).replace(os.sep, "/")
            record = recorded.get(relative)
            if record is None:
                record = file_record(path)
            elif record["bytes"] != os.path.getsize(path):  # changed since it was written: not this save's
                raise CheckpointError(
                    f"{path} changed after it was written ({record['bytes']} bytes then, {os.path.getsize(path)} "
                    "now): another process writes into this checkpoint folder"
                )
            files[relative] = record
    return dict(sorted(files.items()))


@dataclass(frozen=True)
class Piece:
    """Bytes [start, start + length) of one recorded file, and their CRC-32 (None: only the size is known)."""

    name: str
    start: int
    length: int
    crc: int | None


def pieces_of(name: str, record: dict) -> list[Piece]:
    """The pieces a file's record lets ranks check apart: one per recorded piece, or the whole file where one
    CRC-32 was recorded for it (checkpoints written before pieces), or none but its size."""
    size = record["bytes"]
    if PIECE_HASHES not in record:
        return [Piece(name, 0, size, record.get(HASH))]
    step = record["piece_bytes"]
    pieces = [Piece(name, i * step, min(step, size - i * step), crc) for i, crc in enumerate(record[PIECE_HASHES])]
    return pieces or [Piece(name, 0, 0, None)]


def dealt(pieces: list[Piece], world_size: int) -> list[list[Piece]]:
    """The pieces dealt to `world_size` ranks so that each reads about as many bytes: the largest first, each to
    the rank with the fewest bytes so far (the same deal on every rank)."""
    shares: list[list[Piece]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for piece in sorted(pieces, key=lambda p: (-p.length, p.name, p.start)):
        rank = loads.index(min(loads))
        shares[rank].append(piece)
        loads[rank] += piece.length
    return shares


def problem_with(checkpoint: str, piece: Piece, size: int) -> str | None:
    """What is wrong with one piece of a recorded file of `size` bytes (None: it is as written)."""
    path = os.path.join(checkpoint, piece.name)
    if not os.path.isfile(path):
        return f"{piece.name} is missing"
    found = os.path.getsize(path)
    if found != size:
        return f"{piece.name} has {found} bytes where {size} were written (truncated or overwritten)"
    if piece.crc is None:
        return None
    crc, left = 0, piece.length
    with open(path, "rb") as f:
        f.seek(piece.start)
        while left and (block := f.read(min(READ_BYTES, left))):
            crc = zlib.crc32(block, crc)
            left -= len(block)
    if crc != piece.crc:
        end = piece.start + piece.length
        return (
            f"{piece.name} does not hold the bytes that were written (its CRC-32 differs in bytes "
            f"{piece.start}-{end}): overwritten or corrupted"
        )
    return None


def legacy_problems(checkpoint: str, state: dict) -> list[str]:
    """The checks a checkpoint without a file list (format 1) allows: every rank's RNG file, the main files."""
    names = [os.path.relpath(layout.rng_file(checkpoint, rank), checkpoint) for rank in range(state["world_size"])]
    if state["checkpoint_type"] == layout.FULL:
        names += [layout.MODEL_FILE] + ([layout.OPTIMIZER_FILE] if state["has_optimizer"] else [])
    else:
        names.append(".metadata")
    return [f"{name} is missing" for name in names if not os.path.isfile(os.path.join(checkpoint, name))]


def find_damage(checkpoint: str, state: dict) -> str | None:
    """What is wrong with a complete checkpoint's files (up to three things), or None. Collective: each rank
    checks its share of the pieces (`dealt`), waited for while it progresses; every rank gets the answer."""
    distributed = dist.is_available() and dist.is_initialized()  # else one process checks every file
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    files = state.get("files")
    with progress_bounded(f"the check of checkpoint {checkpoint}"):
        if files is None:
            problems = legacy_problems(checkpoint, state) if rank == 0 else []
        else:
            pieces = [piece for name, record in files.items() for piece in pieces_of(name, record)]
            mine = dealt(pieces, world_size)[rank]
            problems = [p for piece in mine if (p := problem_with(checkpoint, piece, files[piece.name]["bytes"]))]
    gathered: list = [problems]
    if distributed:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, problems)
    found = sorted({problem for share in gathered for problem in share})
    return "; ".join(found[:3]) if found else None
