"""Resumable checkpoints (model, optimizer, LR scheduler, grad scaler, progress, RNG); the final models are
utils/checkpoint/final_models.py's. docs/checkpoints.md has the design and its measurements.

A checkpoint is written under `checkpoints/.tmp_step_...` (utils/base/layout.py) and renamed when every rank
has finished, so a crash during a save leaves the previous checkpoints loadable. Its train_state.json, written
last, lists every other file with its size and CRC-32 (utils/checkpoint/integrity.py). Old checkpoints are
pruned only after a newer one is complete, off the training thread.

With --async_checkpoint the shards are written in the background (utils/checkpoint/background.py); rank 0
completes the checkpoint between two steps once its own write has finished, which DCP ends only after every
rank's. At most one save is in flight; `close` (in the run's `finally`) finishes it, or says it was abandoned.

Nothing here unpickles arbitrary objects: .pt files load with weights_only=True, the DCP payload holds tensors
only (the optimizer's hyper-parameters are JSON), and DCP's `.metadata` is read by utils/checkpoint/safe_dcp.py.
"""

import copy
import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim.lr_scheduler import LRScheduler

from configs.checkpointing import CheckpointConfig
from configs.errors import FAILURES, CheckpointError, UserError, error_summary, is_disk_full
from configs.fsdp import FSDPConfig
from utils.base import layout
from utils.base.files import disk_bytes, free_bytes, write_json
from utils.base.log import get_logger, size_text
from utils.checkpoint.background import BackgroundWriter
from utils.checkpoint.integrity import RecordingWriter, checkpoint_files, hashed_file
from utils.checkpoint.progress import TrainProgress
from utils.checkpoint.safe_dcp import SafeFileSystemReader
from utils.checkpoint.start import StartPoint, read_train_state, set_aside_newer
from utils.checkpoint.state_dicts import (
    fill_from_full,
    fsdp1_state_dict_warnings_ignored,
    model_and_optimizer_state,
    param_groups_from_json,
    set_optimizer_state,
    sharded_model_state,
    sharded_optimizer_template,
    tensor_only_optimizer_state,
)
from utils.distributed.hang_report import WHERE
from utils.distributed.process_group import DistInfo, rank0_decides
from utils.distributed.progress_bounded import progress_bounded
from utils.fsdp.parallelism import Parallelism
from utils.model.lora import trainable_share
from utils.observe.memory import param_numel_local, trim_host_heap


@dataclass
class BackgroundSave:
    """A checkpoint whose shards are being written in the background."""

    future: Future  # this rank's part of DCP's async_save
    tmp: str
    final: str
    train_state: dict  # taken when the save started (training has moved on since); rank 0 writes it last
    started: float
    stalled_s: float  # how long training stopped for it


class CheckpointManager:
    """Owns output_dir's checkpoints/ for one run: decides when to save (`due`), saves, prunes, loads where the
    run starts from, and is closed at the end (`close`, in a `finally`). Every saving or loading method is
    collective: every rank calls it, rank 0 writes the shared files."""

    def __init__(
        self,
        *,
        checkpointing: CheckpointConfig,
        fsdp: FSDPConfig,
        output_dir: str,
        model: nn.Module,
        parallelism: Parallelism,
        optimizer: torch.optim.Optimizer,
        scheduler: LRScheduler,
        scaler: ShardedGradScaler | None,
        model_config,
        tokenizer,
        info: DistInfo,
        inputs: dict | None = None,
    ):
        self.checkpointing, self.output_dir, self.info = checkpointing, output_dir, info
        self.parallelism = parallelism
        self.checkpoint_type, self.save_optimizer = fsdp.checkpoint_type, fsdp.save_optimizer  # fsdp_config's
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.model_config, self.tokenizer = model_config, tokenizer  # saved in each checkpoint
        self.inputs = inputs  # what the run reads, fingerprinted (utils/checkpoint/inputs.py)
        self.pending: BackgroundSave | None = None
        self.said_saves_wait = False  # a save waited for the previous one's write (warned once)
        # Rank 0 deletes pruned checkpoints in a thread, not between two steps that every rank waits on.
        self.purger = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-purge") if info.is_main else None
        self.purged = 0  # folders handed to it
        if info.is_main and self.checkpoint_type == layout.FULL and checkpointing.keep_last_n:
            whole = parallelism.param_numel_whole(model)
            say_if_full_saves_are_large(state_bytes(model, whole, self.save_optimizer))
        self.background = None
        if checkpointing.async_checkpoint:  # collective: every rank makes the writer's group
            rank_bytes = state_bytes(model, param_numel_local(model), self.save_optimizer)  # what a rank stages
            self.background = BackgroundWriter(parallelism, info, rank_bytes)

    def due(self, step: int, stop_requested: bool) -> bool:
        """Whether a checkpoint is to be written after `step` inside an epoch (epoch ends always save)."""
        periodic = self.checkpointing.save_every_n_steps > 0 and step % self.checkpointing.save_every_n_steps == 0
        return self.checkpointing.keep_last_n > 0 and (periodic or stop_requested)

    @fsdp1_state_dict_warnings_ignored()
    def save(self, progress: TrainProgress, blocking: bool = False) -> str | None:
        """Write a checkpoint of the current state (nothing with --keep_last_n 0). Returns its folder. With
        --async_checkpoint and not `blocking` (a stop's save is), it returns once the shards are staged in host
        memory; the folder appears when their background write has finished (`poll`)."""
        if self.checkpointing.keep_last_n == 0:
            return None
        WHERE.enter("checkpoint save")
        self._wait_for_the_previous_write(progress.global_step, periodic=not blocking)  # one save in flight
        try:
            return self._save(progress, blocking)
        except FAILURES as err:
            if not self._ran_out_of_space(err):
                raise
            raise self._out_of_space(progress.global_step, err) from None

    def _save(self, progress: TrainProgress, blocking: bool) -> str:
        """`save`'s work, where a full disk surfaces."""
        # The freed activations of the last steps go back to the OS first: the save's peak is what it holds.
        trim_host_heap()
        started = time.perf_counter()
        final = os.path.join(layout.checkpoint_root(self.output_dir), layout.step_dir_name(progress.global_step))
        tmp = layout.tmp_checkpoint_dir(self.output_dir, progress.global_step)
        if self.info.is_main:
            if os.path.exists(tmp):  # left by a save that crashed
                shutil.rmtree(tmp)
            os.makedirs(os.path.join(tmp, layout.RNG_DIR))
        dist.barrier()
        train_state = self._train_state(progress)
        full = self.checkpoint_type == layout.FULL
        model_state, optim_state = model_and_optimizer_state(
            self.model, self.optimizer, full, self.info.device, self.parallelism
        )
        self._write_small_files(tmp, optim_state)
        written = {}  # rank 0's files hashed as they were written (model.pt, optimizer.pt)
        if full:
            # With CPU offload (GPU runs; FSDP2 on CPU too) only rank 0 receives the gathered state; others get {}.
            # Its write can outlast --dist_timeout_s (t5-11b: about 130 GB): the others wait on its progress.
            with progress_bounded("checkpoint save (rank 0 writes model.pt and optimizer.pt)"):
                if self.info.is_main:
                    with hashed_file(tmp, layout.MODEL_FILE, written) as f:
                        torch.save(model_state, f)
                    if self.save_optimizer:
                        with hashed_file(tmp, layout.OPTIMIZER_FILE, written) as f:
                            torch.save(tensor_only_optimizer_state(optim_state), f)
        else:
            payload = {layout.MODEL_SECTION: model_state}
            if self.save_optimizer:
                payload[layout.OPTIMIZER_SECTION] = tensor_only_optimizer_state(optim_state)
            if self.background is not None and not blocking:
                dist.barrier()  # every rank's small files are on disk before rank 0 may complete the folder
                future = self.background.write(payload, tmp)
                stalled = time.perf_counter() - started
                self.pending = BackgroundSave(future, tmp, final, train_state, started, stalled)
                get_logger().info(
                    "checkpoint %s: training resumes after %.2f s; written in the background", final, stalled
                )
                return final
            dcp.save(payload, storage_writer=RecordingWriter(tmp))  # collective; each rank writes its shards
            dist.barrier()  # every rank's files are on disk
        with progress_bounded("checkpoint save (rank 0 completes the folder)"):  # hashes the small files
            if self.info.is_main:
                self._complete(tmp, final, train_state, written, f"in {time.perf_counter() - started:.2f} s")
        return final

    def _wait_for_the_previous_write(self, step: int, periodic: bool) -> None:
        """Finish the background save in flight before the next one. A periodic save that waited for the previous
        one means every write holds training up: said once, with the fix."""
        pending = self.pending
        if pending is None:
            return
        still_writing, waited_from = not pending.future.done(), time.perf_counter()
        self.finish_pending()
        previous_step = pending.train_state["progress"]["global_step"]
        cadence = periodic and step - previous_step == self.checkpointing.save_every_n_steps
        if still_writing and cadence and not self.said_saves_wait:
            self.said_saves_wait = True
            say = get_logger().warning if self.info.is_main else get_logger().info  # said once, by rank 0
            say(
                "the checkpoint of step %d waited %.2f s for the background write of step %d's: the %d steps "
                "between two saves took less time than one write. Save less often (--save_every_n_steps) so "
                "that the writes run behind training",
                step, time.perf_counter() - waited_from, previous_step, step - previous_step,
            )  # fmt: skip

    def poll(self) -> None:
        """Between steps: complete a background save whose write has finished (rank 0 renames it; no
        collective, so ranks may see it finish at different steps)."""
        if self.pending is not None and self.pending.future.done():
            self.finish_pending()

    def finish_pending(self) -> None:
        """Wait for the background save, if any, and complete it (rank 0). Before the next save, the exports
        and the end of the run."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        except FAILURES as err:
            if self._ran_out_of_space(err):
                raise self._out_of_space(pending.train_state["progress"]["global_step"], err) from None
            raise CheckpointError(
                f"the background write of {pending.final} failed: {error_summary(err)}. The previous checkpoint "
                "stays the newest complete one."
            ) from None
        if self.info.is_main:
            written = time.perf_counter() - pending.started
            detail = f"in the background in {written:.2f} s; training stopped {pending.stalled_s:.2f} s"
            self._complete(pending.tmp, pending.final, pending.train_state, {}, detail)

    def _checkpoint_bytes(self) -> tuple[int, str]:
        """(what a checkpoint of this run takes, about; how that is known)."""
        kept = layout.complete_checkpoints(self.output_dir)
        if kept:
            return disk_bytes(kept[-1]), "the size of the newest checkpoint"
        # replicas (NO_SHARD, the hybrid strategies' groups) are written once
        whole = state_bytes(self.model, self.parallelism.param_numel_whole(self.model), self.save_optimizer)
        return whole, "the model and optimizer in fp32"

    def _ran_out_of_space(self, err: BaseException) -> bool:
        """Whether a failed save failed for a full disk: said so (configs/errors.py), or said otherwise while less
        than a checkpoint is free (torch's zip writer reports a short write as "unexpected pos")."""
        free = free_bytes(layout.checkpoint_root(self.output_dir))
        return is_disk_full(err) or (free is not None and free < self._checkpoint_bytes()[0])

    def _out_of_space(self, step: int, err: BaseException) -> CheckpointError:
        """The one message of a save that found its disk (or quota) full; rank 0 removes the partial write."""
        if self.info.is_main:
            shutil.rmtree(layout.tmp_checkpoint_dir(self.output_dir, step), ignore_errors=True)
        root = layout.checkpoint_root(self.output_dir)
        kept = layout.complete_checkpoints(self.output_dir)
        needed, sized_by = self._checkpoint_bytes()
        if kept:
            what_was_kept = f"the newest complete checkpoint, {kept[-1]}, is kept as it was"
        else:
            what_was_kept = "there is no earlier checkpoint to resume from"
        free = free_bytes(root)
        free_there = "" if free is None else f", {size_text(free)} are free there"
        return CheckpointError(
            f"no space left on the disk of {root} for the checkpoint of step {step}: a checkpoint needs about "
            f"{size_text(needed)} ({sized_by}){free_there}, and {self.checkpointing.keep_last_n} kept "
            "(--keep_last_n) plus the one being written must fit. The partial write was removed; "
            f"{what_was_kept}. Free space there (or lower --keep_last_n, or choose another --output_dir), then "
            f"resume with --resume true. (The write's error: {error_summary(err, 200)})"
        )

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close(failed=exc is not None, at_once=isinstance(exc, KeyboardInterrupt))

    def close(self, failed: bool = False, at_once: bool = False) -> None:
        """The end of the run, before the process group goes down: a background save in flight is completed, or
        abandoned when the run stops at once or its write fails (one line says which); the workers stop."""
        # Said once: rank 0 warns, the other ranks' lines stay below their log level.
        pending, say = self.pending, get_logger().warning if self.info.is_main else get_logger().info
        if pending is not None:
            if at_once:
                self.pending = None
                say("the background save of %s was abandoned (stopped at once): resume from the newest complete "
                    "checkpoint", pending.final)  # fmt: skip
            else:
                # torchrun's SIGTERM after another rank failed waits for this (utils/train/preemption.py).
                try:
                    self.finish_pending()
                    if failed:
                        say("the background save of %s was completed before stopping", pending.final)
                except UserError as err:
                    say("the background save was abandoned: %s", err)
        if self.purger is not None:
            self.purger.shutdown(wait=not at_once)
        if self.background is not None:
            self.background.close()

    def _write_small_files(self, folder: str, optim_state: dict) -> None:
        """Every rank's RNG state; on rank 0 the optimizer's parameter groups, the model config, the tokenizer."""
        rng = {"torch": torch.get_rng_state()}
        if self.info.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.info.device)
        torch.save(rng, layout.rng_file(folder, self.info.rank))
        if self.info.is_main:
            if self.save_optimizer:
                write_json(os.path.join(folder, layout.PARAM_GROUPS_FILE), optim_state["param_groups"])
            self.model_config.save_pretrained(folder)
            self.tokenizer.save_pretrained(os.path.join(folder, layout.TOKENIZER_DIR))

    def _train_state(self, progress: TrainProgress) -> dict:
        """What train_state.json holds, as of now (a copy: a background save writes it steps later)."""
        return copy.deepcopy({
            "format_version": layout.FORMAT_VERSION,
            "checkpoint_type": self.checkpoint_type,
            "has_optimizer": self.save_optimizer,
            "world_size": self.info.world_size,
            "progress": asdict(progress),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "inputs": self.inputs,
        })  # fmt: skip

    def _complete(self, tmp: str, final: str, train_state: dict, written: dict, how: str) -> None:
        """Rank 0, once every rank's files are on disk: train_state.json last, with every other file's size and
        CRC-32 (its presence marks the checkpoint complete), the rename, then the pruning of older ones."""
        files = checkpoint_files(tmp, written)
        write_json(os.path.join(tmp, layout.STATE_FILE), {**train_state, "files": files})
        if os.path.exists(final):  # the same step saved again (a stop right after a periodic save)
            self._purge(final)
        os.replace(tmp, final)
        megabytes = sum(record["bytes"] for record in files.values()) / 1e6
        get_logger().info("checkpoint %s (%s): %.1f MB %s", final, self.checkpoint_type, megabytes, how)
        for old in layout.complete_checkpoints(self.output_dir)[: -self.checkpointing.keep_last_n]:
            self._purge(old)
            get_logger().info("removed old checkpoint %s (keep_last_n=%d)", old, self.checkpointing.keep_last_n)

    def _purge(self, checkpoint: str) -> None:
        """Rank 0: a folder is renamed out of the way at once (a temporary name, which a crash leaves for the next
        run to remove), and its files are deleted in the background."""
        self.purged += 1
        doomed = layout.purged_dir(checkpoint, self.purged)
        os.replace(checkpoint, doomed)
        self.purger.submit(shutil.rmtree, doomed, ignore_errors=True)

    def begin_training(self, start: StartPoint, progress: TrainProgress) -> TrainProgress:
        """Before a run's first step (collective; rank 0 acts, under the run lock): a rollback's abandoned newer
        checkpoints are set aside, temporary folders of unfinished saves removed, a background writer started.
        The progress to train from: without a best epoch where the exported best was the abandoned branch's."""

        def prepare() -> bool:
            exports_abandoned = set_aside_newer(self.output_dir, start, progress)
            for stale in layout.stale_temporaries(self.output_dir):  # under the run lock: nobody writes them
                self._purge(stale)
                get_logger().info("removing %s, a save that never completed", stale)
            return exports_abandoned

        if rank0_decides(prepare):
            progress = replace(progress, best_metric=None, best_epoch=None)
        if self.background is not None and self.checkpointing.keep_last_n:
            self.background.start_process(layout.tmp_checkpoint_dir(self.output_dir, 0) + "_writer_start")
        return progress

    @fsdp1_state_dict_warnings_ignored()
    def load(self, start: StartPoint) -> TrainProgress:
        """Restore where the run starts from: a checkpoint folder's model, optimizer, scheduler, scaler, RNG and
        progress (a .pt's weights went in before sharding). The progress to train from. Collective."""
        if not start.is_checkpoint:
            if start.path:
                get_logger().info("started from the weights of %s (new optimizer, epoch 1)", start.path)
            return TrainProgress()
        checkpoint = start.path
        state = read_train_state(checkpoint)
        this_runs_lrs = [group["initial_lr"] for group in self.optimizer.param_groups]
        try:
            self._restore_model_and_optimizer(checkpoint, state)
            restore_schedule(self.scheduler, self.optimizer, state, this_runs_lrs)
            if self.scaler is not None and state["scaler"] is not None:
                self.scaler.load_state_dict(state["scaler"])
            self._restore_rng(checkpoint, state["world_size"])
        except UserError:
            raise
        except FAILURES as err:  # every failure becomes one message naming the checkpoint
            checked = "Its files are as they were written (checked): it" if "files" in state else "It"
            raise CheckpointError(
                f"cannot resume from {checkpoint}: {error_summary(err)}. {checked} holds another model or "
                "optimizer than this run builds; resume with the settings that wrote it, or from another "
                "checkpoint."
            ) from None
        progress = TrainProgress(**state["progress"])
        get_logger().info("resumed from %s: epoch %d, step %d", checkpoint, progress.epoch, progress.global_step)
        return progress

    def _restore_model_and_optimizer(self, checkpoint: str, state: dict) -> None:
        """The checkpoint's weights and optimizer state into templates of this run's shards, filled in place, one
        at a time, the model's first: FSDP1's are copies of the shards (docs/checkpoints.md)."""
        model, optimizer = self.model, self.optimizer
        model_state = sharded_model_state(model)
        self._fill(checkpoint, state, model_state, layout.MODEL_SECTION, layout.MODEL_FILE)
        set_model_state_dict(model, model_state)
        del model_state
        trim_host_heap()  # what the model's load freed (FSDP1 gathers each unit) goes back before the optimizer's
        # No template without a state to load: making one gives AdamW a state with a zero step, taken by nothing.
        if not state["has_optimizer"]:
            get_logger().warning("checkpoint %s has no optimizer state: AdamW starts afresh", checkpoint)
            return
        optimizer_state = sharded_optimizer_template(model, optimizer)
        self._fill(checkpoint, state, optimizer_state, layout.OPTIMIZER_SECTION, layout.OPTIMIZER_FILE)
        with open(os.path.join(checkpoint, layout.PARAM_GROUPS_FILE), encoding="utf-8") as f:
            groups = param_groups_from_json(json.load(f))
        set_optimizer_state(model, optimizer, {"state": optimizer_state, "param_groups": groups}, full=False)

    @staticmethod
    def _fill(checkpoint: str, state: dict, template: dict, section: str, file_name: str) -> None:
        """Fill a template of this rank's shards from the checkpoint: SHARDED's `section` through DCP (collective),
        FULL's `file_name` memory-mapped (each rank pages in its own rows, not the file)."""
        if state["checkpoint_type"] == layout.FULL:
            file = os.path.join(checkpoint, file_name)
            fill_from_full(template, torch.load(file, map_location="cpu", weights_only=True, mmap=True), file)
        else:
            dcp.load({section: template}, storage_reader=SafeFileSystemReader(checkpoint))

    def _restore_rng(self, checkpoint: str, saved_world_size: int) -> None:
        if saved_world_size != self.info.world_size:
            get_logger().warning(
                "checkpoint was written by %d ranks, this run has %d: dropout's random stream restarts, so "
                "losses continue statistically, not bit for bit", saved_world_size, self.info.world_size,
            )  # fmt: skip
            return
        rng = torch.load(layout.rng_file(checkpoint, self.info.rank), map_location="cpu", weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and self.info.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.info.device)


def state_bytes(model: nn.Module, numel: int, save_optimizer: bool) -> int:
    """About the checkpoint bytes of `numel` parameter elements: fp32, with the optimizer AdamW's two moments of
    the trainable share."""
    trainable, total = trainable_share(model)  # LoRA: the optimizer holds moments of the adapters only
    return int(numel * 4 * (1 + (2 * trainable / max(1, total) if save_optimizer else 0)))


FULL_SAVE_WARNING_BYTES = 10**10  # t5-3b's model and AdamW in fp32 are 34 GB; t5-large's 9 GB


def say_if_full_saves_are_large(checkpoint_bytes: int) -> None:
    """Rank 0, once: the warning that a large model's FULL saves are gathered and written by rank 0 alone."""
    if checkpoint_bytes > FULL_SAVE_WARNING_BYTES:
        get_logger().warning(
            "--checkpoint_type FULL_STATE_DICT: each checkpoint, about %.0f GB (model and optimizer in fp32), is "
            "gathered into rank 0's host memory and written by rank 0 alone; a stop's save may not fit in the "
            "time a preemption leaves (TORCH_ELASTIC_SHUTDOWN_TIMEOUT). --checkpoint_type SHARDED_STATE_DICT "
            "has every rank write its share at once (docs/checkpoints.md: large models)",
            checkpoint_bytes / 1e9,
        )


def restore_schedule(
    scheduler: LRScheduler, optimizer: torch.optim.Optimizer, state: dict, this_runs_lrs: list
) -> None:
    """The schedule's position from a checkpoint's train state, with this run's settings: this run's --gamma
    (StepLR's saved state would put the saved run's back), and a resume given another --lr scales the schedule to
    it from here on. A checkpoint without optimizer state leaves fresh groups at the rate the schedule reached."""
    gamma = getattr(scheduler, "gamma", None)
    scheduler.load_state_dict(state["scheduler"])
    if gamma is not None:
        scheduler.gamma = gamma
    # A per-step schedule's checkpoint records where it stands (utils/train/optim.py: StretchableSchedule); one
    # written before it did keeps counting steps as it did then.
    recorded = state["scheduler"].get("lr_lambdas") or []
    for schedule, saved in zip(getattr(scheduler, "lr_lambdas", []), recorded, strict=False):
        if saved is None and hasattr(schedule, "stretches"):
            schedule.stretches = False
    groups = optimizer.param_groups
    if not state["has_optimizer"]:
        reached, bases = scheduler.get_last_lr(), scheduler.base_lrs
        for index, group in enumerate(groups):  # one rate for every group: the decay groups share it
            group["lr"], group["initial_lr"] = reached[index % len(reached)], bases[index % len(bases)]
    saved = [group["initial_lr"] for group in groups]
    scheduler.base_lrs = list(this_runs_lrs)  # what the schedule scales from now on
    if saved == this_runs_lrs:
        return
    for group, base, old in zip(groups, this_runs_lrs, saved, strict=True):
        group["lr"] *= base / old
        group["initial_lr"] = base
    get_logger().info(
        "learning rate: --lr %g where the checkpoint's run had %g; the schedule goes on scaled by %g",
        this_runs_lrs[0], saved[0], this_runs_lrs[0] / saved[0],
    )  # fmt: skip
