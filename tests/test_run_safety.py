"""Losing nothing at the edges, in one process (the torchrun runs of the same are in tests/test_resume.py):
checkpoints that verify themselves, damaged ones set aside, rollbacks that stick, one run per output_dir,
Ctrl-C, and a resume that continues the run that was saved."""

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from configs.cli import config_to_dict as record_sections
from configs.cli import continue_run, parse_args
from configs.errors import CheckpointError, ConfigError
from configs.paths import REPO_ROOT
from tests.launch import pooled
from utils.base import layout
from utils.checkpoint.integrity import HashingFile, checkpoint_files, file_record, find_damage, hashed_file
from utils.checkpoint.progress import TrainProgress
from utils.checkpoint.record import recorded_run
from utils.checkpoint.run_lock import RunLock, check_writable
from utils.checkpoint.start import StartPoint, resolve_start, set_aside_newer
from utils.train.preemption import STOP_SIGNALS, StopRequest

# ------------------------------------------------------------------------------ checkpoints verify themselves


def make_checkpoint(output_dir, step: int, world_size: int = 2, best_epoch: int | None = None) -> str:
    """A complete checkpoint as the manager completes one: files written (model.pt hashed as it is written,
    the others read at completion), then train_state.json listing them."""
    folder = os.path.join(layout.checkpoint_root(str(output_dir)), layout.step_dir_name(step))
    os.makedirs(os.path.join(folder, layout.RNG_DIR))
    for rank in range(world_size):
        torch.save({"torch": torch.get_rng_state()}, layout.rng_file(folder, rank))
    written = {}
    with hashed_file(folder, layout.MODEL_FILE, written) as f:
        torch.save({"weight": torch.randn(64, 64)}, f)
    with open(os.path.join(folder, "__0_0.distcp"), "wb") as f:
        f.write(os.urandom(20000))
    progress = {"epoch": 1, "global_step": step, "best_epoch": best_epoch}
    state = {"format_version": layout.FORMAT_VERSION, "checkpoint_type": layout.FULL, "has_optimizer": False,
             "world_size": world_size, "progress": progress}  # fmt: skip
    state["files"] = checkpoint_files(folder, written)
    with open(os.path.join(folder, layout.STATE_FILE), "w") as f:
        json.dump(state, f)
    return folder


def read_state(folder: str) -> dict:
    with open(os.path.join(folder, layout.STATE_FILE)) as f:
        return json.load(f)


def test_the_marker_lists_every_file_with_what_was_written(tmp_path):
    folder = make_checkpoint(tmp_path, 4)
    files = read_state(folder)["files"]
    assert sorted(files) == ["__0_0.distcp", "model.pt", "rng/rank_0.pt", "rng/rank_1.pt"]
    for name, record in files.items():  # hashed while written or read at completion: the same record
        assert record == file_record(os.path.join(folder, name)), name
    # A write-through hash sees exactly the bytes that reach the file.
    path = tmp_path / "plain.bin"
    with open(path, "wb") as raw:
        stream = HashingFile(raw)
        stream.write(b"abc")
        stream.write(memoryview(torch.arange(8, dtype=torch.float32).numpy()))
    assert stream.record() == file_record(str(path))


def damage(folder: str, name: str, how: str) -> None:
    path = os.path.join(folder, name)
    if how == "delete":
        os.remove(path)
    elif how == "truncate":
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    else:  # 4 KB of other bytes in the middle: same size
        data = bytearray(open(path, "rb").read())
        middle = len(data) // 2
        data[middle : middle + 4096] = bytes(255 - b for b in data[middle : middle + 4096])
        open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "overwrite", "delete"])
@pytest.mark.parametrize("name", ["model.pt", "__0_0.distcp", "rng/rank_1.pt"])
def test_each_kind_of_damage_is_found_and_named(tmp_path, name, how):
    folder = make_checkpoint(tmp_path, 4)
    assert find_damage(folder, read_state(folder)) is None
    damage(folder, name, how)
    problem = find_damage(folder, read_state(folder))
    expected = {"delete": "is missing", "truncate": "bytes where", "overwrite": "CRC-32 differs"}[how]
    assert problem is not None and problem.startswith(name) and expected in problem, problem


def test_a_checkpoint_without_a_file_list_gets_the_checks_its_state_allows(tmp_path):
    folder = make_checkpoint(tmp_path, 4)
    state = read_state(folder)
    del state["files"]  # a checkpoint of format 1
    assert find_damage(folder, state) is None
    os.remove(layout.rng_file(folder, 1))
    assert find_damage(folder, state) == "rng/rank_1.pt is missing"


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_starts_from_the_intact_one(tmp_path, log_records):
    older, newest = make_checkpoint(tmp_path, 4), make_checkpoint(tmp_path, 8)
    damage(newest, "__0_0.distcp", "overwrite")
    start = resolve_start("true", str(tmp_path))
    assert start == StartPoint(older, layout.FULL)
    assert not os.path.exists(newest)
    [aside] = os.listdir(os.path.join(layout.checkpoint_root(str(tmp_path)), layout.DAMAGED_DIR))
    assert aside.startswith("step_00000008-")  # kept, never deleted
    warnings = [r.getMessage() for r in log_records if r.levelno == logging.WARNING]
    assert any(newest in w and "__0_0.distcp" in w and older in w for w in warnings), warnings


def test_an_unreadable_marker_is_damage_too(tmp_path):
    older, newest = make_checkpoint(tmp_path, 4), make_checkpoint(tmp_path, 8)
    with open(os.path.join(newest, layout.STATE_FILE), "w") as f:
        f.write('{"format_version": 2, "checkp')
    assert resolve_start("true", str(tmp_path)).path == older


def test_a_damaged_named_checkpoint_and_no_intact_one_are_refused_changing_nothing(tmp_path):
    older, newest = make_checkpoint(tmp_path, 4), make_checkpoint(tmp_path, 8)
    damage(newest, "model.pt", "truncate")
    with pytest.raises(
        CheckpointError, match=r"--resume .*step_00000008: the checkpoint is damaged: model.pt has"
    ):
        resolve_start(newest, str(tmp_path))
    damage(older, "rng/rank_0.pt", "delete")
    with pytest.raises(CheckpointError, match="no intact checkpoint") as refused:
        resolve_start("true", str(tmp_path))
    assert older in str(refused.value) and newest in str(refused.value)
    assert os.path.isdir(older) and os.path.isdir(newest)  # nothing moved when there is nowhere to go


def test_dcps_failures_reach_the_user_as_one_sentence():
    """DCP wraps each rank's cause as an (exception, traceback) pair; the message names the exception."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from configs.errors import error_summary

    try:
        raise EOFError("Ran out of input")
    except EOFError as err:
        pair = (err, traceback.extract_tb(err.__traceback__))
    summary = error_summary(CheckpointException("read_data", {0: pair, 1: pair}))
    assert summary == "EOFError: Ran out of input", summary
    assert error_summary(CheckpointException("read_data", {0: (EOFError(), [])})) == "EOFError"


# ----------------------------------------------------------------------------------------------- rollbacks


def test_a_rollback_sets_the_abandoned_branch_aside(tmp_path, log_records):
    start_folder = make_checkpoint(tmp_path, 4)
    newer = [make_checkpoint(tmp_path, step) for step in (8, 12)]
    assert not set_aside_newer(str(tmp_path), StartPoint(start_folder, layout.FULL), TrainProgress(global_step=4))
    assert layout.complete_checkpoints(str(tmp_path)) == [start_folder]
    [branch] = os.listdir(os.path.join(layout.checkpoint_root(str(tmp_path)), layout.ABANDONED_DIR))
    assert branch.startswith("after_step_00000004-")
    branch_dir = os.path.join(layout.checkpoint_root(str(tmp_path)), layout.ABANDONED_DIR, branch)
    assert sorted(os.listdir(branch_dir)) == [os.path.basename(path) for path in newer]
    assert any("step_00000008, step_00000012" in r.getMessage() for r in log_records), log_records
    # --resume true now continues this branch.
    assert resolve_start("true", str(tmp_path)).path == start_folder


def test_a_rollback_sets_aside_the_exports_of_a_best_epoch_the_abandoned_branch_found(tmp_path, log_records):
    """The abandoned branch found a newer best (epoch 2) than the restored progress holds (epoch 1): hf_model/
    holds its model and goes with it, and this branch's best is chosen again. Control: where the branch found
    no newer best, the exports hold the restored best's model and stay."""
    for found, best in (("newer best", 2), ("no newer best", 1)):
        out = tmp_path / found
        start_folder = make_checkpoint(out, 4, best_epoch=1)
        make_checkpoint(out, 8, best_epoch=best)
        (out / layout.HF_DIR).mkdir()
        (out / layout.HF_DIR / "config.json").write_text("{}")
        restored = TrainProgress(epoch=2, global_step=4, best_metric=1.5, best_epoch=1)
        abandoned = set_aside_newer(str(out), StartPoint(start_folder, layout.FULL), restored)
        [branch] = (out / "checkpoints" / layout.ABANDONED_DIR).iterdir()
        aside = sorted(path.name for path in branch.iterdir())
        if found == "newer best":
            assert abandoned and aside == [layout.HF_DIR, "step_00000008"] and not (out / layout.HF_DIR).exists()
            assert any("this branch's best is chosen again" in r.getMessage() for r in log_records), log_records
        else:
            assert not abandoned and aside == ["step_00000008"] and (out / layout.HF_DIR / "config.json").exists()


# ------------------------------------------------------------------------------------ one run per output_dir

HOLDER = textwrap.dedent("""
    import sys, time
    from utils.checkpoint.run_lock import RunLock
    lock = RunLock(sys.argv[1])
    lock.acquire()
    print("held", flush=True)
    time.sleep(60)
""")


@pytest.mark.slow  # processes of its own: a lock holder, then a killed one (5 s)
def test_a_second_run_is_refused_while_a_live_one_holds_the_folder_and_a_dead_ones_lock_is_taken_over(
    tmp_path, log_records
):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match="is in use by another run") as refused:
            RunLock(str(tmp_path)).acquire()
        assert f"pid {holder.pid}" in str(refused.value) and "started 20" in str(refused.value)
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(str(tmp_path))  # the holder died without releasing: its record is still in the file
    lock.acquire()
    assert any(f"pid {holder.pid}" in r.getMessage() and "taking it over" in r.getMessage() for r in log_records)
    assert json.loads((tmp_path / layout.RUN_LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / layout.RUN_LOCK_FILE).read_text() == ""  # a run that ends leaves no holder


def test_a_refused_start_leaves_no_folder_behind_and_never_removes_one_it_did_not_create(tmp_path):
    new = tmp_path / "new" / "run"
    for leave in (None, "metrics.jsonl"):
        lock = RunLock(str(new))
        lock.acquire()
        assert new.is_dir()
        if leave:
            (new / leave).write_text("{}\n")
        lock.release()
        assert new.exists() == bool(leave)  # removed only when it holds nothing but the lock
    existing = tmp_path / "existing"
    existing.mkdir()
    lock = RunLock(str(existing))
    lock.acquire()
    lock.release()
    assert existing.is_dir() and (existing / layout.RUN_LOCK_FILE).read_text() == ""


# Short enough to train in seconds, with a checkpoint and an hf_model/ export at its end.
SHORT_RUN = ["--num_train_samples", "16", "--num_val_samples", "4", "--epochs", "1", "--eval_rouge", "false",
             "--mixed_precision", "false"]  # fmt: skip


@pytest.mark.slow
def test_a_checkpoints_folder_that_cannot_be_written_is_said_at_start_before_anything_is_replaced(tmp_path):
    """The issue's case, with a real read-only bind mount of checkpoints/: the run trained, rewrote hf_model/ and
    died with a traceback at its first save. Now every rank stops at start with one message naming the folder
    and the fix; nothing is trained, written or replaced. Control: the same run, writable, trains, saves its
    checkpoint there and replaces hf_model/."""
    from tests.test_end_to_end import check_user_error
    from tests.test_sources import read_only_folder

    out = tmp_path / "out"
    (out / layout.CHECKPOINTS_DIR).mkdir(parents=True)
    (out / layout.HF_DIR).mkdir()
    (out / layout.HF_DIR / "earlier.txt").write_text("an earlier export")
    args = [*SHORT_RUN, "--output_dir", str(out)]
    with read_only_folder(out / layout.CHECKPOINTS_DIR):
        refused = pooled(args, timeout=90)
    line = check_user_error(refused, "is not writable")
    checkpoints = str(out / layout.CHECKPOINTS_DIR)
    assert f"the checkpoints folder {checkpoints!r} is not writable (Read-only file system)" in line, line
    assert "choose another --output_dir" in line, line
    left = sorted(path.name for path in out.iterdir())
    assert left == [layout.CHECKPOINTS_DIR, layout.HF_DIR, layout.RUN_LOCK_FILE], left  # no record, no metrics
    assert (out / layout.HF_DIR / "earlier.txt").read_text() == "an earlier export"

    trained = pooled(args, timeout=120)
    assert trained.returncode == 0, trained.describe()
    assert [os.path.basename(path) for path in layout.complete_checkpoints(str(out))] == ["step_00000002"]
    assert sorted(path.name for path in (out / layout.HF_DIR).iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip


def unwritable_on_one_rank_worker(rank: int, world_size: int, output_dir: str, failing_rank: int) -> str | None:
    """check_writable on every rank, where `failing_rank`'s probe (-1: none) meets a full quota, injected at its
    fsync as a quota of that node's disk would: each rank's ConfigError message, or None."""
    fsync = os.fsync

    def quota_exceeded(descriptor: int) -> None:
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    if rank == failing_rank:
        os.fsync = quota_exceeded
    try:
        check_writable(output_dir, evaluating=False, saves_checkpoints=True)
    except ConfigError as err:
        return str(err)
    finally:
        os.fsync = fsync
    return None


def test_the_folders_probed_are_those_the_run_writes_on_every_rank(tmp_path):
    """A full quota on rank 1 alone (a node-local disk) stops both ranks with one message naming the rank, its
    host and the folder; without it both pass. --evaluate_only, which writes no checkpoint, and --keep_last_n 0
    are not stopped by a read-only checkpoints/, a training run is; a folder not there yet is probed where it
    will be created, and not created."""
    from tests.dist_harness import run_ranks
    from tests.test_sources import read_only_folder

    assert run_ranks(unwritable_on_one_rank_worker, str(tmp_path), -1) == [None, None]  # control
    said = run_ranks(unwritable_on_one_rank_worker, str(tmp_path), 1)
    assert said[0] == said[1] and f"output_dir {str(tmp_path)!r} is not writable from rank 1 (host " in said[0]
    assert "(Disk quota exceeded)" in said[0] and "choose another --output_dir" in said[0], said[0]

    checkpoints = tmp_path / layout.CHECKPOINTS_DIR
    check_writable(str(tmp_path), evaluating=False, saves_checkpoints=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == []
    checkpoints.mkdir()
    with read_only_folder(checkpoints):
        check_writable(str(tmp_path), evaluating=True, saves_checkpoints=True)
        check_writable(str(tmp_path), evaluating=False, saves_checkpoints=False)
        with pytest.raises(ConfigError, match="the checkpoints folder .* is not writable .Read-only file system."):
            check_writable(str(tmp_path), evaluating=False, saves_checkpoints=True)


# ---------------------------------------------------------------------------------------------------- Ctrl-C


@pytest.mark.parametrize(
    ("received", "name", "stops_at_once"),
    [
        ((signal.SIGTERM, signal.SIGTERM), "SIGTERM", None),  # SIGTERM again: still the same request
        ((signal.SIGINT,), "SIGINT", signal.SIGINT),
        ((signal.SIGINT,), "SIGINT", signal.SIGTERM),  # torchrun forwards a second Ctrl-C as SIGTERM
        ((signal.SIGTERM, signal.SIGINT), "SIGTERM", signal.SIGTERM),  # a scheduler's SIGTERM, then Ctrl-C twice
    ],
)
def test_ctrl_c_asks_for_a_save_and_a_second_one_stops_at_once(received, name, stops_at_once):
    with StopRequest() as stop, stop.watching():
        for signum in received:
            os.kill(os.getpid(), signum)
        time.sleep(0.01)
        assert stop.requested and stop.name == name
        if stops_at_once is not None:
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), stops_at_once)
                time.sleep(1)


def test_signals_act_as_before_until_training_and_are_noted_until_the_run_has_ended(log_records):
    """Before training (loading) a SIGTERM reaches the handler the run found, as Python's default would end it;
    after a failed training, torchrun's SIGTERM to the surviving ranks is noted while they finish their saves
    (utils/checkpoint/manager.py: close); the handler found is back once the owner exits."""
    reached = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: reached.append(signum))
    try:
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            assert reached == [signal.SIGTERM] and not stop.requested  # the control: not yet watched
            with pytest.raises(RuntimeError), stop.watching():
                raise RuntimeError("a rank failed")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            assert reached == [signal.SIGTERM] and stop.requested
            said = [record.getMessage() for record in log_records]
            assert said == ["received SIGTERM as the run ends: its saves are finished first"]
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert reached == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_signal_dispositions(batch):
    return [signal.getsignal(signum) for signum in STOP_SIGNALS]


def test_dataloader_workers_leave_stop_signals_to_their_rank():
    """torchrun signals a rank's whole process group: a worker that obeyed (or logged) the signal would crash
    or repeat the rank's stop. The control: without workers the batch is made where the rank's handlers are."""
    from utils.data.loaders import build_loader

    def dispositions(num_workers: int) -> list:
        loader = build_loader([0], None, 1, _stop_signal_dispositions, num_workers, torch.device("cpu"))
        return next(iter(loader))

    with StopRequest() as stop, stop.watching():
        assert dispositions(1) == [signal.SIG_IGN, signal.SIG_IGN]
        assert dispositions(0) == [stop._handle, stop._handle]


INTERRUPTED = textwrap.dedent("""
    import sys

    import T5_training

    def interrupted(*args):
        raise KeyboardInterrupt  # as a second Ctrl-C raises it, mid-run

    T5_training.process_group.init_distributed = lambda *args: None
    T5_training.fsdp_main = interrupted
    T5_training.main(["--output_dir", sys.argv[1], "--device", "cpu"])
""")


def test_a_stop_at_once_prints_one_line_and_exits_130_without_a_traceback(tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    # On a pooled rank: the process ends itself (os._exit), so its worker is replaced, patched globals and all.
    done = pooled([str(tmp_path / "out")], nproc=1, script=str(script))
    assert done.returncode == 130, done.describe()
    assert done.stdout.count("interrupted: stopped at once") == 1, done.stdout
    assert "Traceback" not in done.output, done.describe()


# ----------------------------------------------------------------------- a resume continues the run saved


def recorded(**fields) -> dict:
    """The sections of a run record (config.json) of a run started with `fields` on the command line."""
    return record_sections(parse_args([f"--{name}={value}" for name, value in fields.items()]))


def test_a_resume_keeps_the_runs_settings_unless_told_otherwise():
    run = recorded(fsdp_version=2, peft="lora", num_train_samples=96, lr=0.002, output_dir="first")
    config, changes = continue_run(["--resume", "true", "--output_dir", "out"], run, "out/config.json")
    assert config.fsdp.fsdp_version == 2 and config.lora.peft == "lora" and config.data.num_train_samples == 96
    assert config.train.output_dir == "out" and config.checkpointing.resume == "true" and changes == []
    config, changes = continue_run(["--resume", "true", "--lr", "0.01", "--epochs", "4"], run, "out/config.json")
    assert config.train.lr == 0.01 and config.train.epochs == 4 and config.fsdp.fsdp_version == 2
    assert changes == ["--epochs 4 (the run had 2)", "--lr 0.01 (the run had 0.002)"]
    # Given as the run had it: no change.
    assert continue_run(["--fsdp_version", "2"], run, "out/config.json")[1] == []


def test_a_run_recorded_under_the_old_row_defaults_resumes_with_them():
    """Before the defaults by source, a run recorded 1500/300 whatever its data; a resume keeps those, and a
    run recorded since (NONE: by source) resumes by source."""
    old = recorded(num_train_samples=1500, num_val_samples=300)
    config, changes = continue_run(["--resume", "true"], old, "out/config.json")
    assert (config.data.num_train_samples, config.data.num_val_samples, changes) == (1500, 300, [])
    config, _ = continue_run(["--resume", "true"], recorded(), "out/config.json")
    assert (config.data.num_train_samples, config.data.num_val_samples) == (None, None)


@pytest.mark.parametrize(
    "flag",
    [["--num_train_samples", "64"], ["--peft", "none"], ["--model_name", "t5-base"], ["--lora_r", "4"],
     ["--warmup_steps", "3"], ["--warmup_ratio", "0.1"]],
)  # fmt: skip
def test_a_resume_refuses_what_the_checkpoints_cannot_honour(flag):
    run = recorded(fsdp_version=2, peft="lora", num_train_samples=96)
    with pytest.raises(
        ConfigError, match=rf"{flag[0]} {flag[1]}: the run being resumed was trained with {flag[0]} "
    ):
        continue_run(["--resume", "true", *flag], run, "out/config.json")


def test_a_batch_size_that_orders_the_epoch_is_held_and_a_record_this_version_cannot_read_can_be_overridden():
    run = recorded(group_by_length="true", batch_size_training=4)
    with pytest.raises(ConfigError, match="--batch_size_training 8: .* --group_by_length cut its epochs' order"):
        continue_run(["--batch_size_training", "8"], run, "out/config.json")
    assert continue_run(["--batch_size_training", "8"], recorded(batch_size_training=4), "r")[1] == [
        "--batch_size_training 8 (the run had 4)"
    ]
    run["recipe_config"]["attn_implementation"] = "a_later_kernel"
    with pytest.raises(
        ConfigError, match="record out/config.json gives --attn_implementation a_later_kernel.*give --attn"
    ):
        continue_run([], run, "out/config.json")
    config, changes = continue_run(["--attn_implementation", "eager"], run, "out/config.json")
    assert config.recipe.attn_implementation == "eager" and "(the run had a_later_kernel)" in changes[0]


def test_a_fixed_field_newer_than_the_record_holds_the_default_the_run_had():
    """A run recorded before --length_key existed ordered its epochs by the source: a resume may not change
    that, and may give the default (what the run had)."""
    run = recorded(group_by_length="true")
    del run["data_config"]["length_key"]
    with pytest.raises(ConfigError, match="--length_key target_then_source: the run being resumed was trained "
                                          "with --length_key source"):  # fmt: skip
        continue_run(["--length_key", "target_then_source"], run, "out/config.json")
    config, changes = continue_run(["--length_key", "source"], run, "out/config.json")
    assert config.data.length_key == "source" and changes == []


def test_the_record_a_resume_reads(tmp_path):
    (tmp_path / layout.CONFIG_FILE).write_text(json.dumps(recorded(lr=0.005)))
    assert recorded_run("true", str(tmp_path)) is None  # no checkpoint: nothing to continue
    checkpoint = make_checkpoint(tmp_path, 4)
    path, record = recorded_run("true", str(tmp_path))
    assert path == str(tmp_path / layout.CONFIG_FILE) and record["train_config"]["lr"] == 0.005
    assert recorded_run(checkpoint, str(tmp_path / "elsewhere"))[0] == path  # the checkpoint's own run
    set_aside_newer(
        str(tmp_path), StartPoint(make_checkpoint(tmp_path, 2), layout.FULL), TrainProgress(global_step=2)
    )
    [aside] = (tmp_path / "checkpoints" / "abandoned").glob("*/step_00000004")
    assert recorded_run(str(aside), str(tmp_path / "elsewhere"))[0] == path  # found from a set-aside one too
    assert recorded_run("false", str(tmp_path)) is None
