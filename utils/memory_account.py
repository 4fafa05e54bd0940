"""Per-rank memory account: how much of the model and optimizer state each rank holds, and what it cost.

Written once, after the first optimizer step of a run (AdamW creates its state lazily at that step), as one
`{"type": "memory", ...}` record per rank in metrics.jsonl.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from utils.memory import gather_ints, peak_rss_bytes


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


def memory_records(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    device: torch.device,
    load_rss_delta_bytes: int,
    param_numel_total: int,
) -> list[dict]:
    """One record per rank, in rank order (on every rank). Collective."""
    peak_rss = peak_rss_bytes()
    cuda_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1
    rows = gather_ints(
        [load_rss_delta_bytes, param_numel_local(model), optim_state_numel_local(optimizer), peak_rss, cuda_peak],
        device,
    )
    return [
        {
            "type": "memory",
            "rank": rank,
            "load_rss_delta_bytes": load_delta,
            "param_numel_local": params,
            "param_numel_total": param_numel_total,
            "optim_state_numel_local": optim,
            "peak_rss_bytes": rss,
            "cuda_peak_allocated_bytes": None if cuda < 0 else cuda,
        }
        for rank, (load_delta, params, optim, rss, cuda) in enumerate(rows)
    ]
