"""Full-model checkpoints: the tutorial's rank-0 CPU state dict, saved atomically as a .pt file."""

import os
import warnings

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from utils.logging_utils import get_logger

MODEL_FILE_PREFIX = "T5-model"


def gather_full_state_dict(model, device: torch.device) -> dict:
    """The unsharded model state dict on rank 0, for either backend. Collective."""
    if isinstance(model, FSDP):
        return gather_full_state_dict_fsdp1(model, device)
    # FSDP2: streamed to rank 0's host memory unit by unit (no CPU-group bug here, PITFALLS item 1).
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def gather_full_state_dict_fsdp1(model: FSDP, device: torch.device) -> dict:
    """The unsharded model state dict on rank 0 (an empty dict on every other rank: never index it there).

    Collective: every rank must call it. Each unit's full parameters are gathered in turn and, on GPU,
    copied to host memory one by one (`offload_to_cpu`), so rank 0 needs about the model's size in RAM
    and only one unit on the GPU. On a CPU group the parameters already are in host memory and
    offload_to_cpu=True crashes FSDP (PITFALLS item 1), so it is used on GPU only.
    """
    policy = FullStateDictConfig(offload_to_cpu=device.type == "cuda", rank0_only=True)
    with warnings.catch_warnings():
        # torch marks FSDP.state_dict_type as deprecated in favour of get_state_dict (the FSDP2-era API);
        # this is the tutorial's FSDP1 path, kept on purpose, so the per-call warning is noise.
        warnings.filterwarnings("ignore", message=".*state_dict_type.*", category=FutureWarning)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, policy):
            return model.state_dict()


def checkpoint_filename(run_id: str, epoch: int, val_loss: float | None) -> str:
    """Unique per run and epoch, so saves never overwrite each other or an earlier run's."""
    loss_part = f"-val{val_loss:.4f}" if val_loss is not None else ""
    return f"{MODEL_FILE_PREFIX}-{run_id}-epoch{epoch}{loss_part}.pt"


def atomic_torch_save(obj, path: str) -> None:
    """Write under a temporary name and rename: a crash mid-save never leaves a truncated `path`."""
    tmp = f"{path}.tmp"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_full_model(model: FSDP, device: torch.device, is_main: bool, path: str) -> str | None:
    """Gather the full state dict (collective) and save it on rank 0. Returns the path on rank 0."""
    state = gather_full_state_dict(model, device)
    if not is_main:
        return None
    atomic_torch_save(state, path)
    get_logger().info("saved full model state dict: %s (%.1f MB)", path, os.path.getsize(path) / 1e6)
    return path


def load_full_model_state(path: str) -> dict:
    """A saved .pt as a plain state dict, for `T5ForConditionalGeneration.load_state_dict(strict=True)`.

    weights_only=True: only tensors are unpickled, never arbitrary objects.
    """
    return torch.load(path, map_location="cpu", weights_only=True)
