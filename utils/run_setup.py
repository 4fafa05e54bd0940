"""The pieces T5_training.run assembles: the model as this run needs it, the loaders, the run record and
the checkpoint writer. Each takes plain values and does one thing."""

import functools
import os
from dataclasses import dataclass

from torch import nn
from torch.utils.data import DataLoader

from configs.fsdp import FSDPConfig
from configs.training import TrainConfig
from utils.data_loading import (
    PaddedEvalSampler,
    ResumableDistributedSampler,
    build_dataset,
    build_loader,
    train_sampler_for,
)
from utils.environment import DistInfo
from utils.logging_utils import get_logger
from utils.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from utils.metrics import MetricsWriter, run_record, truncate_metrics_for_resume, write_json_atomic
from utils.model_builder import load_model_and_tokenizer
from utils.train_checkpoint import (
    TrainProgress,
    load_full_model_weights,
    read_train_state,
    save_training_checkpoint,
)


@dataclass
class LoadedModel:
    model: nn.Module  # unwrapped; on the meta device where rank-0-only loading leaves it empty
    tokenizer: object
    load_rss_delta_bytes: int  # what building/loading the model made resident on this rank
    param_numel_total: int  # tied weights counted once
    resume_state: dict | None  # train_state.json of the checkpoint resumed from, if any
    weights_source: str  # where rank-0-only loading reads the weights: the model, or a full checkpoint


def load_model_for_run(model_name: str, fsdp_config: FSDPConfig, is_main: bool, resume_from: str | None):
    """The unwrapped model and tokenizer, with the weights of a full checkpoint when resuming from one.

    Rank-0-only loading: FSDP2 broadcasts rank 0's loaded model after sharding (the others build on meta);
    FSDP1 materialises every rank's meta model unit by unit from rank 0's reads of the weight files.
    """
    on_meta = fsdp_config.cpu_ram_efficient_loading and (fsdp_config.fsdp_version == 1 or not is_main)
    reset_peak_rss()
    rss_before = current_rss_bytes()
    model, tokenizer = load_model_and_tokenizer(model_name, on_meta=on_meta)
    load_rss_delta = peak_rss_bytes() - rss_before
    resume_state = read_train_state(resume_from) if resume_from and os.path.isdir(resume_from) else None
    weights_source = model_name
    if resume_from and (resume_state is None or resume_state["checkpoint_type"] == "FULL_STATE_DICT"):
        # A full state dict goes into the unwrapped model; FSDP then shards it (the tutorial's way).
        weights_source = resume_from
        if not on_meta:
            load_full_model_weights(model, resume_from)
    param_numel_total = sum(p.numel() for p in model.parameters())
    return LoadedModel(model, tokenizer, load_rss_delta, param_numel_total, resume_state, weights_source)


@dataclass
class Loaders:
    train: DataLoader
    train_sampler: ResumableDistributedSampler
    val: DataLoader | None
    val_num_real_samples: int  # this rank's validation samples that are not padding repeats


def build_loaders(tokenizer, train_config: TrainConfig, info: DistInfo) -> Loaders:
    """Datasets, samplers and loaders of this rank. Needs the process group."""
    train_set = build_dataset(tokenizer, "train", train_config.num_train_samples, train_config, info.world_size)
    train_sampler = train_sampler_for(train_set, info.rank, info.world_size, train_config.seed)
    loader_args = dict(
        pad_token_id=tokenizer.pad_token_id, num_workers=train_config.num_workers_dataloader, device=info.device
    )
    train = build_loader(train_set, train_sampler, train_config.batch_size_training, **loader_args)
    val, val_num_real = None, 0
    if train_config.run_validation:
        val_set = build_dataset(
            tokenizer, "validation", train_config.num_val_samples, train_config, info.world_size
        )
        val_sampler = PaddedEvalSampler(len(val_set), info.rank, info.world_size)
        val = build_loader(val_set, val_sampler, train_config.val_batch_size, **loader_args)
        val_num_real = val_sampler.num_real_samples
    get_logger().info("samples: train %d, validation %s", len(train_set), len(val.dataset) if val else "-")
    return Loaders(train, train_sampler, val, val_num_real)


def open_metrics(output_dir: str, is_main: bool, resumed_progress: TrainProgress | None) -> MetricsWriter:
    """metrics.jsonl, cut back to the checkpoint's step when resuming (rank 0 writes; others ignore)."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if is_main and resumed_progress is not None:
        truncate_metrics_for_resume(path, resumed_progress.global_step, resumed_progress.epoch)
    return MetricsWriter(path, enabled=is_main, append=resumed_progress is not None)


def write_run_config(
    train_config: TrainConfig, fsdp_config: FSDPConfig, info: DistInfo, precision: str, resume_from: str | None
) -> None:
    """output_dir/config.json (rank 0)."""
    if not info.is_main:
        return
    record = run_record(
        train_config,
        fsdp_config,
        world_size=info.world_size,
        backend=info.backend,
        device=str(info.device),
        precision=precision,
    )
    record["resumed_from"] = resume_from
    write_json_atomic(os.path.join(train_config.output_dir, "config.json"), record)


def checkpoint_writer(
    train_config: TrainConfig,
    fsdp_config: FSDPConfig,
    *,
    model,
    optimizer,
    scheduler,
    scaler,
    model_config,
    tokenizer,
    info: DistInfo,
):
    """`save(progress=...)` writing a resumable checkpoint, or None when --keep_last_n is 0."""
    if train_config.keep_last_n == 0:
        return None
    return functools.partial(
        save_training_checkpoint,
        output_dir=train_config.output_dir,
        checkpoint_type=fsdp_config.checkpoint_type,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        model_config=model_config,
        tokenizer=tokenizer,
        save_optimizer=fsdp_config.save_optimizer,
        keep_last_n=train_config.keep_last_n,
        info=info,
    )
