"""Where the job runs and how its processes talk: device and backend, the process group's life, and the few
collectives the package calls itself (the launcher's environment is read in utils/distributed/launcher.py).
"""

import datetime
import gc
import os
import socket
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from configs.errors import ConfigError, UserError
from policies.private_api import default_store
from utils.base.log import get_logger
from utils.distributed import hang_report
from utils.distributed.launcher import launcher_ranks
from utils.distributed.progress_bounded import PeerFailed

# Phrases of the errors a rank gets when a peer died mid-collective: a consequence, not the cause.
PEER_FAILURE_PHRASES = ("Connection closed by peer", "Connection reset by peer", "remote worker crash")


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

    @property
    def compute_capability(self) -> tuple[int, int]:
        """The GPU's CUDA compute capability ((8, 9) for an L4, (9, 0) for an H100); (0, 0) on CPU."""
        return torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else (0, 0)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity; macOS has no affinity call: all of them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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


def describe_launch(device_choice: str, cpu_offload: bool = False) -> DistInfo:
    """This process's place in the job, from the launcher's environment; no process group yet. The
    settings are checked against it before anything is created or read."""
    rank, local_rank, world_size = launcher_ranks()
    check_local_rank(os.environ)
    check_restarts(os.environ)
    device = resolve_device(device_choice, local_rank)
    return DistInfo(rank, local_rank, world_size, device, group_backend(device, cpu_offload))


def group_backend(device: torch.device, cpu_offload: bool) -> str:
    """The default process group's backend: NCCL between GPUs, gloo between CPU processes. With CPU offload a
    GPU run's group also gets gloo for CPU tensors (torchtitan's choice): FSDP2 then keeps the gradients as
    DTensors in host memory, and the gradient norm of every step all-reduces them, which a group with NCCL
    alone refuses ("No backend type associated with device type cpu")."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def torchrun_attempt(environ=os.environ, agent: str | None = None) -> tuple[str | None, int]:
    """(the torchrun launch this process belongs to, its restart count). The launch is its rendezvous id
    (where that is torchrun's default "none", the address of the agent's store) and the agent process that
    starts this node's workers, `agent` or else agent_process(): every attempt of one launch shares both,
    while a later launch with the same id or port has another agent. (None, 0) outside torchrun, or where
    nothing tells one launch from another."""
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    attempt = int(environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if run_id is None:
        return None, 0
    if run_id == "none":
        if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None, attempt
        run_id = f"none@{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
    return f"{run_id} agent {agent or agent_process()}", attempt


def agent_process() -> str:
    """The parent process (under torchrun, its agent) as "pid/start time" (the start time from Linux's /proc,
    so that a reused pid is another process; the pid alone elsewhere)."""
    pid = os.getppid()
    try:
        start_time = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return str(pid)
    return f"{pid}/{start_time}"


def check_local_rank(environ) -> None:
    """Refuse a launch that names a world of several processes but not each one's place on its node (a
    hand-made srun or mpirun environment): every rank would take the first GPU and build the data cache."""
    world_size = int(environ.get("WORLD_SIZE", 1))
    if world_size > 1 and "LOCAL_RANK" not in environ:
        raise ConfigError(
            f"WORLD_SIZE is {world_size} and LOCAL_RANK is not set: launch with torchrun (README; under SLURM, "
            "scripts/slurm/train.sbatch), or set LOCAL_RANK and LOCAL_WORLD_SIZE for each process as torchrun does"
        )


def check_restarts(environ) -> None:
    """Refuse a torchrun --max_restarts launch whose restarts could not continue the run: several nodes with
    the agents' shared store, whose per-attempt prefixes would differ between nodes (docs/pitfalls.md #36), or
    no job to recognise (rendezvous id "none", no shared store) to tell its run in output_dir from an older one."""
    restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    nodes = int(environ.get("GROUP_WORLD_SIZE", 1))
    if restarts and nodes > 1 and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ConfigError(
            f"torchrun --max_restarts {restarts} on {nodes} nodes needs a rendezvous store per attempt: launch "
            "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment and --rdzv_backend c10d (README: "
            "multi-node), or without --max_restarts"
        )
    if restarts and torchrun_attempt(environ)[0] is None:
        raise ConfigError(
            f"torchrun --max_restarts {restarts} without a rendezvous id: a restart could not tell this run "
            "from an older one in --output_dir. Give torchrun --rdzv_id NAME (one per job, e.g. the SLURM "
            "job id), or launch without --max_restarts"
        )


def group_attempt(attempt: int, device: torch.device) -> int:
    """The highest torchrun restart count of any rank. Collective. On several nodes only the node whose
    worker failed counts a restart; the others restart their workers with the count they had."""
    value = torch.tensor([attempt], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def init_distributed(info: DistInfo, timeout_s: int, output_dir: str | None = None) -> None:
    """Create the default process group (before any DistributedSampler is built) and pin the GPU. Collective.
    The timeout bounds how long a rank waits in a collective for a peer that died or diverged. With
    `output_dir`, the flight recorder's settings for hang reports (utils/distributed/hang_report.py)."""
    if output_dir is not None:
        hang_report.record_collectives(output_dir, info.backend)  # read when the group forms
    if info.device.type == "cuda":
        expandable_segments()  # before set_device, which starts CUDA and its allocator
        torch.cuda.set_device(info.device)
    if info.world_size == 1:
        # A plain `python T5_training.py`: a one-process group, so the code path is the same as torchrun's.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(
            backend=info.backend,
            store=attempt_store(info.world_size, timeout),
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
            device_id=info.device if info.device.type == "cuda" else None,
        )
    except dist.DistError as err:  # the store's wait for a rank's address timed out, or a peer was unreachable
        raise GroupNotFormed(
            f"the process group of {info.world_size} ranks did not form within {timeout_s} s (--dist_timeout_s): "
            f"a rank died or hangs before joining (its output is above), or the ranks cannot reach each other "
            f"({str(err).splitlines()[0]})"
        ) from None
    # The store's own timeout is the one it was made with (torchrun's agent store: its own): --dist_timeout_s
    # also bounds a wait on it without progress (utils/distributed/progress_bounded.py).
    default_store().set_timeout(timeout)
    get_logger().info(
        "process group: backend=%s world_size=%d device=%s", info.backend, info.world_size, info.device
    )


def expandable_segments(environ: MutableMapping[str, str] = os.environ) -> None:
    """CUDA's allocator grows its segments in place rather than caching blocks of each size (torchtitan's
    default): batches of varying lengths then leave no unusable gaps of cached memory behind. Only where the
    user has set neither of torch's names for the allocator's settings."""
    if "PYTORCH_ALLOC_CONF" not in environ and "PYTORCH_CUDA_ALLOC_CONF" not in environ:
        environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"


class GroupNotFormed(RuntimeError):
    """init_distributed gave up: not every rank joined within --dist_timeout_s."""


def attempt_store(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, the rendezvous store of this attempt: the agent's store, its keys under a prefix of
    this attempt's own. None outside torchrun's agent store (init_process_group then makes its own).

    The agent keeps one store for the whole job, in which a restarted rank could read the address its peer had
    in the killed attempt (docs/pitfalls.md #35); TORCHELASTIC_RESTART_COUNT, the same for every rank of one
    agent, keeps the attempts apart (several nodes must not share the store: check_restarts)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent_store)


def destroy_distributed() -> None:
    """Tear the process group down if one exists; safe on every exit path. The wrapped model's reference
    cycles are collected first: freed at the interpreter's exit, they can abort it (docs/pitfalls.md #49)."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_peer_failure(err: BaseException) -> bool:
    """Whether `err` is this rank noticing that another rank died or failed (its own error is printed there)."""
    if isinstance(err, (dist.DistError, PeerFailed)):
        return True
    return any(phrase in str(err) for phrase in PEER_FAILURE_PHRASES)


def is_rank0() -> bool:
    """Rank 0 of the run (a process without a group, such as a script's, counts as one): who says things once."""
    return not dist.is_initialized() or dist.get_rank() == 0


def rank0_decides(decide: Callable[[], object]) -> object:
    """Run `decide` on rank 0 only and give every rank its result, or its UserError. Collective.

    For checks of the shared file system: one rank looks, and all ranks fail together with its message.
    Without a process group (one process, as the convert script and unit tests run), it just decides.
    """
    if not dist.is_initialized():
        return decide()
    outcome: list = [None, None]
    if dist.get_rank() == 0:
        try:
            outcome = [decide(), None]
        except UserError as err:
            outcome = [None, err]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


class StopAgreed(Exception):  # noqa: N818 - a signal between the loops, not an error
    """Every rank agreed, inside an evaluation pass, to stop (SIGTERM on one of them): the pass is abandoned."""


class StopCheck:
    """Agreement, once per evaluation batch, on whether any rank was asked to stop: raises StopAgreed on every
    rank, one batch after the request on the slowest. Collective (one scalar all-reduce per call).

    The flag all-reduced before batch k is read before batch k + 1, on a GPU from pinned host memory once its
    copy's event has passed: the host never waits for the batch it just queued."""

    def __init__(self, stop_requested: Callable[[], bool] | None, device: torch.device) -> None:
        self.stop_requested, self.device = stop_requested, device
        self.pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None  # last batch's flag, unread

    def __call__(self) -> None:
        if self.stop_requested is None:
            return
        flag = torch.full((1,), float(self.stop_requested()), device=self.device)  # no copy from host memory
        dist.all_reduce(flag)
        previous, self.pending = self.pending, self.on_host(flag)
        if previous is not None:
            host, copied = previous
            if copied is not None:
                copied.synchronize()
            if host.item() > 0:
                raise StopAgreed

    def on_host(self, flag: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """`flag` in host memory, and the event after which it holds the reduced value (None: it does now)."""
        if flag.device.type != "cuda":
            return flag, None
        host = torch.empty(1, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return host, copied


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is True on any. Collective."""
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value)
    return bool(value.item() > 0)


def gather_ints(values: list[int], device: torch.device) -> list[list[int]]:
    """values of every rank, in rank order. Collective: every rank must call it with as many values."""
    local = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [t.tolist() for t in gathered]
