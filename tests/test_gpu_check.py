"""scripts/gpu_check.py at tiny scale on 2 CPU ranks: every check that does not need CUDA passes, the others
say they were skipped, and a check that breaks is reported, not raised."""

import re

import pytest

from scripts import gpu_check
from tests.dist_harness import one_process_group, run_ranks


def checks_worker(rank: int, world_size: int, folder: str, break_one: bool) -> dict:
    original = gpu_check.check_bf16
    if break_one:  # a check that raises is a finding; the next checks still run
        gpu_check.check_bf16 = lambda device: 1 / 0
    try:
        return gpu_check.run_checks(gpu_check.torch.device("cpu"), str(gpu_check.EMBEDDED_MODEL_DIR), folder)
    finally:
        gpu_check.check_bf16 = original


@pytest.mark.slow  # the whole check at tiny scale (3-4 s); the fast subset keeps its one-rank comparison
def test_the_gpu_check_runs_its_cpu_checks_at_tiny_scale(tmp_path, capfd):
    findings = run_ranks(checks_worker, str(tmp_path), False)[0]
    statuses = {name: check["status"] for name, check in findings.items()}
    assert statuses == {
        "backends": "ok", "bf16 choice": "ok", "CPU offload": "skipped", "host syncs, sdpa": "skipped",
        "host syncs, t5_flex": "skipped", "t5_flex against sdpa": "skipped", "one rank without FSDP": "skipped",
        "sharded save and load": "ok", "generation's all-gathers": "ok",
    }, findings  # fmt: skip
    assert "backend gloo, cpu all-reduce 2" in findings["backends"]["found"]
    assert (
        "policy fp32_policy" in findings["bf16 choice"]["found"] or "bfSixteen" in findings["bf16 choice"]["found"]
    )
    assert "loaded equal: True" in findings["sharded save and load"]["found"]
    gathers = re.search(
        r"for 8 tokens: (\d+), kept gathered (\d+); same: True", findings["generation's all-gathers"]["found"]
    )
    assert gathers and int(gathers[1]) > int(gathers[2]) > 0, findings  # kept: each unit's first gather only
    broken = run_ranks(checks_worker, str(tmp_path / "again"), True)[0]
    assert broken["bf16 choice"] == {**broken["bf16 choice"], "status": "FAILED"}
    assert broken["bf16 choice"]["found"].startswith("ZeroDivisionError")
    assert broken["sharded save and load"]["status"] == "ok"


def test_the_one_rank_check_compares_the_losses_and_counts_the_attention_kernels_of_each_form():
    with one_process_group():
        status, found = gpu_check.check_single_rank(
            str(gpu_check.EMBEDDED_MODEL_DIR), gpu_check.torch.device("cpu")
        )
    assert status == "ok", found
    # Both forms ran their forward and checkpointed backward through a kernel of SDPA (CPU's own here).
    counts = re.findall(r"(FSDP1|no FSDP): loss [\d.]+, SDPA kernels \{'(\w+)': (\d+)", found)
    assert [form for form, _, _ in counts] == ["FSDP1", "no FSDP"] and all(int(n) > 0 for _, _, n in counts), found
