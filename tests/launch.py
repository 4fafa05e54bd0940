"""Launching T5_training.py (or a wrapper of it) through torchrun from tests."""

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(args: list[str], nproc: int = 2, script: str = "T5_training.py") -> list[str]:
    port = str(free_port())
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        port,
        script,
        *args,
    ]


def offline_env(extra: dict | None = None) -> dict:
    """The test environment of a run: no hub access, one thread per rank (2 ranks share 2 cores)."""
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **(extra or {}))


def program_tracebacks(output: str) -> list[str]:
    """Python tracebacks in the output, except torchrun's own report that a child exited non-zero.

    torchrun (the launcher, not this program) always ends with a ChildFailedError traceback when a rank
    exits non-zero; the program's ranks must print none for a user error.
    """
    found = []
    for block in output.split("Traceback (most recent call last):")[1:]:
        exception_line = next((line for line in block.splitlines() if line and not line[0].isspace()), "")
        if not exception_line.startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailedError"):
            found.append("Traceback (most recent call last):" + block[:2000])
    return found


def torchrun(
    args: list[str], nproc: int = 2, script: str = "T5_training.py", timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `script` on nproc CPU ranks; offline, one thread per rank. Returns the finished process."""
    command = torchrun_command(args, nproc, script)
    full_env = offline_env(env)
    return subprocess.run(command, cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
