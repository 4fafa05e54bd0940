"""The pooled rank processes (tests/rank_pool.py): a scenario finds what a fresh process has, whatever the one
before it changed, on the same reused worker; a hang fails fast, and a rank left waiting by a failed peer ends as
torchrun ends it (SIGTERM) or is killed after a grace; workers not to be trusted are replaced."""

import logging
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed as dist

from configs.paths import REPO_ROOT
from tests import rank_pool
from tests.dist_harness import run_ranks
from tests.rank_pool import pool


def changes_what_a_process_has(rank: int, world_size: int) -> tuple[int, list]:
    """Changes each kind of state the pool puts back; returns the worker's pid and its first random numbers."""
    from configs import run
    from utils.base import layout
    from utils.base.log import get_logger
    from utils.distributed import hang_report

    os.environ["RANK_POOL_PROBE"] = "left over"
    os.chdir("/")
    sys.argv.append("--left-over")
    sys.path.append("/left/over")
    os.umask(0o077)
    drawn = [torch.rand(5).tolist(), random.random(), numpy.random.rand()]  # the random streams move on
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    get_logger().setLevel(logging.DEBUG)
    logging.disable(logging.INFO)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    warnings.simplefilter("ignore")
    layout.CONFIG_FILE = "left_over.json"  # a module global rebound
    run.RECORD_KEYS["left_over"] = "x"  # a module global's items
    hang_report.WHERE.enter("left over", step=7)  # a package object's attributes
    return os.getpid(), drawn


def what_a_process_has(rank: int, world_size: int) -> dict:
    from configs import run
    from utils.base import layout
    from utils.base.log import get_logger
    from utils.distributed import hang_report

    return {
        "pid": os.getpid(),
        "first random numbers": [torch.rand(5).tolist(), random.random(), numpy.random.rand()],
        "probe": os.environ.get("RANK_POOL_PROBE"),
        "cwd": os.getcwd(),
        "argv has the left-over": "--left-over" in sys.argv,
        "path has the left-over": "/left/over" in sys.path,
        "umask": os.umask(0o022),
        "threads": torch.get_num_threads(),
        "dtype": str(torch.get_default_dtype()),
        "grad": torch.is_grad_enabled(),
        "package logger level": get_logger().level,
        "logging disabled": logging.root.manager.disable,
        "SIGUSR1 handler is the default": signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL,
        "an ignore-everything filter": ("ignore", None, Warning, None, 0) in warnings.filters,
        "own deprecations are errors": any(f[:3:2] == ("error", DeprecationWarning) for f in warnings.filters),
        "CONFIG_FILE": layout.CONFIG_FILE,
        "RECORD_KEYS has the left-over": "left_over" in run.RECORD_KEYS,
        "WHERE": (hang_report.WHERE.phase, hang_report.WHERE.step),
    }


def imports_inherited(rank: int, world_size: int) -> bool:
    return "tests.rank_pool_fork_server" in sys.modules


@pytest.mark.skipif(sys.platform != "linux", reason="the pool forks its workers on Linux only (elsewhere: spawn)")
def test_workers_are_forked_from_the_server_that_did_the_imports():
    """The fork server's module is in each worker: it imported everything once, and the workers were forked
    from it (else each would do its own imports, as a spawned one does: correct, silently slower)."""
    assert run_ranks(imports_inherited) == [True, True]


def test_a_scenario_finds_what_a_fresh_process_has_whatever_the_one_before_changed():
    """The random streams start where the worker's started (a new process seeds them at random: each run seeds
    its own), so both scenarios draw the same first numbers."""
    before = run_ranks(changes_what_a_process_has)
    # Each worker seeds torch's, Python's and NumPy's streams of its own, as a new process does (a worker forked
    # from the server would otherwise start from the server's).
    for numbers in zip(*(drawn for _, drawn in before), strict=True):
        assert numbers[0] != numbers[1], before
    for rank, seen in enumerate(run_ranks(what_a_process_has)):
        pid, drawn = before[rank]
        assert seen == {
            "pid": pid,  # the same worker, reused
            "first random numbers": drawn,
            "probe": None,
            "cwd": str(REPO_ROOT),
            "argv has the left-over": False,
            "path has the left-over": False,
            "umask": 0o022,
            "threads": 1,
            "dtype": "torch.float32",
            "grad": True,
            "package logger level": logging.NOTSET,  # set up by each run (utils/base/log.py: setup_logging)
            "logging disabled": logging.NOTSET,
            "SIGUSR1 handler is the default": True,
            "an ignore-everything filter": False,
            "own deprecations are errors": True,
            "CONFIG_FILE": "config.json",
            "RECORD_KEYS has the left-over": False,
            "WHERE": ("setup", None),
        }, rank


def test_fresh_workers_are_new_processes_that_ran_nothing(tmp_path):
    """pooled(fresh_workers=True), for a memory measure: workers that ran a scenario are replaced first (a new
    pid on each rank), and the next plain scenario reuses the fresh ones."""
    from tests.launch import pooled

    script = tmp_path / "pid.py"
    script.write_text("import os\nprint('pid', os.getpid())\n", encoding="utf-8")

    def pids(**options) -> list[str]:
        run = pooled([], script=str(script), **options)
        assert run.returncode == 0, run.describe()
        return sorted(line for line in run.output.splitlines() if line.startswith("pid"))

    used = pids()
    fresh = pids(fresh_workers=True)
    assert len(fresh) == 2 and not set(fresh) & set(used)
    assert pids() == fresh


def sleeps(rank: int, world_size: int, seconds: float) -> None:
    time.sleep(seconds)


def fails_on_rank_1_while_rank_0_sleeps(rank: int, world_size: int, rank_0_sigterm: str, marker: str) -> str:
    """Rank 1 raises; rank 0 sleeps with SIGTERM as it is (the pool's), ignored (as a rank blocked inside a
    collective, which runs no Python handler), or handled (as a training run's stop request): it then writes
    `marker` and returns."""
    received = []
    if rank == 0 and rank_0_sigterm == "ignored":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif rank == 0 and rank_0_sigterm == "handled":
        signal.signal(signal.SIGTERM, lambda signum, _frame: received.append(signum))
    dist.barrier()  # rank 0's handler is in place before rank 1 fails
    if rank == 1:
        raise RuntimeError("rank 1 failed")
    deadline = time.monotonic() + 600
    while not received and time.monotonic() < deadline:
        time.sleep(0.05)
    Path(marker).write_text("received SIGTERM")
    return "stopped on request"


@pytest.mark.slow  # two deadlines and a grace, on purpose: about 4 s
def test_a_hang_and_a_rank_left_waiting_by_a_failed_peer_end_fast_and_the_untrusted_workers_are_replaced(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(rank_pool, "FAILED_PEER_GRACE_S", 1)  # the pool's 10 s, shortened
    marker = tmp_path / "marker"
    started = pool().started
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 0 did not finish within 2 s \(hang\?\): killed"):
        run_ranks(sleeps, 600, timeout_s=2)  # a sleep 300 times the deadline
    assert time.monotonic() - start < 60
    assert pool().started == started + 2  # both workers
    # A rank left waiting by a failed peer gets SIGTERM, as torchrun sends it. With no handler of its own, its
    # scenario ends there, and its worker, stopped at an arbitrary point, is replaced with the failed rank's.
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(fails_on_rank_1_while_rank_0_sleeps, "as it is", str(marker), timeout_s=300)
    assert time.monotonic() - start < 60  # not the 300 s deadline
    assert "RuntimeError: rank 1 failed" in str(failed.value)
    assert f"rank 0 failed:\n{rank_pool.STOPPED_BY_A_FAILED_PEER}" in str(failed.value)
    assert not marker.exists() and pool().started == started + 4
    # One that handles it, as a training run does, gets it and ends as it chooses; its worker is reused.
    with pytest.raises(AssertionError) as failed:
        run_ranks(fails_on_rank_1_while_rank_0_sleeps, "handled", str(marker), timeout_s=300)
    assert "RuntimeError: rank 1 failed" in str(failed.value) and "rank 0 failed" not in str(failed.value)
    assert marker.read_text() == "received SIGTERM" and pool().started == started + 5
    marker.unlink()
    # One that does not end on SIGTERM is killed after the grace, and replaced too.
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(fails_on_rank_1_while_rank_0_sleeps, "ignored", str(marker), timeout_s=300)
    assert time.monotonic() - start < 60  # the grace after rank 1's failure, not the 300 s deadline
    assert "RuntimeError: rank 1 failed" in str(failed.value)
    assert "rank 0 was still running 1 s after another rank failed: killed" in str(failed.value)
    assert not marker.exists() and pool().started == started + 7
    assert run_ranks(what_a_process_has)[0]["probe"] is None  # the new workers run scenarios
