"""State dicts of the sharded model and optimizer, for both FSDP backends: gathering, loading, the
tutorial's full-model .pt. Every gather here is a collective: every rank must call it (docs/pitfalls.md #3).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from configs.errors import CheckpointError
from policies.private_api import (
    Shard,
    ShardedTensor,
    compute_local_shape_and_global_offset,
    sharded_tensor_group,
    sharded_tensor_like,
    state_dict_name,
)
from utils.base.files import atomic_path, disk_bytes
from utils.base.log import get_logger
from utils.fsdp.parallelism import Parallelism
from utils.fsdp.shard import fsdp1_state_dict_warnings_ignored


@fsdp1_state_dict_warnings_ignored()
def model_and_optimizer_state(
    model: nn.Module, optimizer, full: bool, device: torch.device, parallelism: Parallelism
) -> tuple[dict, dict]:
    """Model and optimizer state dicts: full or this rank's shards. Collective. Full state is gathered unit by unit
    and, where the parallelism can (Parallelism.offloads_full_state), kept in rank 0's host memory only."""
    options = StateDictOptions(full_state_dict=full, cpu_offload=full and parallelism.offloads_full_state(device))
    return get_state_dict(model, optimizer, options=options)


@fsdp1_state_dict_warnings_ignored()
def sharded_model_state(model: nn.Module) -> dict:
    """This rank's shards of the model state dict (no gather, no optimizer). Collective."""
    return get_model_state_dict(model)


@fsdp1_state_dict_warnings_ignored()
def sharded_optimizer_template(model: nn.Module, optimizer) -> dict:
    """{param name: {state name: tensor}}: this rank's shards of the optimizer state, for a load to fill.
    Collective. The load replaces the optimizer's state whole, so its tensors are let go here: beside FSDP1's
    template (a converted copy) they would cost a model of AdamW state more."""
    template = tensor_only_optimizer_state(get_optimizer_state_dict(model, optimizer))
    for values in optimizer.state.values():
        for name, value in values.items():
            if torch.is_tensor(value) and value.dim() > 0:
                values[name] = value.new_empty(0)
    return template


def local_rows(tensor) -> tuple[torch.Tensor | None, int]:
    """This rank's block of rows of a sharded state-dict tensor (FSDP1's ShardedTensor, FSDP2's DTensor), and the
    index of its first row. Where this rank holds no rows: None for a ShardedTensor, an empty tensor for a
    DTensor. A plain tensor (FSDP1's NO_SHARD) is all its rows."""
    if isinstance(tensor, DTensor):
        if any(placement.is_shard() and placement.dim != 0 for placement in tensor.placements):
            # FSDP2 shards every parameter by rows (Shard(0)); a column block is not a row block to merge into.
            raise RuntimeError(f"expected a DTensor sharded by rows, got placements {tensor.placements}")
        _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), (offsets[0] if offsets else 0)
    if not isinstance(tensor, ShardedTensor):
        return tensor, 0
    shards = tensor.local_shards()
    if not shards:
        return None, 0
    return shards[0].tensor, shards[0].metadata.shard_offsets[0]


def with_local_rows(tensor, local: torch.Tensor):
    """A sharded tensor laid out as `tensor` (same full shape, same ranks' rows) whose part on this rank is
    `local`. No communication."""
    if isinstance(tensor, DTensor):
        layout = {"shape": tensor.shape, "stride": tensor.stride()}
        return DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False, **layout)
    if not isinstance(tensor, ShardedTensor):
        return local
    return sharded_tensor_like(tensor, [Shard(local, shard.metadata) for shard in tensor.local_shards()])


def full_tensor_everywhere(tensor, device: torch.device) -> torch.Tensor:
    """The whole of a sharded state-dict tensor on every rank, on `device` (the process group's). Collective;
    meant for small tensors (LoRA's adapters)."""
    if isinstance(tensor, DTensor):
        # With FSDP2's CPU offload the rows are in host memory while the mesh is the GPUs': gathered there.
        return with_local_rows(tensor, tensor.to_local().to(device)).full_tensor()
    if not isinstance(tensor, ShardedTensor):  # FSDP1's NO_SHARD: every rank holds it whole
        return tensor.to(device)
    # Each rank writes its rows into zeros; the sum over the shard group is the full tensor (x + 0 == x).
    local, first_row = local_rows(tensor)
    full = torch.zeros(tensor.size(), dtype=tensor.dtype, device=device)
    if local is not None:
        full[first_row : first_row + local.shape[0]] = local
    dist.all_reduce(full, group=sharded_tensor_group(tensor))
    return full


def fill_from_full(template: dict, full: dict, file: str, prefix: str = "") -> None:
    """Copy into each sharded tensor of `template` (this rank's shards, nested dicts allowed) its own rows of the
    same-named tensor of `full`: memory-mapped, each rank reads only its rows from the file. No communication.
    CheckpointError naming `file` when a name or a shape does not match."""
    for name, target in template.items():
        source = full.get(name) if isinstance(full, dict) else None
        if source is None:
            raise CheckpointError(
                f"{file} has no {prefix}{name}: it was written for another model (or another LoRA setting)"
            )
        if isinstance(target, dict):
            fill_from_full(target, source, file, f"{prefix}{name}.")
            continue
        if tuple(source.shape) != tuple(target.shape):
            raise CheckpointError(
                f"{file} holds {prefix}{name} as {list(source.shape)}, this model has {list(target.shape)}: "
                "it was written for another model shape"
            )
        local, first_row = local_rows(target)
        if local is None:
            continue
        local.copy_(source if source.dim() == 0 else source[first_row : first_row + local.shape[0]])


@fsdp1_state_dict_warnings_ignored()
def set_optimizer_state(model: nn.Module, optimizer, optim_state: dict, full: bool) -> None:
    """Load an optimizer state dict (full or sharded) into the optimizer of the wrapped model. Collective.

    This run's kernel choice goes into the loaded groups *before* loading: torch places each `step` counter by
    the loaded group's kernel (docs/pitfalls.md #31)."""
    saved_groups = optim_state.get("param_groups", [])
    decays = [group["weight_decay"] for group in optimizer.param_groups]
    # Each group takes this run's members (utils/train/optim.py), matched by position where the groups decay
    # alike, so that a checkpoint of an earlier grouping (docs/recipe.md) resumes; moments load by name.
    regroup = len(saved_groups) > 1 and [group.get("weight_decay") for group in saved_groups] == decays
    names = {id(param): state_dict_name(name) for name, param in model.named_parameters()} if regroup else {}
    for saved, group in zip(saved_groups, optimizer.param_groups, strict=True):
        saved.update(fused=group["fused"], foreach=group["foreach"])
        if regroup:
            saved["params"] = [names[id(param)] for param in group["params"]]
    set_optimizer_state_dict(model, optimizer, optim_state, options=StateDictOptions(full_state_dict=full))


def tensor_only_optimizer_state(optim_state: dict) -> dict:
    """{param name: {exp_avg, exp_avg_sq, step}}: the tensors of an optimizer state, without hyper-parameters."""
    return {name: dict(values) for name, values in optim_state["state"].items()}


def param_groups_from_json(groups: list[dict]) -> list[dict]:
    """Optimizer param groups read back from JSON, which turned tuples (AdamW's betas) into lists."""
    return [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in groups]


def save_full_model(
    model: nn.Module, parallelism: Parallelism, device: torch.device, is_main: bool, path: str
) -> str | None:
    """Gather the full state dict (collective) and save it atomically on rank 0. Returns the path there."""
    state = parallelism.full_state_dict(model, device)
    if not is_main:
        return None
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    get_logger().info("saved full model state dict: %s (%.1f MB)", path, disk_bytes(path) / 1e6)
    return path
