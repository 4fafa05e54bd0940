"""What only GPUs run, pinned where no GPU is: the process group's backend for each configuration, and what
the hang report makes of it. (The bf16 choice for each GPU generation: tests/test_fsdp_numerics.py; host
syncs in a step: tests/test_host_syncs.py.)"""

import pytest
import torch
import torch.distributed as dist

from utils.distributed import hang_report, process_group


@pytest.mark.parametrize(
    "device, cpu_offload, expected",
    [("cpu", False, "gloo"), ("cpu", True, "gloo"), ("cuda", False, "nccl"), ("cuda", True, "cuda:nccl,cpu:gloo")],
)
def test_each_configuration_gets_its_backend(device, cpu_offload, expected):
    """FSDP2 with CPU offload keeps gradients in host memory and all-reduces their norm there: a group of NCCL
    alone has no backend for CPU tensors."""
    assert process_group.group_backend(torch.device(device), cpu_offload) == expected


@pytest.mark.parametrize("backend, expected", [("nccl", "nccl"), ("cuda:nccl,cpu:gloo", "nccl"), ("gloo", "gloo")])
def test_the_hang_report_sees_nccl_beside_a_cpu_backend(tmp_path, backend, expected):
    assert hang_report.device_backend(dist.Backend(backend)) == expected
    environ: dict[str, str] = {}
    hang_report.record_collectives(str(tmp_path), backend, environ)
    assert (tmp_path / "hang_reports").is_dir() == (expected == "nccl")  # where NCCL's watchdog writes its dump


def test_cuda_gets_expandable_segments_unless_the_user_set_the_allocator():
    environ: dict[str, str] = {}
    process_group.expandable_segments(environ)
    assert environ == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        environ = {name: "max_split_size_mb:128"}
        process_group.expandable_segments(environ)
        assert environ == {name: "max_split_size_mb:128"}  # the user's, untouched
