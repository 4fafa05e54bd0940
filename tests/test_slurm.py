"""scripts/slurm/train.sbatch without SLURM: its dry run, its refusal outside an allocation, and its signal
handling, with srun, scancel and scontrol replaced by small bash fakes on PATH."""

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time

import pytest

from configs.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "slurm" / "train.sbatch"
JOB_ID = "4242"
HOSTS = ["gpu-01", "gpu-02"]
USER_ARGS = ["--epochs", "3", "--model_name", "t5-base", "--output_dir", "/shared/my run"]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the sbatch script is a bash script")

# The fakes log what they were asked to do, one line per event, to $FAKE_SLURM_LOG/events.
FAKES = {
    # Expands the two host-list shapes the tests use: "prefix[01-02]" and "a,b".
    "scontrol": r"""#!/usr/bin/env bash
if [[ "$1 $2" == "show hostnames" ]]; then
    if [[ "$3" =~ ^(.*)\[([0-9]+)-([0-9]+)\]$ ]]; then
        prefix=${BASH_REMATCH[1]} first=${BASH_REMATCH[2]} last=${BASH_REMATCH[3]}
        for ((i = 10#$first; i <= 10#$last; i++)); do printf '%s%0*d\n' "$prefix" "${#first}" "$i"; done
    else
        tr ',' '\n' <<<"$3"
    fi
elif [[ "$1" == requeue ]]; then
    echo "scontrol requeue $2" >>"$FAKE_SLURM_LOG/events"
fi
""",
    # Like the real srun: runs the step's task and exits when it does. SIGTERM to srun itself is logged:
    # the real srun would answer it by SIGKILLing its tasks, so the batch script must never send it.
    "srun": r"""#!/usr/bin/env bash
printf '%s\n' "$@" >"$FAKE_SLURM_LOG/srun.args"
trap 'echo "srun got TERM" >>"$FAKE_SLURM_LOG/events"' TERM
fake_task &
task=$!
while kill -0 "$task" 2>/dev/null; do wait "$task" || true; done
wait "$task"
""",
    # The step's task (torchrun on a node): on SIGTERM it "saves" and exits 0, as the training does.
    "fake_task": r"""#!/usr/bin/env bash
trap 'echo "task got TERM" >>"$FAKE_SLURM_LOG/events"; kill "$nap"; exit 0' TERM
sleep 30 &
nap=$!
echo "$$" >"$FAKE_SLURM_LOG/task.pid.tmp" && mv "$FAKE_SLURM_LOG/task.pid.tmp" "$FAKE_SLURM_LOG/task.pid"
wait "$nap"
""",
    # scancel --signal=TERM JOB.0 delivers the signal to the tasks of step 0.
    "scancel": r"""#!/usr/bin/env bash
echo "scancel $*" >>"$FAKE_SLURM_LOG/events"
if [[ "$1" == --signal=TERM && "$2" == *.0 ]]; then kill -TERM "$(cat "$FAKE_SLURM_LOG/task.pid")"; fi
""",
    # Only looked up with `command -v`; srun (faked) is what would start it.
    "torchrun": "#!/usr/bin/env bash\nexit 99\n",
}


@pytest.fixture
def fake_slurm(tmp_path):
    """The fakes on PATH and the environment of a 2-node allocation; returns (env, log folder)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    # Nothing of a real SLURM job (these tests may run inside one) or of a dry run leaks in.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_")) and k != "DRY_RUN"}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        FAKE_SLURM_LOG=str(log),
        SLURM_JOB_NODELIST="gpu-[01-02]",
        SLURM_NNODES="2",
        SLURM_JOB_ID=JOB_ID,
        SLURM_GPUS_ON_NODE="4",
        SLURM_SUBMIT_DIR=str(REPO_ROOT),
    )
    return env, log


def run_script(env, *args, script=SCRIPT):
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=30)


def events(log) -> list[str]:
    path = log / "events"
    return path.read_text().splitlines() if path.exists() else []


def test_dry_run_prints_one_torchrun_per_node_with_the_arguments_passed_through(fake_slurm):
    env, log = fake_slurm
    result = run_script({**env, "DRY_RUN": "1"}, *USER_ARGS)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(HOSTS), result.stdout
    for host, line in zip(HOSTS, lines, strict=True):
        prefix, command = line.split(": ", 1)
        assert prefix == f"node {host}"
        # The line is shell-quoted: splitting it gives back every argument, "/shared/my run" in one piece.
        assert shlex.split(command) == [
            "env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",  # a rendezvous store per attempt: restarts work
            "torchrun",
            "--nnodes", "2",
            "--nproc_per_node", "4",  # SLURM_GPUS_ON_NODE
            "--max_restarts", "3",  # MAX_RESTARTS's default
            "--rdzv_id", JOB_ID,
            "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"{HOSTS[0]}:29500",  # the first host, MASTER_PORT's default
            str(REPO_ROOT / "T5_training.py"),
            "--resume", "true",
            *USER_ARGS,
        ]  # fmt: skip
    assert "srun" in result.stderr  # the srun line that would start them
    assert not (log / "srun.args").exists() and events(log) == []  # nothing was started


def dry_run_commands(env, *args, script=SCRIPT) -> dict[str, list[str]]:
    """host -> the torchrun command the dry run prints for it, split back into arguments."""
    result = run_script({**env, "DRY_RUN": "1"}, *args, script=script)
    assert result.returncode == 0, result.stderr
    return {line.split(": ", 1)[0]: shlex.split(line.split(": ", 1)[1]) for line in result.stdout.splitlines()}


def test_dry_run_takes_the_port_the_restarts_and_a_comma_host_list_from_the_environment(fake_slurm):
    env, _ = fake_slurm
    commands = dry_run_commands({**env, "SLURM_JOB_NODELIST": "a,b", "MASTER_PORT": "31000", "MAX_RESTARTS": "0"})
    assert list(commands) == ["node a", "node b"]
    for command in commands.values():
        assert command[command.index("--rdzv_endpoint") + 1] == "a:31000"
        assert command[command.index("--max_restarts") + 1] == "0"
        assert command[-2:] == ["--resume", "true"]


@pytest.mark.parametrize(
    ("gpu_env", "nproc"),
    [
        ({"NPROC_PER_NODE": "2"}, "2"),  # an explicit count wins over what SLURM says
        ({"SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "h100:6"}, "6"),  # the type is dropped
        ({"SLURM_GPUS_ON_NODE": ""}, "8"),  # nothing known: the default
    ],
)
def test_dry_run_takes_the_processes_per_node_from_the_environment(fake_slurm, gpu_env, nproc):
    env, _ = fake_slurm
    for command in dry_run_commands({**env, **gpu_env}).values():
        assert command[command.index("--nproc_per_node") + 1] == nproc


def test_a_copy_in_the_spool_folder_finds_the_repository_through_the_submit_folder(fake_slurm, tmp_path):
    # sbatch runs a copy of the script from its spool folder: the repository is where it was submitted.
    env, _ = fake_slurm
    spool = tmp_path / "spool"
    spool.mkdir()
    copy = spool / "slurm_script"
    shutil.copy(SCRIPT, copy)
    for command in dry_run_commands(env, script=copy).values():
        assert str(REPO_ROOT / "T5_training.py") in command
    elsewhere = run_script({**env, "DRY_RUN": "1", "SLURM_SUBMIT_DIR": str(tmp_path)}, script=copy)
    assert elsewhere.returncode != 0 and elsewhere.stdout == ""
    assert "submit from the repository root" in elsewhere.stderr


def test_outside_an_allocation_it_stops_with_one_message_naming_the_fix(fake_slurm):
    env, log = fake_slurm
    del env["SLURM_JOB_NODELIST"]
    result = run_script(env, *USER_ARGS)
    assert result.returncode != 0
    assert result.stdout == ""
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert "SLURM_JOB_NODELIST" in message and "sbatch" in message and "DRY_RUN=1" in message
    assert not (log / "srun.args").exists() and events(log) == []


@pytest.mark.parametrize(
    ("sig", "requeued"),
    [
        (signal.SIGUSR1, True),  # --signal=B:USR1@180, the time limit is near: save, stop, requeue
        (signal.SIGTERM, False),  # cancelled or preempted: save and stop; SLURM decides about requeue
    ],
)
def test_a_signal_to_the_batch_script_reaches_the_tasks_without_killing_srun(fake_slurm, tmp_path, sig, requeued):
    env, log = fake_slurm
    out = (tmp_path / "stdout").open("w")
    err = (tmp_path / "stderr").open("w")
    # Its own session, so that whatever is left after a failure can be cleaned up as one group.
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), *USER_ARGS], env=env, stdout=out, stderr=err, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 5
        while not (log / "task.pid").exists():
            assert proc.poll() is None, (tmp_path / "stderr").read_text()
            assert time.monotonic() < deadline, "the fake srun's task did not start within 5 s"
            time.sleep(0.02)
        proc.send_signal(sig)
        returncode = proc.wait(timeout=10)
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing left of the group: the normal case
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        out.close()
        err.close()
    assert returncode == 0, (tmp_path / "stderr").read_text()
    # Exactly this, in this order: no "srun got TERM" (which would have SIGKILLed the training).
    expected = [f"scancel --signal=TERM {JOB_ID}.0", "task got TERM"]
    assert events(log) == (expected + [f"scontrol requeue {JOB_ID}"] if requeued else expected)
    # srun was given the torchrun command, the job's own arguments last.
    srun_args = (log / "srun.args").read_text().splitlines()
    assert "torchrun" in srun_args
    assert srun_args[-len(USER_ARGS) - 3 :] == [str(REPO_ROOT / "T5_training.py"), "--resume", "true", *USER_ARGS]


# Seed 004's command at its scale (2 nodes; the guide's flags; its accelerate config's settings as flags, since
# the batch script starts torchrun itself).
SEED_004_ARGS = [
    "--model_name", "meta-llama/Llama-2-70b-chat-hf", "--dataset_name", "smangrul/code-chat-assistant-v1",
    "--max_seq_len", "2048", "--max_steps", "500", "--logging_steps", "25", "--eval_steps", "100",
    "--save_steps", "250", "--bf16", "True", "--packing", "True", "--output_dir", "/shared/llama-chat",
    "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1", "--dataset_text_field", "content",
    "--use_gradient_checkpointing", "True", "--learning_rate", "5e-5", "--lr_scheduler_type", "cosine",
    "--weight_decay", "0.01", "--warmup_ratio", "0.03", "--use_flash_attn", "True",
    "--checkpoint_type", "SHARDED_STATE_DICT", "--cpu_ram_efficient_loading", "true", "--use_orig_params", "true",
]  # fmt: skip


def test_dry_run_of_seed_004s_command_passes_its_flags_to_every_node(fake_slurm):
    """The Llama 2 guide's run through this batch script: one torchrun per node with every flag, which the
    package reads as the guide's settings (HF's names mapped)."""
    from configs.cli import parse_args

    env, _ = fake_slurm
    commands = dry_run_commands(env, *SEED_004_ARGS)
    assert list(commands) == [f"node {host}" for host in HOSTS]
    for command in commands.values():
        assert command[command.index("--nnodes") + 1] == "2"
        assert command[-len(SEED_004_ARGS) :] == SEED_004_ARGS
    config = parse_args(SEED_004_ARGS, {})
    data = config.data
    assert (data.packing, data.max_seq_len, data.dataset_text_field) == (True, 2048, "content")
    assert (config.fsdp.checkpoint_type, config.fsdp.fsdp_activation_checkpointing) == ("SHARDED_STATE_DICT", True)
    assert (config.recipe.max_steps, config.recipe.lr_scheduler, config.train.lr) == (500, "cosine", 5e-5)
    assert config.recipe.attn_implementation == "sdpa" and config.fsdp.cpu_ram_efficient_loading
