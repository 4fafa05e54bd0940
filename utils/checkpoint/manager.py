"""Resumable checkpoints (model, optimizer, LR scheduler, grad scaler, progress, RNG) and the final saves.

The layout of a checkpoint folder is in utils/layout.py. A checkpoint is written under
`checkpoints/.tmp_step_...` and renamed when every rank has finished, so a crash during a save leaves only
an ignored temporary folder, and the previous checkpoints stay loadable; old ones are pruned only after a
newer one is complete.

With --async_checkpoint the shards are written by a background thread (DCP's `async_save`, on a gloo group
of its own so that its collectives never interleave with training's): training stops only while they are
copied to host memory. DCP's last save step gathers every rank's write result on rank 0 before rank 0
writes `.metadata`, so when rank 0's write has finished every rank's has; rank 0 then completes the
checkpoint (train_state.json, rename, prune) without another collective, as soon as it sees that between
two steps. At most one save is in flight: the next save, the exports and the end of the run wait for it.

Nothing here unpickles arbitrary objects: .pt files load with weights_only=True, the DCP payload holds
tensors only (the optimizer's non-tensor hyper-parameters are JSON), and DCP's `.metadata` file, a pickle,
is read by utils/checkpoint/safe_dcp.py.
"""

import copy
import json
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from datetime import datetime

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim.lr_scheduler import LRScheduler

from configs.checkpointing import CheckpointConfig
from configs.errors import FAILURES, CheckpointError, error_summary
from configs.fsdp import FSDPConfig
from configs.lora import LoraConfig
from utils import layout
from utils.checkpoint.hf_export import lora_exports, write_adapter_folder, write_model_folder
from utils.checkpoint.progress import TrainProgress
from utils.checkpoint.safe_dcp import SafeFileSystemReader
from utils.checkpoint.start import StartPoint, read_train_state
from utils.checkpoint.state_dicts import (
    model_and_optimizer_state,
    param_groups_from_json,
    save_full_model,
    set_optimizer_state,
    sharded_model_state,
    tensor_only_optimizer_state,
)
from utils.distributed.process_group import DistInfo
from utils.files import disk_bytes, write_json
from utils.log import get_logger


@dataclass
class BackgroundSave:
    """A checkpoint whose shards a background thread is writing."""

    future: Future  # this rank's part of DCP's async_save
    tmp: str
    final: str
    train_state: dict  # taken when the save started (training has moved on since); rank 0 writes it last
    started: float
    stalled_s: float  # how long training stopped for it


class CheckpointManager:
    """Owns output_dir's checkpoints/, the --save_model .pt files and hf_model/ for one run: handed the
    model, optimizer, scheduler and scaler once, it decides when to save (`due`), saves, prunes, loads where
    the run starts from, and exports.

    Every saving or loading method is collective: every rank calls it, rank 0 writes the shared files.
    """

    def __init__(
        self,
        checkpointing: CheckpointConfig,
        fsdp: FSDPConfig,
        output_dir: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: LRScheduler,
        scaler: ShardedGradScaler | None,
        model_config,
        tokenizer,
        info: DistInfo,
        lora: LoraConfig,
        base_model: str,
    ):
        self.checkpointing = checkpointing
        self.checkpoint_type = fsdp.checkpoint_type  # the tutorial's fsdp_config fields
        self.save_optimizer = fsdp.save_optimizer
        self.output_dir = output_dir
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.info = info
        self.lora = lora if lora.peft == "lora" else None  # the export writes the adapter (and merged model)
        self.base_model = base_model  # what the adapter names as its base (utils/model/lora.py: adapter_base)
        self.run_id = datetime.now().strftime("%Y%m%d-%H%M%S")  # names this run's .pt files
        # Background writes talk over a gloo group of their own (collective: every rank creates it). Their
        # writer also stages: it copies FSDP1's ShardedTensors and FSDP2's DTensors alike (DCP's default
        # stager cannot copy ShardedTensors), and on GPU into pinned host buffers kept for the next save.
        self.background_group, self.background_writer = None, None
        if checkpointing.async_checkpoint:
            self.background_group = dist.new_group(backend="gloo")
            self.background_writer = FileSystemWriter(
                layout.checkpoint_root(output_dir), cache_staged_state_dict=info.device.type == "cuda"
            )
        self.pending: BackgroundSave | None = None

    # ------------------------------------------------------------------------------------ resumable

    def due(self, step: int, stop_requested: bool) -> bool:
        """Whether a checkpoint is to be written after `step` inside an epoch (epoch ends always save)."""
        periodic = self.checkpointing.save_every_n_steps > 0 and step % self.checkpointing.save_every_n_steps == 0
        return self.checkpointing.keep_last_n > 0 and (periodic or stop_requested)

    def save(self, progress: TrainProgress, blocking: bool = False) -> str | None:
        """Write a checkpoint of the current state (nothing with --keep_last_n 0). Returns its folder.

        With --async_checkpoint and not `blocking` (a SIGTERM save is), it returns once the shards are staged
        in host memory; the folder appears when their background write has finished (see `poll`)."""
        if self.checkpointing.keep_last_n == 0:
            return None
        self.finish_pending()  # at most one save in flight
        started = time.perf_counter()
        root = layout.checkpoint_root(self.output_dir)
        name = layout.step_dir_name(progress.global_step)
        final, tmp = os.path.join(root, name), os.path.join(root, layout.TMP_PREFIX + name)
        if self.info.is_main:
            if os.path.exists(tmp):  # left by a save that crashed
                shutil.rmtree(tmp)
            os.makedirs(os.path.join(tmp, layout.RNG_DIR))
        dist.barrier()
        train_state = self._train_state(progress)
        full = self.checkpoint_type == layout.FULL
        model_state, optim_state = model_and_optimizer_state(self.model, self.optimizer, full, self.info.device)
        self._write_small_files(tmp, optim_state)
        if full:
            # With CPU offload (GPU runs) only rank 0 receives the gathered state; the others get {}.
            if self.info.is_main:
                torch.save(model_state, os.path.join(tmp, layout.MODEL_FILE))
                if self.save_optimizer:
                    optimizer_file = os.path.join(tmp, layout.OPTIMIZER_FILE)
                    torch.save(tensor_only_optimizer_state(optim_state), optimizer_file)
        else:
            payload = {layout.MODEL_SECTION: model_state}
            if self.save_optimizer:
                payload[layout.OPTIMIZER_SECTION] = tensor_only_optimizer_state(optim_state)
            if self.background_group is not None and not blocking:
                dist.barrier()  # every rank's small files are on disk before rank 0 may complete the folder
                # Staged (copied to host memory) before it returns; written by a thread on the gloo group.
                future = dcp.async_save(
                    payload,
                    checkpoint_id=tmp,
                    storage_writer=self.background_writer,
                    process_group=self.background_group,
                )
                stalled = time.perf_counter() - started
                self.pending = BackgroundSave(future, tmp, final, train_state, started, stalled)
                get_logger().info(
                    "checkpoint %s: training resumes after %.2f s; written in the background", final, stalled
                )
                return final
            dcp.save(payload, checkpoint_id=tmp)  # collective; each rank writes its own shards
        dist.barrier()  # every rank's files are on disk
        if self.info.is_main:
            self._complete(tmp, final, train_state, f"in {time.perf_counter() - started:.2f} s")
        dist.barrier()
        return final

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
            raise CheckpointError(
                f"the background write of {pending.final} failed: {error_summary(err)}. The previous checkpoint "
                "stays the newest complete one."
            ) from None
        if self.info.is_main:
            written = time.perf_counter() - pending.started
            detail = f"in the background in {written:.2f} s; training stopped {pending.stalled_s:.2f} s"
            self._complete(pending.tmp, pending.final, pending.train_state, detail)

    def _write_small_files(self, folder: str, optim_state: dict) -> None:
        """Every rank's RNG state; on rank 0 the optimizer's parameter groups, the model config, the tokenizer."""
        torch.save(_rng_state(self.info.device), layout.rng_file(folder, self.info.rank))
        if self.info.is_main:
            if self.save_optimizer:
                write_json(os.path.join(folder, layout.PARAM_GROUPS_FILE), optim_state["param_groups"])
            self.model_config.save_pretrained(folder)
            self.tokenizer.save_pretrained(os.path.join(folder, layout.TOKENIZER_DIR))

    def _train_state(self, progress: TrainProgress) -> dict:
        """What train_state.json holds, as of now (a copy: a background save writes it steps later)."""
        scaler = self.scaler
        return copy.deepcopy({
            "format_version": layout.FORMAT_VERSION,
            "checkpoint_type": self.checkpoint_type,
            "has_optimizer": self.save_optimizer,
            "world_size": self.info.world_size,
            "progress": asdict(progress),
            "scheduler": self.scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
        })  # fmt: skip

    def _complete(self, tmp: str, final: str, train_state: dict, how: str) -> None:
        """Rank 0, once every rank's files are on disk: train_state.json last (its presence marks the checkpoint
        complete), the rename, then the pruning of older ones."""
        write_json(os.path.join(tmp, layout.STATE_FILE), train_state)
        if os.path.exists(final):  # the same step saved again (SIGTERM right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        get_logger().info(
            "checkpoint %s (%s): %.1f MB %s", final, self.checkpoint_type, disk_bytes(final) / 1e6, how
        )
        self._prune()

    def _prune(self) -> None:
        """Delete all but the newest keep_last_n complete checkpoints (only after a new one is complete)."""
        for old in layout.complete_checkpoints(self.output_dir)[: -self.checkpointing.keep_last_n]:
            shutil.rmtree(old)
            get_logger().info("removed old checkpoint %s (keep_last_n=%d)", old, self.checkpointing.keep_last_n)

    def load(self, start: StartPoint) -> TrainProgress:
        """Continue from where the run starts: a checkpoint folder's optimizer, scheduler, scaler, RNG and
        progress, and its weights when sharded (a full checkpoint's or a .pt's weights went into the
        unwrapped model before sharding: StartPoint.weights_file). The progress to train from. Collective."""
        if not start.is_checkpoint:
            if start.path:
                get_logger().info("started from the weights of %s (new optimizer, epoch 1)", start.path)
            return TrainProgress()
        checkpoint = start.path
        state = read_train_state(checkpoint)
        try:
            self._load_model_and_optimizer(checkpoint, state)
        except FAILURES as err:  # every failure becomes one message naming the checkpoint
            raise CheckpointError(
                f"cannot resume from {checkpoint}: {error_summary(err)}. The checkpoint is corrupt or was "
                "written for another model or optimizer; resume from another checkpoint (--resume PATH) or "
                "start a new output_dir."
            ) from None
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._restore_rng(checkpoint, state["world_size"])
        progress = TrainProgress(**state["progress"])
        get_logger().info("resumed from %s: epoch %d, step %d", checkpoint, progress.epoch, progress.global_step)
        return progress

    def _load_model_and_optimizer(self, checkpoint: str, state: dict) -> None:
        model, optimizer = self.model, self.optimizer
        full = state["checkpoint_type"] == layout.FULL
        has_optimizer = state["has_optimizer"]
        if full:
            optim_state = {}
            if has_optimizer:
                file = os.path.join(checkpoint, layout.OPTIMIZER_FILE)
                optim_state["state"] = torch.load(file, map_location="cpu", weights_only=True)
        else:
            # Templates with this run's sharding: DCP loads into them in place, resharding as needed. The
            # optimizer's template only when there is a state to load: asking for it makes torch initialise
            # AdamW's state with a zero step, and an optimizer that "starts afresh" must not have taken one.
            if has_optimizer:
                model_state, optim_state = model_and_optimizer_state(model, optimizer, False, self.info.device)
                optimizer_state = tensor_only_optimizer_state(optim_state)
                payload = {layout.MODEL_SECTION: model_state, layout.OPTIMIZER_SECTION: optimizer_state}
            else:
                payload = {layout.MODEL_SECTION: sharded_model_state(model)}
            dcp.load(payload, storage_reader=SafeFileSystemReader(checkpoint))  # collective
            set_model_state_dict(model, payload[layout.MODEL_SECTION])
            optim_state = {"state": payload.get(layout.OPTIMIZER_SECTION)}
        if not has_optimizer:
            get_logger().warning("checkpoint %s has no optimizer state: AdamW starts afresh", checkpoint)
            return
        with open(os.path.join(checkpoint, layout.PARAM_GROUPS_FILE), encoding="utf-8") as f:
            optim_state["param_groups"] = param_groups_from_json(json.load(f))
        set_optimizer_state(model, optimizer, optim_state, full)

    def _restore_rng(self, checkpoint: str, saved_world_size: int) -> None:
        file = layout.rng_file(checkpoint, self.info.rank)
        if saved_world_size != self.info.world_size or not os.path.isfile(file):
            get_logger().warning(
                "checkpoint was written by %d ranks, this run has %d: dropout's random stream restarts, so "
                "losses continue statistically, not bit for bit",
                saved_world_size,
                self.info.world_size,
            )
            return
        rng = torch.load(file, map_location="cpu", weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and self.info.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.info.device)

    # ------------------------------------------------------------------------------ final models

    def save_full_model(self, epoch: int, val_loss: float | None) -> str | None:
        """The tutorial's full state dict .pt, named by run, epoch and loss (rank 0 writes it)."""
        self.finish_pending()
        name = layout.best_model_filename(self.run_id, epoch, val_loss)
        return save_full_model(
            self.model,
            self.info.device,
            self.info.is_main,
            os.path.join(self.output_dir, name),
        )

    def export_hf(self, last: bool = False) -> str | None:
        """Write output_dir/hf_model (or, `last`, hf_model_last) from the shards: every rank writes its own
        rows, no rank gathers the model (utils/checkpoint/hf_export.py). With --peft lora, the adapter folder
        (and with --merge_lora the merged model). Collective. Returns the folder on rank 0."""
        self.finish_pending()
        started = time.perf_counter()
        is_main = self.info.is_main
        folder = os.path.join(self.output_dir, layout.HF_LAST_DIR if last else layout.HF_DIR)
        state = sharded_model_state(self.model)
        if self.lora is not None:  # the adapter beside where the model goes, and the merged model if asked for
            adapters, state = lora_exports(state, self.lora, self.info.device)
            adapter_folder = os.path.join(self.output_dir, layout.HF_ADAPTER_DIR + ("_last" if last else ""))
            if is_main:
                lora, config = self.lora, self.model_config
                write_adapter_folder(adapters, config, lora, self.base_model, self.tokenizer, adapter_folder)
                get_logger().info("LoRA adapter written: %s (PeftModel.from_pretrained-loadable)", adapter_folder)
            if state is None:
                return adapter_folder if is_main else None
        max_file_bytes = int(self.checkpointing.export_max_file_gb * 1e9)
        files = write_model_folder(state, self.model_config, self.tokenizer, folder, max_file_bytes, is_main)
        get_logger().info(
            "model written from the shards: %s (%d safetensors file(s), %.1f s; from_pretrained-loadable)",
            folder,
            files,
            time.perf_counter() - started,
        )
        return folder if is_main else None


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state
