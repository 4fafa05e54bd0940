"""Where the job runs: device and backend choice, the bf16 check, the process group's life.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; a plain `python T5_training.py`
runs as a world of one.
"""

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from utils.errors import ConfigError
from utils.logging_utils import get_logger


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launcher_ranks() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) without it."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


def resolve_device(choice: str, local_rank: int) -> torch.device:
    """`auto`: this rank's GPU (cuda:LOCAL_RANK) when CUDA is available, else the CPU."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return torch.device("cpu")
    if choice != "cuda":
        raise ConfigError(f"--device must be auto, cuda or cpu, not {choice!r}")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda, but CUDA is not available here; use --device cpu (or auto)")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK {local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
            "launch with --nproc_per_node at most the number of GPUs"
        )
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def bf16_supported(device: torch.device) -> bool:
    """Can this device compute in bf16 and its backend reduce bf16 tensors?

    Replaces the tutorial's check, which imported pkg_resources (gone from recent setuptools) and read
    torch.version.cuda (None on CPU builds). On CUDA: the GPU supports bf16 (Ampere or newer) and NCCL is
    2.10+, the first with bf16 reductions. On CPU: torch computes bf16 on any x86/ARM CPU (natively with
    AVX512-BF16/AMX, emulated and slower otherwise) and gloo reduces bf16, so a tiny bf16 matmul is the test.
    """
    if device.type == "cuda":
        nccl_ok = dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
        return bool(torch.cuda.is_bf16_supported() and nccl_ok)
    try:
        probe = torch.ones(2, 2, dtype=torch.bfloat16)
        return bool((probe @ probe).eq(2).all())
    except RuntimeError:
        return False


def init_distributed(device_choice: str, timeout_s: int) -> DistInfo:
    """Create the default process group (before any DistributedSampler is built) and pin the GPU.

    Collective: every rank must call it. The timeout bounds how long a rank waits in a collective for a
    peer that died or diverged.
    """
    rank, local_rank, world_size = launcher_ranks()
    device = resolve_device(device_choice, local_rank)
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1:
        # A plain `python T5_training.py`: a one-process group, so the code path is the same as torchrun's.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    get_logger().info("process group: backend=%s world_size=%d device=%s", backend, world_size, device)
    return DistInfo(rank, local_rank, world_size, device, backend)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def destroy_distributed() -> None:
    """Tear the process group down if one exists; safe on every exit path."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
