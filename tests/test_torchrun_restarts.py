"""What a torchrun restart decides before any process group exists: which job and attempt this is, whether
the launch can restart at all, and where a restarted attempt starts from (the runs themselves are in
tests/test_resume.py: a SIGKILLed rank under --max_restarts 1)."""

import json
import os
import time

import pytest
import torch

from configs.errors import CheckpointError, ConfigError
from tests.dist_harness import run_ranks
from utils.base import layout
from utils.checkpoint.start import resolve_start
from utils.distributed.process_group import agent_process, check_local_rank, check_restarts, torchrun_attempt

AGENT = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "localhost", "MASTER_PORT": "29400"}


def test_the_launch_is_its_rendezvous_id_or_store_address_and_its_agent():
    assert torchrun_attempt({}) == (None, 0)  # a plain `python T5_training.py`
    job7 = {**AGENT, "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert torchrun_attempt(job7, agent="41/900") == ("job7 agent 41/900", 2)
    assert torchrun_attempt({**AGENT, "TORCHELASTIC_RUN_ID": "none"}, agent="41/900") == (
        "none@localhost:29400 agent 41/900",
        0,
    )
    no_store = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert torchrun_attempt({**no_store, "TORCHELASTIC_RESTART_COUNT": "1"}) == (None, 1)
    # A later launch with the same id (or port) has another agent process: another launch.
    assert (
        torchrun_attempt(job7)[0] == f"job7 agent {agent_process()}" != torchrun_attempt(job7, agent="41/900")[0]
    )
    pid, start_time = agent_process().split("/")
    assert int(pid) == os.getppid() and int(start_time) > 0


def test_a_world_without_each_processs_local_rank_is_refused():
    """A hand-made environment (srun, mpirun) with WORLD_SIZE but no LOCAL_RANK: every rank would take GPU 0."""
    with pytest.raises(ConfigError, match="WORLD_SIZE is 16 and LOCAL_RANK is not set: launch with torchrun"):
        check_local_rank({"WORLD_SIZE": "16", "RANK": "9"})
    check_local_rank({"WORLD_SIZE": "16", "RANK": "9", "LOCAL_RANK": "1"})
    check_local_rank({})  # a plain `python T5_training.py`: a world of one


def test_restarts_on_several_nodes_need_a_store_per_attempt():
    several = {**AGENT, "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_MAX_RESTARTS": "3", "GROUP_WORLD_SIZE": "2"}
    with pytest.raises(ConfigError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_restarts(several)
    check_restarts({**several, "TORCHELASTIC_USE_AGENT_STORE": "False"})  # a new store per attempt
    check_restarts({**several, "GROUP_WORLD_SIZE": "1"})  # one node: the attempt prefix keeps them apart
    check_restarts({**several, "TORCHELASTIC_MAX_RESTARTS": "0"})


def test_restarts_without_a_job_to_recognise_are_refused():
    # Rendezvous id "none" (no --rdzv_id) and no shared store: nothing tells a restart of this run from a new one.
    no_id = {
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_MAX_RESTARTS": "2",
    }
    with pytest.raises(ConfigError, match="--rdzv_id NAME"):
        check_restarts(no_id)
    check_restarts({**no_id, "TORCHELASTIC_RUN_ID": "job7"})
    check_restarts({**no_id, "TORCHELASTIC_MAX_RESTARTS": "0"})


def _started_run(output_dir, job: str, steps: list[int]) -> None:
    """An output_dir as a run of torchrun job `job` leaves it: its record, metrics and checkpoints."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / layout.CONFIG_FILE).write_text(json.dumps({"torchrun_job": job}))
    (output_dir / layout.METRICS_FILE).write_text("{}\n")
    for step in steps:
        folder = output_dir / layout.CHECKPOINTS_DIR / layout.step_dir_name(step)
        folder.mkdir(parents=True)
        state = {"format_version": layout.FORMAT_VERSION, "checkpoint_type": layout.FULL, "progress": {},
                 "files": {}}  # fmt: skip
        (folder / layout.STATE_FILE).write_text(json.dumps(state))


def test_a_restart_of_the_job_continues_from_its_newest_checkpoint(tmp_path):
    _started_run(tmp_path, "job7", [5, 10])
    start = resolve_start("false", str(tmp_path), job="job7", attempt=1)
    assert start.path == str(tmp_path / "checkpoints" / "step_00000010") and start.is_checkpoint


def test_a_restart_before_any_checkpoint_starts_as_the_first_attempt_did(tmp_path):
    """Afresh, or from the weights of the .pt --resume names (not from the base model: the run would silently
    start over), or from the checkpoint it names outside output_dir."""
    output_dir = tmp_path / "run"
    _started_run(output_dir, "job7", [])
    start = resolve_start("false", str(output_dir), job="job7", attempt=1)
    assert start.path is None and not start.is_checkpoint
    weights = tmp_path / "T5-model-1.pt"
    weights.write_bytes(b"")
    start = resolve_start(str(weights), str(output_dir), job="job7", attempt=1)
    assert start.path == str(weights) and not start.is_checkpoint
    with pytest.raises(ConfigError, match="already holds a run"):  # the control: a first attempt is refused
        resolve_start(str(weights), str(output_dir), job="job7", attempt=0)
    _started_run(tmp_path / "other", "job6", [4])
    elsewhere = str(tmp_path / "other" / "checkpoints" / "step_00000004")
    start = resolve_start(elsewhere, str(output_dir), job="job7", attempt=1)
    assert start.path == elsewhere and start.is_checkpoint


def test_a_restart_of_another_job_decides_as_its_first_attempt_did(tmp_path):
    # The first attempt was refused (an older run is there): every attempt is, with the same message, and
    # the older run is not continued.
    _started_run(tmp_path, "an-older-job", [5])
    for attempt in (0, 1):
        with pytest.raises(ConfigError, match="already holds a run"):
            resolve_start("false", str(tmp_path), job="job7", attempt=attempt)


def test_a_resume_path_that_does_not_exist_is_refused_with_the_forms_that_work(tmp_path):
    missing = tmp_path / "nonexistent" / "step_00000005"
    with pytest.raises(CheckpointError, match="no such checkpoint") as refused:
        resolve_start(str(missing), str(tmp_path / "out"))
    assert str(missing) in str(refused.value) and "--resume true" in str(refused.value)


def _group_attempt_worker(rank: int, world_size: int) -> int:
    from utils.distributed.process_group import group_attempt

    return group_attempt([1, 0][rank], torch.device("cpu"))  # only rank 0's node counted a restart


def test_the_attempt_is_the_highest_restart_count_of_any_rank():
    assert run_ranks(_group_attempt_worker, world_size=2, timeout_s=60) == [1, 1]


def test_a_group_that_does_not_form_fails_within_the_timeout_with_one_message(monkeypatch):
    """Rank 0 of 2, and rank 1 never comes (died or hangs before joining, as in a restart that cannot form):
    init_distributed gives up after --dist_timeout_s with a message that says so."""
    from utils.distributed.process_group import DistInfo, GroupNotFormed, free_port, init_distributed

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    start = time.monotonic()
    with pytest.raises(GroupNotFormed, match=r"of 2 ranks did not form within 1 s \(--dist_timeout_s\)"):
        init_distributed(DistInfo(0, 0, 2, torch.device("cpu"), "gloo"), timeout_s=1)
    assert time.monotonic() - start < 10
