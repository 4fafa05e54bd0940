"""Resumable training checkpoints: model, optimizer, LR scheduler, grad scaler, progress and RNG states.

Layout of one checkpoint, output_dir/checkpoints/step_00000123/:

    train_state.json               progress (epoch, samples consumed in it, global step), scheduler, scaler,
                                   best validation loss, the model config; written last
    optimizer_param_groups.json    the optimizer's hyper-parameters, by parameter name
    rng/rank_<r>.pt                each rank's torch (and CUDA) RNG state: dropout continues exactly
    tokenizer/, config.json        what scripts/convert_checkpoint_to_hf.py needs besides the weights
    SHARDED_STATE_DICT: .metadata + __<r>_0.distcp   torch.distributed.checkpoint, each rank its shard
    FULL_STATE_DICT:    model.pt, optimizer.pt       full state dicts gathered on rank 0

A checkpoint is written under `.tmp_step_...` and renamed when every rank has finished, so a crash during a
save leaves only an ignored temporary folder, and the previous checkpoints stay loadable.

Nothing here unpickles arbitrary objects: .pt files load with weights_only=True, the DCP payload holds
tensors only (the optimizer's non-tensor hyper-parameters are JSON), and DCP's `.metadata` file, a pickle,
is read by an unpickler that admits only DCP's own metadata classes.
"""

import json
import os
import pickle
import re
import shutil
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from utils.environment import DistInfo
from utils.errors import UserError
from utils.logging_utils import get_logger

FULL = "FULL_STATE_DICT"
SHARDED = "SHARDED_STATE_DICT"
FORMAT_VERSION = 1
STATE_FILE = "train_state.json"
PARAM_GROUPS_FILE = "optimizer_param_groups.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupt or made for another model."""


# What reading a checkpoint can raise. DCP's CheckpointException derives from BaseException, not Exception.
LOAD_ERRORS = (Exception, CheckpointException)


def error_summary(err: BaseException, limit: int = 400) -> str:
    """The telling part of a load error: DCP wraps the per-rank causes, state_dict loading lists them."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    for cause in getattr(err, "failures", {}).values():  # CheckpointException: {rank: exception}
        text = f"{type(cause).__name__}: {cause}"
        break
    text = text or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class TrainProgress:
    """Where training stands: the next sample to train on is `samples_consumed` into epoch `epoch`."""

    epoch: int = 1
    samples_consumed: int = 0  # of this epoch's (padded, shuffled) sample order, summed over ranks
    global_step: int = 0
    best_val_loss: float | None = None
    # The epoch's statistics so far (utils.train_utils.StepLog totals) and training seconds, so that a
    # resumed epoch reports the same train_loss as an uninterrupted one.
    epoch_totals: list[float] | None = None
    epoch_train_seconds: float = 0.0


# --------------------------------------------------------------------------------------------------------
# Finding checkpoints
# --------------------------------------------------------------------------------------------------------


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def complete_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints under output_dir, oldest first (temporary folders of unfinished saves ignored)."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(root, name, STATE_FILE)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return [path for _, path in sorted(found)]


def resolve_resume_path(resume: str, output_dir: str) -> str | None:
    """`--resume`: 'false' -> None; 'true' -> the newest complete checkpoint (None if there is none);
    otherwise a checkpoint folder or a full-model .pt file, which must exist."""
    if resume.lower() == "false":
        return None
    if resume.lower() == "true":
        found = complete_checkpoints(output_dir)
        if not found:
            get_logger().warning("--resume true: no complete checkpoint in %s; starting from scratch", output_dir)
            return None
        return found[-1]
    if not os.path.exists(resume):
        raise CheckpointError(
            f"--resume {resume!r}: no such checkpoint folder or .pt file. Use --resume true for the newest "
            f"checkpoint in output_dir, or a folder such as {checkpoint_root(output_dir)}/step_00000100"
        )
    if os.path.isdir(resume) and not os.path.isfile(os.path.join(resume, STATE_FILE)):
        raise CheckpointError(
            f"--resume {resume!r} has no {STATE_FILE}: it is not a complete checkpoint (a save interrupted "
            "before it finished?). Resume from an older one."
        )
    return resume


# --------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------


def _tensor_only_optimizer_state(optim_state: dict) -> dict:
    """{param name: {exp_avg, exp_avg_sq, step}}: the tensors of the optimizer state, for DCP."""
    return {name: dict(values) for name, values in optim_state["state"].items()}


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)


def save_training_checkpoint(
    *,
    output_dir: str,
    checkpoint_type: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler,
    progress: TrainProgress,
    model_config,
    tokenizer,
    save_optimizer: bool,
    keep_last_n: int,
    info: DistInfo,
) -> str:
    """Write a checkpoint of the current state. Collective: every rank must call it."""
    started = time.perf_counter()
    root = checkpoint_root(output_dir)
    name = f"step_{progress.global_step:08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp_{name}")
    if info.is_main:
        if os.path.exists(tmp):  # left by a save that crashed
            shutil.rmtree(tmp)
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    # Full optimizer state and full model only when asked: for FULL_STATE_DICT they are gathered on rank 0.
    full = checkpoint_type == FULL
    # On a CPU group the tensors already are in host memory and cpu_offload crashes FSDP1 (PITFALLS item 1).
    options = StateDictOptions(full_state_dict=full, cpu_offload=full and info.device.type == "cuda")
    model_state, optim_state = get_state_dict(model, optimizer, options=options)  # collective
    if full:
        if info.is_main:
            torch.save(model_state, os.path.join(tmp, "model.pt"))
            if save_optimizer:
                torch.save(_tensor_only_optimizer_state(optim_state), os.path.join(tmp, "optimizer.pt"))
    else:
        payload = {"model": model_state}
        if save_optimizer:
            payload["optim"] = _tensor_only_optimizer_state(optim_state)
        dcp.save(payload, checkpoint_id=tmp)  # collective; each rank writes its own shards
    torch.save(_rng_state(info.device), os.path.join(tmp, "rng", f"rank_{info.rank}.pt"))
    if info.is_main:
        if save_optimizer:
            _write_json(os.path.join(tmp, PARAM_GROUPS_FILE), optim_state["param_groups"])
        model_config.save_pretrained(tmp)
        tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
    dist.barrier()  # every rank's files are on disk
    if info.is_main:
        _write_json(
            os.path.join(tmp, STATE_FILE),
            {
                "format_version": FORMAT_VERSION,
                "checkpoint_type": checkpoint_type,
                "has_optimizer": save_optimizer,
                "world_size": info.world_size,
                "progress": asdict(progress),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
            },
        )
        if os.path.exists(final):  # the same step saved again (e.g. SIGTERM right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        get_logger().info(
            "checkpoint %s (%s): %.1f MB in %.2f s",
            final,
            checkpoint_type,
            _folder_bytes(final) / 1e6,
            time.perf_counter() - started,
        )
        _prune(root, keep_last_n, output_dir)
    dist.barrier()
    return final


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _prune(root: str, keep_last_n: int, output_dir: str) -> None:
    """Delete all but the newest keep_last_n complete checkpoints (only after a new one is complete)."""
    for old in complete_checkpoints(output_dir)[:-keep_last_n]:
        shutil.rmtree(old)
        get_logger().info("removed old checkpoint %s (keep_last_n=%d)", old, keep_last_n)


# --------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata file, refusing any class that is not part of DCP's metadata."""

    ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module, name):
        if module in self.ALLOWED_MODULES or (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name} from a checkpoint's metadata")


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader, with the .metadata pickle read by _DcpMetadataUnpickler."""

    def read_metadata(self, *args, **kwargs):
        path = os.path.join(self.path, ".metadata")
        with open(path, "rb") as f:
            metadata = _DcpMetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        pickled = [key for key, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)]
        if pickled:
            raise pickle.UnpicklingError(f"checkpoint holds pickled objects ({pickled[:3]}...); refusing to load")
        return metadata


def read_train_state(path: str) -> dict:
    try:
        with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
            state = json.load(f)
        if state.get("format_version") != FORMAT_VERSION or state.get("checkpoint_type") not in (FULL, SHARDED):
            raise ValueError(f"unknown format {state.get('format_version')!r}/{state.get('checkpoint_type')!r}")
        TrainProgress(**state["progress"])
        return state
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path} is unreadable ({err}): corrupt or not a checkpoint") from None


def _param_groups_from_json(groups: list[dict]) -> list[dict]:
    # JSON turned tuples (AdamW's betas) into lists.
    return [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in groups]


def load_full_model_weights(model: nn.Module, path: str) -> None:
    """A full state dict (.pt) into the *unwrapped* model, before FSDP wraps it. Strict: every key must match."""
    file = os.path.join(path, "model.pt") if os.path.isdir(path) else path
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
        model.load_state_dict(state, strict=True)
    except LOAD_ERRORS as err:  # any failure means this file cannot seed this model
        raise CheckpointError(
            f"cannot load model weights from {file}: {error_summary(err)}. It is corrupt or was saved from "
            "another model shape; pick another checkpoint or --model_name."
        ) from None


def load_training_state(
    path: str,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler,
    info: DistInfo,
) -> TrainProgress:
    """Restore a checkpoint into the wrapped model and optimizer, scheduler, scaler and RNG. Collective.

    For FULL_STATE_DICT checkpoints the model weights were already loaded before wrapping
    (load_full_model_weights); this restores the rest.
    """
    state = read_train_state(path)
    try:
        _load_model_and_optimizer(path, state, model, optimizer, info)
    except LOAD_ERRORS as err:  # every failure becomes one message naming the checkpoint
        raise CheckpointError(
            f"cannot resume from {path}: {error_summary(err)}. The checkpoint is corrupt or was written for "
            "another model or optimizer; resume from another checkpoint (--resume PATH) or start a new "
            "output_dir."
        ) from None
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    _restore_rng(path, state, info)
    return TrainProgress(**state["progress"])


def _load_model_and_optimizer(path: str, state: dict, model, optimizer, info: DistInfo) -> None:
    full = state["checkpoint_type"] == FULL
    has_optimizer = state["has_optimizer"]
    # Templates with this run's sharding: DCP loads into them in place, resharding as needed.
    model_state, optim_state = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=False)
    )
    if full:
        # The weights were loaded into the unwrapped model before wrapping (load_full_model_weights).
        if has_optimizer:
            tensors = torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", weights_only=True)
            optim_state = {"state": tensors}
    else:
        payload = {"model": model_state}
        if has_optimizer:
            payload["optim"] = _tensor_only_optimizer_state(optim_state)
        dcp.load(payload, storage_reader=SafeFileSystemReader(path))  # collective
        set_model_state_dict(model, payload["model"])
        if has_optimizer:
            optim_state = {"state": payload["optim"]}
    if not has_optimizer:
        get_logger().warning("checkpoint %s has no optimizer state: AdamW starts afresh", path)
        return
    with open(os.path.join(path, PARAM_GROUPS_FILE), encoding="utf-8") as f:
        optim_state["param_groups"] = _param_groups_from_json(json.load(f))
    set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=full))


def _restore_rng(path: str, state: dict, info: DistInfo) -> None:
    file = os.path.join(path, "rng", f"rank_{info.rank}.pt")
    if state["world_size"] != info.world_size or not os.path.isfile(file):
        get_logger().warning(
            "checkpoint was written by %d ranks, this run has %d: dropout's random stream restarts, so "
            "losses continue statistically, not bit for bit",
            state["world_size"],
            info.world_size,
        )
        return
    rng = torch.load(file, map_location="cpu", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and info.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], info.device)
