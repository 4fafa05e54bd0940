"""Peak memory per rank: CUDA allocated/reserved on GPU, peak resident set size (RSS) on CPU."""

import resource

import torch
import torch.distributed as dist

PROC_STATUS = "/proc/self/status"
PROC_CLEAR_REFS = "/proc/self/clear_refs"


def _proc_status_bytes(field: str) -> int | None:
    try:
        with open(PROC_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since the last reset_peak_rss (or its start)."""
    peak = _proc_status_bytes("VmHWM")
    if peak is None:  # not Linux: ru_maxrss is in kilobytes on Linux, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak


def current_rss_bytes() -> int:
    current = _proc_status_bytes("VmRSS")
    return peak_rss_bytes() if current is None else current


def reset_peak_rss() -> None:
    """Writing 5 to /proc/self/clear_refs resets the kernel's RSS high-water mark (Linux >= 4.0); where that
    is not allowed the peak stays the process lifetime's."""
    try:
        with open(PROC_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        pass


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak measurement (e.g. per epoch): CUDA allocator stats on GPU, the RSS peak on CPU."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def peak_memory(device: torch.device) -> tuple[int, int | None]:
    """(peak bytes, peak reserved bytes or None) since the last reset.

    GPU: the caching allocator's peak allocated and reserved bytes. CPU: the peak RSS of this process.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    return peak_rss_bytes(), None


def gather_ints(values: list[int], device: torch.device) -> list[list[int]]:
    """values of every rank, in rank order. Collective: every rank must call it with as many values."""
    local = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [t.tolist() for t in gathered]
