"""Resumable checkpoints (model, optimizer, LR scheduler, grad scaler, progress, RNG) and the final saves.

The layout of a checkpoint folder is in utils/checkpoint/layout.py. A checkpoint is written under
`checkpoints/.tmp_step_...` and renamed when every rank has finished, so a crash during a save leaves only
an ignored temporary folder, and the previous checkpoints stay loadable; old ones are pruned only after a
newer one is complete.

Nothing here unpickles arbitrary objects: .pt files load with weights_only=True, the DCP payload holds
tensors only (the optimizer's non-tensor hyper-parameters are JSON), and DCP's `.metadata` file, a pickle,
is read by utils/checkpoint/safe_dcp.py.
"""

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from datetime import datetime

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_model_state_dict

from configs.fsdp import FSDPConfig
from configs.training import TrainConfig
from utils.checkpoint import layout
from utils.checkpoint.hf_export import write_hf_folder
from utils.checkpoint.safe_dcp import SafeFileSystemReader
from utils.checkpoint.state_dicts import (
    gather_full_state_dict,
    model_and_optimizer_state,
    param_groups_from_json,
    save_full_model,
    set_optimizer_state,
    sharded_model_state,
    tensor_only_optimizer_state,
)
from utils.distributed.process_group import DistInfo
from utils.errors import FAILURES, CheckpointError, error_summary
from utils.files import disk_bytes, write_json
from utils.model.lora import LoraSettings, write_lora_folders
from utils.observe.log import get_logger
from utils.train.progress import TrainProgress
from utils.train.trainables import Trainables


@dataclass(frozen=True)
class CheckpointSettings:
    output_dir: str
    checkpoint_type: str  # layout.FULL or layout.SHARDED
    save_optimizer: bool
    keep_last_n: int  # 0: no resumable checkpoints
    every_n_steps: int  # 0: at epoch ends only
    lora: LoraSettings | None = None  # --peft lora: the export writes the adapter (and the merged model)

    @classmethod
    def from_configs(
        cls, train_config: TrainConfig, fsdp_config: FSDPConfig, lora: LoraSettings | None = None
    ) -> "CheckpointSettings":
        return cls(
            output_dir=train_config.output_dir,
            checkpoint_type=fsdp_config.checkpoint_type,
            save_optimizer=fsdp_config.save_optimizer,
            keep_last_n=train_config.keep_last_n,
            every_n_steps=train_config.save_every_n_steps,
            lora=lora,
        )


class Checkpointer:
    """Owns output_dir's checkpoints/, the --save_model .pt files and hf_model/ for one run.

    Every saving or loading method is collective: every rank calls it, rank 0 writes the shared files.
    """

    def __init__(
        self, settings: CheckpointSettings, trainables: Trainables, model_config, tokenizer, info: DistInfo
    ):
        self.settings = settings
        self.trainables = trainables
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.info = info
        self.run_id = datetime.now().strftime("%Y%m%d-%H%M%S")  # names this run's .pt files

    # ------------------------------------------------------------------------------------ resumable

    def due(self, step: int, stop_requested: bool) -> bool:
        """Whether a checkpoint is to be written after `step` inside an epoch (epoch ends always save)."""
        periodic = self.settings.every_n_steps > 0 and step % self.settings.every_n_steps == 0
        return self.settings.keep_last_n > 0 and (periodic or stop_requested)

    def save(self, progress: TrainProgress) -> str | None:
        """Write a checkpoint of the current state (nothing with --keep_last_n 0). Returns its folder."""
        if self.settings.keep_last_n == 0:
            return None
        started = time.perf_counter()
        root = layout.checkpoint_root(self.settings.output_dir)
        name = layout.step_dir_name(progress.global_step)
        final, tmp = os.path.join(root, name), os.path.join(root, layout.TMP_PREFIX + name)
        if self.info.is_main:
            if os.path.exists(tmp):  # left by a save that crashed
                shutil.rmtree(tmp)
            os.makedirs(os.path.join(tmp, layout.RNG_DIR))
        dist.barrier()
        self._write_state(tmp)
        dist.barrier()  # every rank's files are on disk
        if self.info.is_main:
            self._write_train_state(tmp, progress)
            if os.path.exists(final):  # the same step saved again (SIGTERM right after a periodic save)
                shutil.rmtree(final)
            os.replace(tmp, final)
            get_logger().info(
                "checkpoint %s (%s): %.1f MB in %.2f s",
                final,
                self.settings.checkpoint_type,
                disk_bytes(final) / 1e6,
                time.perf_counter() - started,
            )
            self._prune()
        dist.barrier()
        return final

    def _write_state(self, folder: str) -> None:
        """Model and optimizer (full on rank 0, or every rank's shards), RNG, config and tokenizer."""
        full = self.settings.checkpoint_type == layout.FULL
        model_state, optim_state = model_and_optimizer_state(
            self.trainables.model, self.trainables.optimizer, full, self.info.device
        )
        save_optimizer = self.settings.save_optimizer
        if full:
            # With CPU offload (GPU runs) only rank 0 receives the gathered state; the others get {}.
            if self.info.is_main:
                torch.save(model_state, os.path.join(folder, layout.MODEL_FILE))
                if save_optimizer:
                    optimizer_file = os.path.join(folder, layout.OPTIMIZER_FILE)
                    torch.save(tensor_only_optimizer_state(optim_state), optimizer_file)
        else:
            payload = {"model": model_state}
            if save_optimizer:
                payload["optim"] = tensor_only_optimizer_state(optim_state)
            dcp.save(payload, checkpoint_id=folder)  # collective; each rank writes its own shards
        torch.save(_rng_state(self.info.device), layout.rng_file(folder, self.info.rank))
        if self.info.is_main:
            if self.settings.save_optimizer:
                write_json(os.path.join(folder, layout.PARAM_GROUPS_FILE), optim_state["param_groups"])
            self.model_config.save_pretrained(folder)
            self.tokenizer.save_pretrained(os.path.join(folder, layout.TOKENIZER_DIR))

    def _write_train_state(self, folder: str, progress: TrainProgress) -> None:
        """train_state.json, written last: its presence marks the checkpoint complete."""
        scaler = self.trainables.scaler
        state = {
            "format_version": layout.FORMAT_VERSION,
            "checkpoint_type": self.settings.checkpoint_type,
            "has_optimizer": self.settings.save_optimizer,
            "world_size": self.info.world_size,
            "progress": asdict(progress),
            "scheduler": self.trainables.scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
        }
        write_json(os.path.join(folder, layout.STATE_FILE), state)

    def _prune(self) -> None:
        """Delete all but the newest keep_last_n complete checkpoints (only after a new one is complete)."""
        for old in layout.complete_checkpoints(self.settings.output_dir)[: -self.settings.keep_last_n]:
            shutil.rmtree(old)
            get_logger().info("removed old checkpoint %s (keep_last_n=%d)", old, self.settings.keep_last_n)

    def restore(self, checkpoint: str) -> TrainProgress:
        """Load a checkpoint into the wrapped model, optimizer, scheduler, scaler and RNG. Collective.

        A FULL_STATE_DICT checkpoint's weights were loaded into the unwrapped model before wrapping
        (layout.full_weights_file); this restores the rest.
        """
        state = layout.read_train_state(checkpoint)
        try:
            self._load_model_and_optimizer(checkpoint, state)
        except FAILURES as err:  # every failure becomes one message naming the checkpoint
            raise CheckpointError(
                f"cannot resume from {checkpoint}: {error_summary(err)}. The checkpoint is corrupt or was "
                "written for another model or optimizer; resume from another checkpoint (--resume PATH) or "
                "start a new output_dir."
            ) from None
        self.trainables.scheduler.load_state_dict(state["scheduler"])
        if self.trainables.scaler is not None and state["scaler"] is not None:
            self.trainables.scaler.load_state_dict(state["scaler"])
        self._restore_rng(checkpoint, state["world_size"])
        return TrainProgress(**state["progress"])

    def _load_model_and_optimizer(self, checkpoint: str, state: dict) -> None:
        model, optimizer = self.trainables.model, self.trainables.optimizer
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
                payload = {"model": model_state, "optim": tensor_only_optimizer_state(optim_state)}
            else:
                payload = {"model": sharded_model_state(model)}
            dcp.load(payload, storage_reader=SafeFileSystemReader(checkpoint))  # collective
            set_model_state_dict(model, payload["model"])
            optim_state = {"state": payload.get("optim")}
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
        name = layout.best_model_filename(self.run_id, epoch, val_loss)
        return save_full_model(
            self.trainables.model,
            self.info.device,
            self.info.is_main,
            os.path.join(self.settings.output_dir, name),
        )

    def export_hf(self, last: bool = False) -> str | None:
        """Gather the full model (collective) and write output_dir/hf_model (or, `last`, hf_model_last) on
        rank 0. Returns its path there."""
        state = gather_full_state_dict(self.trainables.model, self.info.device)
        if not self.info.is_main:
            return None
        folder = os.path.join(self.settings.output_dir, layout.HF_LAST_DIR if last else layout.HF_DIR)
        lora = self.settings.lora
        if lora is not None:  # the adapter beside where the model goes, and the merged model if asked for
            adapter = os.path.join(self.settings.output_dir, layout.HF_ADAPTER_DIR + ("_last" if last else ""))
            write_lora_folders(state, self.model_config, self.tokenizer, lora, (adapter, folder))
            get_logger().info("LoRA adapter written: %s (PeftModel.from_pretrained-loadable)", adapter)
            if not lora.merge:
                return adapter
        else:
            write_hf_folder(state, self.model_config, self.tokenizer, folder)
        get_logger().info("model written: %s (from_pretrained-loadable, safetensors)", folder)
        return folder


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state
