"""Memory per rank: peaks (CUDA allocated/reserved on GPU, resident set size on CPU) and the memory
account, which says how much of the model and optimizer state each rank holds and what loading cost.

The account is written by each training process (a run's start, each resume), after its first optimizer step
(AdamW creates its state lazily at that step), as one `{"type": "memory", ...}` record per rank in
metrics.jsonl, with that step.
"""

import contextlib
import ctypes
import resource
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from policies.activation_checkpointing_functions import kept_outputs_seen_by
from policies.private_api import storage_identity, view_base
from utils.distributed.process_group import gather_ints


@dataclass(frozen=True)
class MemoryBaseline:
    """Measured while loading, reported in the memory account."""

    load_rss_delta_bytes: int  # RSS high-water mark from before the model was built until it was sharded
    param_numel_total: int  # the model's parameters, tied weights counted once


def _proc_status_bytes(field: str) -> int | None:
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def available_memory() -> int | None:
    """Linux's MemAvailable (bytes): what can be allocated without swapping; None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since the last reset_peak_rss (or its start)."""
    peak = _proc_status_bytes("VmHWM")  # not Linux: ru_maxrss (in kilobytes on Linux, bytes on macOS)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss if peak is None else peak


def current_rss_bytes() -> int:
    current = _proc_status_bytes("VmRSS")
    return peak_rss_bytes() if current is None else current


def reset_peak_rss() -> None:
    """Writing 5 to /proc/self/clear_refs resets the kernel's RSS high-water mark (Linux >= 4.0); where that
    is not allowed the peak stays the process lifetime's."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return None


_LIBC = _load_libc()


def trim_host_heap() -> None:
    """Give freed host memory back to the OS (glibc's malloc_trim; a no-op elsewhere), which glibc keeps in its
    heaps (docs/memory.md): a walk of the heaps (milliseconds), and the next step faults its pages in again."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak measurement (e.g. per epoch): CUDA allocator stats on GPU, the RSS peak on CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def gather_peaks(device: torch.device) -> tuple[list[int], list[int] | None]:
    """Every rank's peak memory since the last reset (the caching allocator's peak allocated bytes on GPU, the
    process's peak RSS on CPU), and (CUDA only) its peak reserved bytes. Collective."""
    if device.type == "cuda":
        local = [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)]
    else:
        local = [peak_rss_bytes(), -1]
    rows = gather_ints(local, device)
    reserved = [row[1] for row in rows] if device.type == "cuda" else None
    return [row[0] for row in rows], reserved


def _local_numel(tensor: torch.Tensor) -> int:
    """Elements this rank stores: a DTensor's local shard (FSDP2), else the tensor itself (FSDP1's flat
    parameter already is this rank's shard, padding included)."""
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel()


def param_numel_local(model: nn.Module) -> int:
    return sum(_local_numel(p) for p in model.parameters())


def optim_state_numel_local(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        _local_numel(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0  # AdamW's scalar step counter excluded
    )


class SavedTensorCounter:
    """Counts the bytes autograd keeps for backward while it is entered (a context manager): every tensor
    a forward saves, once per storage, parameters and views of them (FSDP1's flat-parameter views
    included) left out. It counts what is held, not what is computed, so a CPU run measures exactly what a
    GPU would hold. Under non-reentrant activation checkpointing a block's own tensors are saved by the
    checkpoint's hooks, which come first and keep nothing; what it keeps is the block's inputs, which it
    saves outside them, where this counter sees them. Per op (--activation_checkpointing_scope ops) a block
    also keeps the outputs of its matmuls and attention kernels, in torch's own storage: the policy hands
    those to the counter too (policies/activation_checkpointing_functions.py: kept_outputs_seen_by)."""

    def __init__(self):
        self.bytes = 0
        self._seen: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._kept_outputs = kept_outputs_seen_by(self._pack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(view_base(tensor), nn.Parameter):
            key = storage_identity(tensor)  # fake tensors too (scripts/estimate_memory.py), whose data_ptr is 0
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self) -> "SavedTensorCounter":
        self._hooks.__enter__()
        self._kept_outputs.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._kept_outputs.__exit__(*exc)
        self._hooks.__exit__(*exc)


def memory_records(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    baseline: MemoryBaseline,
    saved_activation_bytes: int,
    saved_batch_shape: tuple[int, int, int],
) -> list[dict]:
    """One memory-account record per rank, in rank order (on every rank). Collective. `saved_batch_shape`:
    rows, source and target length of the micro-batch whose saved bytes were counted."""
    cuda_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1
    local = [
        baseline.load_rss_delta_bytes,
        param_numel_local(model),
        optim_state_numel_local(optimizer),
        peak_rss_bytes(),
        cuda_peak,
        saved_activation_bytes,
        *saved_batch_shape,
    ]
    return [
        {
            "type": "memory",
            "rank": rank,
            "load_rss_delta_bytes": load_delta,
            "param_numel_local": params,
            "param_numel_total": baseline.param_numel_total,
            "optim_state_numel_local": optim,
            "peak_rss_bytes": rss,
            "cuda_peak_allocated_bytes": None if cuda < 0 else cuda,
            "saved_activation_bytes": saved,
            "saved_activation_batch": batch_shape,  # [rows, source length, target length]
        }
        for rank, (load_delta, params, optim, rss, cuda, saved, *batch_shape) in enumerate(
            gather_ints(local, device)
        )
    ]
