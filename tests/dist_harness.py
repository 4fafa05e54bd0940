"""Run a test function on N spawned ranks of a gloo CPU process group, with a short timeout.

A hang fails the test within `timeout_s` (the processes are killed) instead of eating the CI budget, and a
rank's exception fails the test with that rank's traceback.
"""

import datetime
import os
import pickle
import tempfile
import time
import traceback
import warnings

import torch.distributed as dist
import torch.multiprocessing as mp

from utils.distributed.process_group import free_port

# Collectives give up after this long when a peer is gone (torch's default is 30 minutes).
PROCESS_GROUP_TIMEOUT_S = 30
OWN_MODULES = r"((configs|policies|utils|scripts)(\.|$)|(T5_training|summarization_dataset)$)"


def _rank_entry(fn, rank: int, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    result_path = os.path.join(out_dir, f"rank{rank}.pkl")
    for category in (DeprecationWarning, FutureWarning):  # this package's own, as pyproject.toml says
        warnings.filterwarnings("error", category=category, module=OWN_MODULES)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
        )
        outcome = ("ok", fn(rank, world_size, *args))
    except BaseException:
        outcome = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(result_path, "wb") as f:
        pickle.dump(outcome, f)


def run_ranks(fn, *args, world_size: int = 2, timeout_s: float = 180) -> list:
    """fn(rank, world_size, *args) on every rank; returns the per-rank results in rank order.

    `fn` must be a module-level function (it is pickled into spawned processes).
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_rank_entry, args=(fn, rank, world_size, port, out_dir, args))
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        if hung:
            raise AssertionError(f"ranks {hung} did not finish within {timeout_s} s (hang?)")
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                raise AssertionError(f"rank {rank} died without a result (exit code {procs[rank].exitcode})")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
