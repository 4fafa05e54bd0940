"""The uninterrupted 2-rank run that the checkpoint tests compare with: the embedded tiny T5 and sample,
2 epochs of 12 steps, fp32, ROUGE on, SHARDED_STATE_DICT checkpoints every 5 steps and at the epoch ends
(keep_last_n 2 leaves steps 20 and 24). tests/conftest.py trains it once per session (`reference`).

Also the same run with one rank SIGKILLed under torchrun --max_restarts 1 (`restart_run`), which must end
as the reference did: tests/test_resume.py runs each case once, tests/soak_restarts.py many times."""

import json
import math
import re
from pathlib import Path

import pytest

from tests.launch import RESTARTING, Background, Run, pooled
from utils.distributed.process_group import free_port

SHARDED = "SHARDED_STATE_DICT"
FULL = "FULL_STATE_DICT"

NPROC = 2
EPOCHS = 2
NUM_TRAIN = 96
NUM_VAL = 24
BATCH = 4  # the default --batch_size_training
SAVE_EVERY = 5
STEPS_PER_EPOCH = math.ceil(math.ceil(NUM_TRAIN / NPROC) / BATCH)  # 12
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH  # 24
SMALL_RUN = [
    "--epochs",
    str(EPOCHS),
    "--num_train_samples",
    str(NUM_TRAIN),
    "--num_val_samples",
    str(NUM_VAL),
    "--eval_num_samples",  # ROUGE on: evaluation must not disturb the training's random streams
    "8",
    "--max_new_tokens",  # short summaries (the untrained tiny model writes to the limit): 0.7 s less per ROUGE
    "16",
    "--mixed_precision",
    "false",
    "--save_every_n_steps",
    str(SAVE_EVERY),
    "--log_every_n_steps",
    "1",
]


def logged_steps(output_dir: Path) -> list[int]:
    """Step numbers of metrics.jsonl in file order (duplicates kept)."""
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if record.get("type") == "step":
            steps.append(record["step"])
    return steps


def read_records(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            pytest.fail(f"{path} line {number} is not JSON ({err}): {line!r}")
    return records


def step_lrs(output_dir: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_records(output_dir) if r["type"] == "step"}


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / "checkpoints" / f"step_{step:08d}"


def complete_checkpoint_steps(output_dir: Path) -> list[int]:
    root = output_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(
        int(p.name[len("step_") :])
        for p in root.iterdir()
        if re.fullmatch(r"step_\d{8}", p.name) and (p / "train_state.json").is_file()
    )


def train_reference(output_dir: Path) -> Path:
    """Train the reference run into output_dir (which must not exist yet) and check its shape."""
    run = pooled([*SMALL_RUN, "--checkpoint_type", SHARDED, "--output_dir", str(output_dir)])
    assert run.returncode == 0, run.describe()
    assert logged_steps(output_dir) == list(range(1, TOTAL_STEPS + 1))
    # keep_last_n=2 (default): the periodic step 20 and the end of epoch 2.
    assert complete_checkpoint_steps(output_dir) == [20, TOTAL_STEPS], run.describe()
    return output_dir


# ------------------------------------------------------- torchrun --max_restarts: a killed rank, a restart
KILL_STEP = 7  # after the checkpoint of step 5: the restart continues from it, redoing steps 6 and 7
RESTART_TIMEOUT_S = 240
# Rank 0 (which writes the shared files) dies in one case, rank 1 in the other. FSDP2's resume from its shards
# is tested without a restart (tests/test_fsdp2.py: across backends; tests/test_lora.py).
RESTART_CASES = {  # case: (checkpoint type, FSDP version, rank killed, torchrun agents ("nodes"))
    "fsdp1-full": (FULL, 1, 0, 1),
    "two-agents-c10d": (SHARDED, 1, 1, 2),
}


def restart_run(output_dir: Path, case: str) -> tuple[list[Run], bool]:
    """The reference run with rank `kill_rank` SIGKILLed after its KILL_STEP-th step (tests/restart_entry.py),
    under torchrun --max_restarts 1: one agent with --standalone, or two agents of one rank each with c10d
    rendezvous on 127.0.0.1 and a store per attempt (as the README's multi-node line). Returns each agent's
    run and whether the kill happened. output_dir's parent must exist (the logs go there)."""
    checkpoint_type, fsdp_version, kill_rank, agents = RESTART_CASES[case]
    args = [*SMALL_RUN, "--checkpoint_type", checkpoint_type, "--fsdp_version", str(fsdp_version),
            "--dist_timeout_s", "60", "--output_dir", str(output_dir)]  # fmt: skip
    marker = output_dir.parent / "killed"
    env = {"KILL_RANK": str(kill_rank), "KILL_STEP": str(KILL_STEP), "KILL_MARKER": str(marker)}
    if agents == 1:
        launcher = ["--standalone", *RESTARTING]
    else:
        port = free_port()
        launcher = ["--nnodes", str(agents), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
                    "--rdzv_id", f"restart-{port}", *RESTARTING]  # fmt: skip
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    started = [
        Background(
            args, output_dir.parent / f"agent{index}.log", NPROC // agents, "tests/restart_entry.py", launcher, env
        )  # fmt: skip
        for index in range(agents)
    ]
    try:
        return [agent.finish(RESTART_TIMEOUT_S) for agent in started], marker.exists()
    finally:  # one agent's timeout must not leave the other running
        for agent in started:
            if agent.proc.poll() is None:
                agent.kill()
