"""Every private torch API this package uses, in one place, each with the public API that would replace it.

A torch upgrade may change any of these without notice; tests/test_private_api.py checks each one's name,
signature or behaviour, so a change fails there, naming it, rather than deep in a run. It sits in `policies`,
the lowest package that needs one (activation checkpointing), so that every package above can import it.

Not here, on purpose: `ShardingStrategy._HYBRID_SHARD_ZERO2` is a member of the public enum, documented in
FSDP1's API reference despite its underscore (users spell it on the command line); the test checks it too.
"""

import contextlib
import json

import torch
from torch import nn

# Tensors with a shape, a dtype and a device but no memory, on which a model's real forward runs
# (scripts/estimate_memory.py counts what autograd keeps at any size). Public replacement: none; the meta
# device runs the same ops but cannot answer the data-dependent checks transformers' forwards make.
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401 - re-exported

# FSDP1's sharded state dicts are made of ShardedTensors (torch.distributed._shard). Public replacement:
# FSDP2's DTensor (torch.distributed.tensor), which --fsdp_version 2 uses; FSDP1 itself is deprecated.
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor  # noqa: F401 - re-exported

# Activation checkpointing of whole modules, the tutorial's way (`checkpoint_wrapper` and
# `apply_activation_checkpointing`; torchtitan imports the same). Public replacement: none that wraps a module;
# `torch.utils.checkpoint.checkpoint` inside a module of one's own, which would also have to keep the state
# dict names (the wrapper strips its own prefix from them).
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: F401 - re-exported
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

# Stitching the rows every rank wrote into whole safetensors files, each rank its share of the files.
# Public replacement: HuggingFaceStorageWriter(enable_consolidation=True), where rank 0 stitches every file.
from torch.distributed.checkpoint._consolidate_hf_safetensors import (  # noqa: F401 - re-exported
    consolidate_safetensors_files_on_every_rank,
)

# Which rows of a DTensor this rank holds. Public replacement: none in torch 2.13; DCP reads the same through
# DTensor's `__create_chunk_list__` protocol.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401 - re-exported

# A mode that sees every op torch dispatches, with its arguments (scripts/gpu_check.py counts all-gathers with
# one; the tests count host reads). Public replacement: none in torch 2.13 (torch's own debugging modes, such as
# `torch.utils.flop_counter.FlopCounterMode`, are built on it).
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401, E402 - re-exported

CHECKPOINT_WRAPPED_MODULE = "_checkpoint_wrapped_module"  # checkpoint_wrapper's attribute for what it wraps
FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"  # FSDP1's attribute for what it wraps
WRAPPER_ATTRIBUTES = (FSDP_WRAPPED_MODULE, CHECKPOINT_WRAPPED_MODULE)


def state_dict_name(name: str) -> str:
    """A parameter's name (`named_parameters` of the wrapped model) as torch's state dicts spell it: without
    FSDP1's and the checkpoint wrapper's attributes. Public replacement: none (get_optimizer_state_dict
    computes it inside)."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_ATTRIBUTES)


def storage_identity(tensor: torch.Tensor) -> int:
    """The identity of the storage under `tensor`: the same for every view of it, distinct among live
    storages, also for fake tensors (whose data_ptr is 0). Public replacement: none (`data_ptr`, for tensors
    with memory, where an empty one's is 0 too)."""
    return tensor.untyped_storage()._cdata


def wrapped_module(module: nn.Module) -> nn.Module:
    """The module a checkpoint wrapper wraps, or `module` itself. Public replacement: none (above)."""
    return getattr(module, CHECKPOINT_WRAPPED_MODULE, module)


def sharded_tensor_group(tensor: ShardedTensor):
    """The process group a ShardedTensor is sharded over. Public replacement: a DTensor's `device_mesh`."""
    return tensor._process_group


def sharded_tensor_like(tensor: ShardedTensor, local_shards: list[Shard]) -> ShardedTensor:
    """A ShardedTensor laid out as `tensor` whose local shards are `local_shards`. No communication. Public
    replacement: `DTensor.from_local` (FSDP2)."""
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, tensor.metadata(), process_group=tensor._process_group
    )


def skip_next_step_if(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Fused AdamW reads `found_inf` (GradScaler's hook) and skips its step when it is 1: parameters, moments
    and step count stay as they were, on the device, without a host sync. Public replacement:
    `torch.amp.GradScaler.step(optimizer)`, which sets it from its own inf checks (fp16 runs use one)."""
    optimizer.found_inf = found_inf


def view_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a view was made from, or the tensor itself. Public replacement: none; a storage's identity
    (`untyped_storage().data_ptr()`) tells views of one storage apart from other tensors, not their base."""
    return tensor if tensor._base is None else tensor._base


def fsdp1_unsharded_flat_parameter(unit) -> torch.Tensor | None:
    """An FSDP1 unit's unsharded flat-parameter buffer, allocated or not (scripts/generation_memory.py
    measures it). Public replacement: none; FSDP2 frees unsharded parameters by itself."""
    handle = unit._handle
    return getattr(handle.flat_param, "_full_param_padded", None) if handle is not None else None


def profiled_allocations(prof: torch.profiler.profile) -> list[tuple[int, int]]:
    """(start in ns, bytes: negative for a free) of every allocation and free a memory-profiling
    `torch.profiler.profile` recorded, on any device, in their order (scripts/loss_memory.py sums them into a
    CPU peak). Public replacement: on CUDA `torch.cuda.max_memory_allocated`; on CPU none (each op's
    `cpu_memory_usage` is a net sum; `export_memory_timeline`, deprecated, rebuilds this from the same tree)."""
    from torch._C._profiler import _EventType

    events, allocations = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while events:
        event = events.pop()
        if event.tag == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.extra_fields.alloc_size))
        events.extend(event.children)
    return sorted(allocations)


def record_memory_history(max_entries: int, stacks: bool) -> None:
    """From now on the CUDA allocator records every allocation and free, with its Python and C++ stack if
    `stacks`, the newest `max_entries` kept, for `dump_memory_snapshot`. Public replacement: none in torch
    2.13; this is the function torch's guide to CUDA memory ("Understanding CUDA Memory Usage") documents."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries, context="all" if stacks else None)


def stop_memory_history() -> None:
    """Stop the recording `record_memory_history` started. Public replacement: none (above)."""
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    """The CUDA allocator's state (every segment and block) and the history recorded so far, as the pickle that
    https://pytorch.org/memory_viz draws. Public replacement: none; `torch.cuda.memory_snapshot()` returns the
    segments without the history."""
    torch.cuda.memory._dump_snapshot(path)


def flight_recorder_dump(backend: str) -> dict | None:
    """torch's flight recorder as JSON: `entries`, this process's last collectives (each with its name, e.g.
    "gloo:all_gather", `collective_seq_id`, `input_sizes`, `state`, `time_created_ns`, `process_group`,
    `timeout_ms`), and `pg_status`; no `entries` while the recorder is off (TORCH_FR_BUFFER_SIZE=0). NCCL keeps
    a recorder of its own (`_dump_nccl_trace_json`; gloo's and others' go to the generic one). None where this
    torch has no such call. No communication. Public replacement: none in torch 2.13; the dump NCCL's watchdog
    writes on a timeout (TORCH_FR_DUMP_TEMP_FILE), read with `torchfrtrace`, is NCCL's only."""
    c10d = getattr(torch._C, "_distributed_c10d", None)
    dump = getattr(c10d, "_dump_nccl_trace_json", None) if backend == "nccl" else None
    dump = dump or getattr(c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return None
    return json.loads(dump(True, False))  # every collective recorded, not only those still in flight


def default_store():
    """The key-value store of the default process group (the one its ranks met through), which its ranks may
    use to wait for each other outside a collective (utils/distributed/progress_bounded.py). Public replacement:
    none in torch 2.13; a store made by the caller and passed to init_process_group(store=...), which a torchrun
    launch without the agent's store does not have."""
    return torch.distributed.distributed_c10d._get_default_store()


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far: dynamo's own count (the one torch's tests read),
    one per graph handed to the backend, each recompile included (a new shape, a recompile to dynamic shapes).
    Public replacement: none in torch 2.13; torch._dynamo.utils.compile_times() gives seconds, not graphs."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def cpu_has_native_bf16() -> bool:
    """Does oneDNN have bf16 kernels for this CPU (AVX512 or AMX on x86, the bf16 extension on ARM)? Elsewhere
    torch emulates bf16, more slowly than it computes fp32. Public replacement: none in torch 2.13 (torch's
    inductor asks the same op); `torch.backends.cpu.get_cpu_capability()` names the vector width, not bf16."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@contextlib.contextmanager
def fsdp1_units_kept_unsharded(model: nn.Module):
    """Inside: FSDP1's units keep their parameters gathered after a forward (their handles take the strategy
    that does not reshard after forward: FULL_SHARD -> SHARD_GRAD_OP, HYBRID_SHARD -> _HYBRID_SHARD_ZERO2), so
    later forwards gather nothing; at the end each unit gets its strategy back and frees what it gathered (as
    a reshard does, but without queueing an event for the all-gather rate limiter, which would then wait on
    one event per unit for the next steps). Public replacement: FSDP2's `FSDPModule.set_reshard_after_forward`
    (FSDP1 has none)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._flat_param import HandleShardingStrategy

    keep = {
        HandleShardingStrategy.FULL_SHARD: HandleShardingStrategy.SHARD_GRAD_OP,
        HandleShardingStrategy.HYBRID_SHARD: HandleShardingStrategy._HYBRID_SHARD_ZERO2,
    }
    handles = [unit._handle for unit in FullyShardedDataParallel.fsdp_modules(model) if unit._handle]
    before = {handle: handle._sharding_strategy for handle in handles}
    for handle in handles:
        handle._sharding_strategy = keep.get(handle._sharding_strategy, handle._sharding_strategy)
    try:
        yield
    finally:
        for handle in handles:
            handle._sharding_strategy = before[handle]
            # a unit that never ran a forward has no gathered buffer to free
            if handle.uses_sharded_strategy and hasattr(handle.flat_param, "_full_param_padded"):
                handle.reshard(True)
                handle.post_reshard()
                handle._prefetched = False


def fsdp1_unsharded_numel(model: nn.Module) -> int:
    """Elements of FSDP1's model, whole (padding and replicas not counted). Public replacement: the DTensors
    of FSDP2, whose `numel()` is the whole parameter's."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = FullyShardedDataParallel.fsdp_modules(model)
    return sum(unit._handle.flat_param._unpadded_unsharded_size.numel() for unit in units if unit._handle)


@contextlib.contextmanager
def fsdp2_units_kept_unsharded(units: list[nn.Module]):
    """Inside: FSDP2's `units` (the root first) keep their parameters gathered after a forward, so later
    forwards gather nothing; at the end each unit gets its setting back and reshards. Public replacement:
    `set_reshard_after_forward` (which this calls), were there a way to read the setting it replaces."""
    groups = [group for unit in units for group in fsdp2_param_groups(unit)]
    settings = [group.post_forward_mesh_info for group in groups]
    units[0].set_reshard_after_forward(False, recurse=True)
    try:
        yield
    finally:
        for group, setting in zip(groups, settings, strict=True):
            group.post_forward_mesh_info = setting
        for unit in units:
            unit.reshard()


def fsdp2_param_groups(unit: nn.Module) -> list:
    """An FSDP2 unit's parameter groups: a list in torch 2.13 (`_fsdp_param_groups`), one group or None in
    earlier versions (`_fsdp_param_group`, torch 2.11 on the GPU machine)."""
    state = unit._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []
