"""--async_checkpoint's writer: DCP's `async_save`, with the stager that copies this rank's shards to host memory
and the writer that takes them to disk, both chosen by backend, and the checks made before training that the
copies have room and the writes a core. The manager keeps the save in flight and completes its folder.

    writer = BackgroundWriter(parallelism, info, rank_bytes)   # collective: every rank makes its gloo group
    future = writer.write(payload, folder)               # returns once staged; the future ends with the write
    writer.close()
"""

import math
import os
import shutil
import time
from concurrent.futures import Future
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.torch_version import TorchVersion

from configs.errors import ConfigError
from utils.base.log import get_logger, size_text
from utils.checkpoint.integrity import RecordingWriter
from utils.distributed.launcher import ranks_on_this_host
from utils.distributed.process_group import DistInfo, usable_cpus
from utils.fsdp.parallelism import Parallelism
from utils.observe.memory import available_memory


class BackgroundWriter:
    """Writes checkpoints' shards in the background, one save at a time: FSDP2 through a writer process per
    rank reading shared memory (off training's GIL and threads), FSDP1 through a thread (its ShardedTensors
    cannot be staged into shared memory: docs/checkpoints.md). Its own gloo group keeps the write's collectives
    apart from training's (DCP's writer process also agrees on its store's address over it)."""

    def __init__(self, parallelism: Parallelism, info: DistInfo, rank_bytes: int):
        if info.is_main:
            say_if_background_writes_have_no_core(info.device, info.world_size)
        check_room_to_stage(rank_bytes, parallelism.stages_in_shared_memory)
        self.info = info
        self.group = dist.new_group(backend="gloo")
        self.make_stager, self.kind = _stager_and_writer(parallelism.stages_in_shared_memory, info.device)
        self.stager = self.make_stager()

    def write(self, payload: dict, folder: str) -> Future:
        """DCP's async_save of `payload` into `folder`: staged (copied to host memory) before it returns,
        written in the background. Collective."""
        if STAGER_SERVES_ONE_SAVE and isinstance(self.stager, DefaultStager):
            self.stager.close()
            self.stager = self.make_stager()
        return dcp.async_save(
            payload,
            storage_writer=RecordingWriter(folder),
            process_group=self.group,
            async_checkpointer_type=self.kind,
            async_stager=self.stager,
        )

    def start_process(self, scratch: str) -> None:
        """DCP starts its writer process (seconds of a core) at the first background save, slowing the steps
        around it: a save of one number into `scratch` starts it now (a writer thread needs none). Collective."""
        if self.kind != AsyncCheckpointerType.PROCESS:
            return
        started = time.perf_counter()
        self.write({"writer_start": torch.zeros(1)}, scratch).result()
        dist.barrier()
        if self.info.is_main:
            shutil.rmtree(scratch, ignore_errors=True)
        get_logger().info("background checkpoint writer started (%.1f s)", time.perf_counter() - started)

    def close(self) -> None:
        self.stager.close()


# torch 2.11 and 2.12's DefaultStager fails a second save ("KeyError: <class 'type'>", docs/pitfalls.md #45):
# there each background save gets a stager of its own (those versions free the buffers after each save anyway).
STAGER_SERVES_ONE_SAVE = (2, 11) <= TorchVersion(torch.__version__) < (2, 13)


def _stager_and_writer(shared_memory: bool, device: torch.device) -> tuple:
    """(what makes the stager, who writes) of a background save. FSDP2 (`shared_memory`): shared memory (pinned on
    GPU) that DCP's writer process reads, kept for the next save; FSDP1: a plain copy (on GPU into pinned buffers
    kept for the next save) that a thread writes."""
    on_gpu = device.type == "cuda"
    if shared_memory:
        options = StagingOptions(
            use_pinned_memory=on_gpu, use_shared_memory=True, use_async_staging=False, use_non_blocking_copy=on_gpu
        )
        return partial(DefaultStager, options), AsyncCheckpointerType.PROCESS
    return partial(BlockingAsyncStager, cache_staged_state_dict=on_gpu), AsyncCheckpointerType.THREAD


def check_room_to_stage(rank_bytes: int, shared: bool) -> None:
    """Before training: the copies a background save stages on this host must fit, or every rank stops with one
    message (`staging_problem`), not with SIGBUS or the OOM killer at the first save. Collective."""
    ranks_here = ranks_on_this_host(dist.get_world_size())
    problem = staging_problem(rank_bytes, ranks_here, shared, free_shared_memory(), available_memory())
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    found = next((p for p in problems if p is not None), None)
    if found is not None:
        raise ConfigError(found)


def staging_problem(
    rank_bytes: int, ranks_here: int, shared: bool, free_shared: int | None, available: int | None
) -> str | None:
    """Why `ranks_here` ranks' background saves of `rank_bytes` each cannot be staged on this host, or None:
    `shared` (FSDP2) in shared memory, which Docker and Kubernetes give 64 MB by default, else in host memory.
    A reading that is None (not Linux) refuses nothing."""
    needed = rank_bytes * ranks_here
    copies = f"{ranks_here} rank(s) x {size_text(rank_bytes)} (each rank's model and optimizer shards)"
    if shared and free_shared is not None and needed > free_shared:
        return (
            f"--async_checkpoint true: a background save stages {copies} in shared memory, {size_text(needed)}, "
            f"and {SHM} has {size_text(free_shared)} free. Give it more (docker run "
            f"--shm-size={math.ceil(needed * 1.1 / 1e9)}g; Kubernetes: an emptyDir of medium Memory mounted at "
            f"{SHM}), or save synchronously: --async_checkpoint false"
        )
    if available is not None and needed > available:
        return (
            f"--async_checkpoint true: a background save copies {copies} into host memory, {size_text(needed)}, "
            f"and this host has {size_text(available)} available. Save synchronously: --async_checkpoint false "
            "(or fewer ranks per host, a larger host)"
        )
    return None


SHM = "/dev/shm"  # where torch's shared memory lives on Linux


def free_shared_memory() -> int | None:
    """Free bytes of /dev/shm (None where there is none: not Linux)."""
    try:
        stats = os.statvfs(SHM)
    except (OSError, AttributeError):
        return None
    return stats.f_bavail * stats.f_frsize


def say_if_background_writes_have_no_core(device: torch.device, world_size: int) -> None:
    """Rank 0, once: on a CPU run whose ranks' threads take every core of the host, a background write takes its
    CPU from training and costs it as much as a synchronous save, or more (docs/checkpoints.md). GPU ranks leave
    their cores mostly free."""
    if device.type != "cpu":
        return
    cores, threads = usable_cpus(), torch.get_num_threads()
    ranks = ranks_on_this_host(world_size)
    if cores < ranks * (threads + 1):
        get_logger().warning(
            "--async_checkpoint true: %d CPU core(s), %d rank(s) of %d thread(s) each: the background writes "
            "have no core of their own, so they take their CPU from training, and a background save costs it as "
            "much as a synchronous one, or more. Leave a core per rank free (fewer threads: OMP_NUM_THREADS, or "
            "fewer ranks) or keep --async_checkpoint false",
            cores, ranks, threads,
        )  # fmt: skip
