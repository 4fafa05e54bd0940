"""The private torch APIs of policies/private_api.py still exist and behave as the package relies on: a torch
upgrade that changes one fails here, naming it (each helper's docstring names the public replacement)."""

import datetime
import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import ShardingStrategy

from configs.paths import REPO_ROOT
from policies import private_api


def test_checkpoint_wrapper_wraps_a_module_and_names_what_it_wraps():
    inner = nn.Linear(2, 2)
    wrapped = private_api.checkpoint_wrapper(inner, checkpoint_impl=private_api.CheckpointImpl.NO_REENTRANT)
    assert private_api.wrapped_module(wrapped) is inner
    assert private_api.wrapped_module(inner) is inner
    # The wrapper keeps the state dict names of what it wraps (FSDP units and checkpoints rely on it).
    assert set(wrapped.state_dict()) == {"weight", "bias"}
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    private_api.apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, nn.Linear))
    assert private_api.wrapped_module(model[0]) is not model[0] and set(model.state_dict()) == {
        "0.weight",
        "0.bias",
    }


def test_sharded_tensor_internals_keep_their_names_and_arguments():
    build = inspect.signature(private_api.ShardedTensor._init_from_local_shards_and_global_metadata)
    assert list(build.parameters)[:3] == ["local_shards", "sharded_tensor_metadata", "process_group"], build
    assert {"tensor", "metadata"} <= set(inspect.signature(private_api.Shard).parameters)
    assert "_process_group" in inspect.getsource(private_api.ShardedTensor.__init__)


def test_consolidation_and_dtensor_offsets_keep_their_arguments():
    consolidate = inspect.signature(private_api.consolidate_safetensors_files_on_every_rank)
    assert list(consolidate.parameters)[:3] == ["input_dir", "output_dir", "fqn_to_index_mapping"], consolidate
    offsets = inspect.signature(private_api.compute_local_shape_and_global_offset)
    assert list(offsets.parameters)[:3] == ["global_shape", "mesh", "placements"], offsets


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_fused_adamw_skips_the_step_that_found_inf_flags(found_inf):
    parameter = nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([parameter], lr=0.1, fused=True)
    parameter.grad = torch.ones(4)
    private_api.skip_next_step_if(optimizer, torch.tensor(found_inf))
    optimizer.step()
    state = optimizer.state[parameter]
    assert torch.equal(parameter.detach(), torch.ones(4)) == bool(found_inf), parameter
    assert float(state["step"]) == (0.0 if found_inf else 1.0), state["step"]


def test_a_views_base_is_the_tensor_it_was_made_from():
    tensor = torch.zeros(4, 4)
    assert private_api.view_base(tensor[1:]) is tensor
    assert private_api.view_base(tensor) is tensor


def test_a_storages_identity_is_shared_by_its_views_and_fake_tensors_have_one():
    tensor, other = torch.zeros(4, 4), torch.zeros(4, 4)
    assert private_api.storage_identity(tensor[1:]) == private_api.storage_identity(tensor)
    assert private_api.storage_identity(other) != private_api.storage_identity(tensor)
    with private_api.FakeTensorMode():
        huge = torch.empty(2**40, dtype=torch.uint8)  # a terabyte, with no memory behind it
        fake = [huge, huge[1:], torch.empty(3)]
        assert huge.untyped_storage().nbytes() == 2**40 and huge.untyped_storage().data_ptr() == 0
    assert len({private_api.storage_identity(t) for t in fake}) == 2


def test_fsdp1_units_have_the_unsharded_flat_parameter_the_memory_script_reads():
    from torch.distributed.fsdp._flat_param import FlatParameter

    assert "_full_param_padded" in inspect.getsource(FlatParameter)


def test_cuda_memory_history_and_snapshot_keep_their_arguments():
    """utils/observe/profiler.py records and dumps CUDA memory history through these (CUDA only: the
    arguments are checked here, the calls on a GPU)."""
    record = inspect.signature(torch.cuda.memory._record_memory_history)
    assert {"enabled", "context", "max_entries"} <= set(record.parameters), record
    assert list(inspect.signature(torch.cuda.memory._dump_snapshot).parameters)[:1] == ["filename"]


def test_the_flight_recorder_lists_this_process_collectives():
    """What a hang report reads (utils/distributed/hang_report.py): each collective's name, sequence number,
    sizes, state, creation time, process group and timeout, the newest last."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(3, 2))
        entries = private_api.flight_recorder_dump("gloo")["entries"]
    finally:
        dist.destroy_process_group()
    newest = max(entries, key=lambda entry: entry["record_id"])
    assert newest["profiling_name"] == "gloo:all_reduce" and newest["input_sizes"] == [[3, 2]], newest
    assert newest["process_group"][1] == "default_pg" and newest["timeout_ms"] > 0, newest
    assert {"collective_seq_id", "input_dtypes", "state", "time_created_ns", "thread_name"} <= set(newest), newest


def test_the_default_store_is_the_one_the_group_met_through():
    """What utils/distributed/progress_bounded.py waits on: the group's store, with the timeout it is given."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        found = private_api.default_store()
        keys = store.num_keys()
        found.set("written through the group's store", "1")  # under the group's prefix
        assert store.num_keys() == keys + 1 and found.get("written through the group's store") == b"1"
        found.set_timeout(datetime.timedelta(seconds=42))  # utils/distributed/process_group.py: init_distributed
        assert private_api.default_store().timeout == datetime.timedelta(seconds=42)
    finally:
        dist.destroy_process_group()


def test_the_underscored_sharding_strategy_is_still_in_the_public_enum():
    assert ShardingStrategy["_HYBRID_SHARD_ZERO2"] is ShardingStrategy._HYBRID_SHARD_ZERO2


def test_no_private_torch_or_transformers_api_outside_the_module():
    """Every `torch.*._private` import, and the private attributes the module wraps, appear only there."""
    private_import = re.compile(r"^\s*(from|import) (torch|transformers)\S*\._\w", re.M)
    private_names = re.compile(
        r"(?<!self)\._(process_group|handle|base|checkpoint_wrapped_module|init_from_local_shards|full_param_padded"
        r"|record_memory_history|dump_snapshot)\b"
        r"|\.found_inf\b|_raise_exceptions_for_missing_entries|_dump_fr_trace|_dump_nccl_trace|_get_default_store"
    )
    offenders = []
    for folder in ("configs", "policies", "utils", "scripts", "T5_training.py", "summarization_dataset.py"):
        root = REPO_ROOT / folder
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            if path == Path(private_api.__file__):
                continue
            text = path.read_text(encoding="utf-8")
            offenders += [
                f"{path.relative_to(REPO_ROOT)}: {m.group(0).strip()}" for m in private_import.finditer(text)
            ]
            offenders += [f"{path.relative_to(REPO_ROOT)}: {m.group(0)}" for m in private_names.finditer(text)]
    assert not offenders, offenders


def test_onednns_bf16_check_answers_for_this_cpu():
    native = private_api.cpu_has_native_bf16()
    assert isinstance(native, bool)
    if torch.cpu._is_avx2_supported() and not torch.cpu._is_avx512_supported():
        assert not native  # oneDNN's bf16 kernels need AVX512 on x86


def test_the_fsdp_internals_that_keep_units_gathered_keep_their_names():
    """Generation's kept gathers (tests/test_generation_gathers.py runs them): FSDP1's handle strategies and
    the reshard steps, the flat parameter's sizes; FSDP2's post-forward setting of each parameter group."""
    from torch.distributed.fsdp._flat_param import FlatParameter, FlatParamHandle, HandleShardingStrategy
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert {"SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2", "FULL_SHARD", "HYBRID_SHARD"} <= set(
        HandleShardingStrategy.__members__
    )
    assert {"reshard", "post_reshard", "uses_sharded_strategy"} <= set(dir(FlatParamHandle))
    assert "_prefetched" in inspect.getsource(FlatParamHandle.__init__)
    assert "_unpadded_unsharded_size" in inspect.getsource(FlatParameter)
    assert "self.post_forward_mesh_info" in inspect.getsource(FSDPParamGroup.__init__)
    assert "_fsdp_param_group" in inspect.getsource(FSDPState)  # one group, or a list of them in torch 2.13


def test_a_dispatch_mode_sees_every_op_with_its_arguments():
    seen = []

    class Record(private_api.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func.overloadpacket.__name__, len(args)))
            return func(*args, **(kwargs or {}))

    with Record():
        torch.ones(2).sum().item()
    assert seen == [("ones", 1), ("sum", 1), ("_local_scalar_dense", 1)], seen


def test_the_profilers_allocation_events_are_every_allocation_and_free():
    """scripts/loss_memory.py's CPU peak: a 4,000-byte tensor allocated then freed inside a memory-profiling
    profiler appears as +4000 then -4000, in that order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        tensor = torch.empty(1000)
        del tensor
    sizes = [size for _, size in private_api.profiled_allocations(prof)]
    assert sizes[sizes.index(4000) + 1 :].count(-4000) >= 1, sizes


def test_compiled_graphs_counts_each_graph_compiled():
    """The epoch records' compiled_graphs: one more for a new function compiled, none for its second call."""
    before = private_api.compiled_graphs()
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    compiled(torch.ones(3))
    compiled(torch.ones(3))
    assert private_api.compiled_graphs() - before == 1
