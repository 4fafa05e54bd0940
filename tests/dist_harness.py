"""Run a test function on N ranks of a gloo CPU process group, with a short timeout.

The ranks are the session's pooled processes (tests/rank_pool.py): started once, each scenario in a new
process group with everything a fresh process would have put back. A hang fails the test within `timeout_s`
(the ranks are killed and replaced) instead of eating the CI budget, and a rank's exception fails the test with
that rank's traceback and output.
"""

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from tests.rank_pool import PROCESS_GROUP_TIMEOUT_S, Scenario, offline_env, pool, read_text, scenario_files
from utils.distributed.process_group import free_port

__all__ = ["PROCESS_GROUP_TIMEOUT_S", "one_process_group", "run_ranks"]


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """A gloo group of this (the test) process alone, for code that runs collectives on a single rank; torn down
    after the block."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_ranks(fn, *args, world_size: int = 2, timeout_s: float = 180, replace_after: bool = False) -> list:
    """fn(rank, world_size, *args) on every rank; returns the per-rank results in rank order.

    `fn` must be a module-level function (it is pickled into the rank processes), and so must its results be
    picklable. `replace_after`: the scenario leaves its ranks in a state not to be reused (a group that timed
    out on purpose): they are replaced once it has ended.
    """
    port = free_port()
    with scenario_files(world_size) as files:
        scenarios = [
            Scenario(
                rank=rank,
                world_size=world_size,
                environ={
                    **offline_env(),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world_size),
                },
                stdout_path=stdout,
                stderr_path=stderr,
                function=fn,
                args=args,
                replace_after=replace_after,
            )
            for rank, (stdout, stderr) in enumerate(files)
        ]
        outcomes = pool().run(scenarios, timeout_s)
        failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome.kind != "ok"]
        if failed:
            # The first failure is the cause; a peer's "connection closed" or timeout follows from it.
            reports = []
            for rank, outcome in failed:
                output = head_and_tail(read_text(files[rank][0])) + head_and_tail(read_text(files[rank][1]))
                reports.append(f"rank {rank} failed:\n{outcome.value}\n--- rank {rank}'s output\n{output}")
            raise AssertionError("\n".join(reports))
    return [outcome.value for outcome in outcomes]


def head_and_tail(text: str, size: int = 3000) -> str:
    """The first and last `size` characters: a rank that died prints its cause first (a C++ exception's
    "terminate called ...", "Fatal Python error") and every thread's stack after it."""
    if len(text) <= 2 * size:
        return text
    return f"{text[:size]}\n[... {len(text) - 2 * size} characters ...]\n{text[-size:]}"
