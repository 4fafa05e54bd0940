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


def torchrun(
    args: list[str], nproc: int = 2, script: str = "T5_training.py", timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `script` on nproc CPU ranks; offline, one thread per rank. Returns the finished process."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        script,
        *args,
    ]
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(command, cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
