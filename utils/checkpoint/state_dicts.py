"""State dicts of the sharded model and optimizer, for both FSDP backends: gathering, loading, the
tutorial's full-model .pt.

Every gather here is a collective: every rank must call it (docs/pitfalls.md #3).
"""

import re
import warnings

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from utils.files import atomic_path, disk_bytes
from utils.log import get_logger

# FSDP1's optimizer-state utilities ask the process group for its device through a deprecated helper on
# every call, and on a gloo group that helper also warns that it has to guess: two UserWarnings per rank per
# checkpoint, about torch internals, that nobody can act on. Ignored for that torch module only. (Filters
# set once here, not per call with catch_warnings: leaving a catch_warnings block resets Python's
# once-per-location memory, and every other warning would then repeat.)
for _message in (
    "`_get_pg_default_device` will be deprecated",
    "Multiple backends are registered with this ProcessGroup",
):
    warnings.filterwarnings(
        "ignore",
        message=re.escape(_message),
        category=UserWarning,
        module=r"torch\.distributed\.fsdp\._optim_utils",
    )
# torch marks FSDP.state_dict_type as deprecated in favour of get_state_dict (the FSDP2-era API); the
# tutorial's FSDP1 full-state path uses it on purpose, so the per-call warning is noise.
warnings.filterwarnings("ignore", message=".*state_dict_type.*", category=FutureWarning)


def model_and_optimizer_state(model: nn.Module, optimizer, full: bool, device: torch.device) -> tuple[dict, dict]:
    """Model and optimizer state dicts: full (gathered on rank 0) or this rank's shards. Collective.

    On GPU, full state is copied to rank 0's host memory unit by unit. On a CPU group the tensors already are
    in host memory and cpu_offload crashes FSDP1 (docs/pitfalls.md #1), so it is never asked for there.
    """
    options = StateDictOptions(full_state_dict=full, cpu_offload=full and device.type == "cuda")
    return get_state_dict(model, optimizer, options=options)


def sharded_model_state(model: nn.Module) -> dict:
    """This rank's shards of the model state dict (no gather, no optimizer). Collective."""
    return get_model_state_dict(model)


def set_optimizer_state(model: nn.Module, optimizer, optim_state: dict, full: bool) -> None:
    """Load an optimizer state dict (full or sharded) into the optimizer of the wrapped model. Collective.

    The saved parameter groups also carry the kernel choice of the run that saved them. This run keeps its
    own (--on_nonfinite skip needs the fused kernel, whichever the checkpoint was written with), and sets
    it in the loaded groups *before* loading: torch places each `step` counter by the loaded group's kernel
    (on the GPU for fused), so restoring the flags afterwards would leave a fused kernel with CPU counters
    (docs/pitfalls.md #31)."""
    for saved, group in zip(optim_state.get("param_groups", []), optimizer.param_groups, strict=True):
        saved.update(fused=group["fused"], foreach=group["foreach"])
    set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=full))


def tensor_only_optimizer_state(optim_state: dict) -> dict:
    """{param name: {exp_avg, exp_avg_sq, step}}: the tensors of an optimizer state, without hyper-parameters."""
    return {name: dict(values) for name, values in optim_state["state"].items()}


def param_groups_from_json(groups: list[dict]) -> list[dict]:
    """Optimizer param groups read back from JSON, which turned tuples (AdamW's betas) into lists."""
    return [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in groups]


def gather_full_state_dict(model: nn.Module, device: torch.device) -> dict:
    """The unsharded model state dict on rank 0, for either backend. Collective."""
    if isinstance(model, FSDP):
        return _gather_full_state_dict_fsdp1(model, device)
    # FSDP2: streamed to rank 0's host memory unit by unit (no CPU-group bug here).
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _gather_full_state_dict_fsdp1(model: FSDP, device: torch.device) -> dict:
    """The unsharded model state dict on rank 0 (an empty dict on every other rank: never index it there).

    Each unit's full parameters are gathered in turn and, on GPU, copied to host memory one by one
    (`offload_to_cpu`), so rank 0 needs about the model's size in RAM and only one unit on the GPU. On a
    CPU group offload_to_cpu=True crashes FSDP1 (docs/pitfalls.md #1), so it is used on GPU only.
    """
    policy = FullStateDictConfig(offload_to_cpu=device.type == "cuda", rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, policy):
        return model.state_dict()


def save_full_model(model: nn.Module, device: torch.device, is_main: bool, path: str) -> str | None:
    """Gather the full state dict (collective) and save it atomically on rank 0. Returns the path there."""
    state = gather_full_state_dict(model, device)
    if not is_main:
        return None
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    get_logger().info("saved full model state dict: %s (%.1f MB)", path, disk_bytes(path) / 1e6)
    return path
