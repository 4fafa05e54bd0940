"""Fine-tune T5 on WikiHow summarization with FSDP.

    torchrun --nproc_per_node N T5_training.py [--field value ...]

Every field of configs/training.py and configs/fsdp.py is a flag; `--help` lists them. Without arguments
it trains the embedded tiny T5 on the embedded WikiHow sample (offline, CPU or GPU).
"""

import functools
import os
import sys
import time
from collections.abc import Callable
from datetime import datetime

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim.lr_scheduler import StepLR

from configs.cli import parse_args
from configs.fsdp import FSDPConfig
from configs.training import TrainConfig
from summarization_dataset import check_csv_header, require_csv
from utils.data_loading import PaddedEvalSampler, build_dataset, build_loader, train_sampler_for
from utils.environment import destroy_distributed, init_distributed, launcher_ranks
from utils.errors import ConfigError, UserError
from utils.fsdp_setup import choose_precision, log_fsdp_layout, wrap_model
from utils.hf_export import export_hf_model
from utils.logging_utils import get_logger, setup_logging
from utils.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from utils.memory_account import memory_records
from utils.metrics import MetricsWriter, run_record, truncate_metrics_for_resume, write_json_atomic
from utils.model_builder import load_model_and_tokenizer
from utils.preemption import StopRequest
from utils.train_checkpoint import (
    LOAD_ERRORS,
    TrainProgress,
    complete_checkpoints,
    load_full_model_weights,
    load_training_state,
    read_train_state,
    resolve_resume_path,
    save_training_checkpoint,
)
from utils.trainer import LoopSettings, fit

RANK0_MESSAGE_GRACE_S = 2.0


def rank0_decides(decide: Callable[[], object]) -> object:
    """Run `decide` on rank 0 only and give every rank its result, or its UserError. Collective.

    For checks of the shared file system: one rank looks, and all ranks fail together with its message.
    """
    outcome: list = [None, None]
    if dist.get_rank() == 0:
        try:
            outcome = [decide(), None]
        except UserError as err:
            outcome = [None, err]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


def prepare_output_dir(output_dir: str) -> None:
    """Create output_dir and check it is writable."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        probe = os.path.join(output_dir, f".write_test_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise ConfigError(
            f"output_dir {output_dir!r} is not writable ({err.strerror}); choose another --output_dir"
        ) from None


def choose_start(resume: str, output_dir: str) -> str | None:
    """The checkpoint to resume from (None: a new run); refuses to start a new run over an old one."""
    path = resolve_resume_path(resume, output_dir)
    old_run = os.path.isfile(os.path.join(output_dir, "metrics.jsonl")) or complete_checkpoints(output_dir)
    if resume.lower() == "false" and old_run:
        raise ConfigError(
            f"output_dir {output_dir!r} already holds a run (metrics.jsonl, checkpoints/): continue it with "
            "--resume true, or choose a new --output_dir. Nothing was changed."
        )
    return path


def run(train_config: TrainConfig, fsdp_config: FSDPConfig) -> None:
    info = init_distributed(train_config.device, train_config.dist_timeout_s)
    torch.manual_seed(train_config.seed)
    output_dir = train_config.output_dir
    rank0_decides(lambda: prepare_output_dir(output_dir))
    resume_from = rank0_decides(lambda: choose_start(train_config.resume, output_dir))
    precision = choose_precision(fsdp_config, info.device)
    check_csv_header(require_csv(train_config.data_dir))  # before the model: seconds, not minutes

    # Rank-0-only loading: FSDP2 broadcasts rank 0's loaded model after sharding (the others build on meta);
    # FSDP1 materialises every rank's meta model unit by unit from rank 0's reads of the weight files.
    on_meta = fsdp_config.cpu_ram_efficient_loading and (fsdp_config.fsdp_version == 1 or not info.is_main)
    reset_peak_rss()
    rss_before = current_rss_bytes()
    model, tokenizer = load_model_and_tokenizer(train_config.model_name, on_meta=on_meta)
    load_rss_delta = peak_rss_bytes() - rss_before  # what building/loading the model cost this rank
    param_numel_total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    model_config = model.config
    resume_state = read_train_state(resume_from) if resume_from and os.path.isdir(resume_from) else None
    weights_source = train_config.model_name
    if resume_from and (resume_state is None or resume_state["checkpoint_type"] == "FULL_STATE_DICT"):
        # A full state dict goes into the unwrapped model; FSDP then shards it (the tutorial's way).
        weights_source = resume_from
        if not on_meta:
            load_full_model_weights(model, resume_from)
    train_set = build_dataset(tokenizer, "train", train_config.num_train_samples, train_config, info.world_size)
    train_sampler = train_sampler_for(train_set, info.rank, info.world_size, train_config.seed)
    loader_args = dict(
        pad_token_id=tokenizer.pad_token_id, num_workers=train_config.num_workers_dataloader, device=info.device
    )
    train_loader = build_loader(train_set, train_sampler, train_config.batch_size_training, **loader_args)
    val_loader, val_num_real = None, 0
    if train_config.run_validation:
        val_set = build_dataset(
            tokenizer, "validation", train_config.num_val_samples, train_config, info.world_size
        )
        val_sampler = PaddedEvalSampler(len(val_set), info.rank, info.world_size)
        val_loader = build_loader(val_set, val_sampler, train_config.val_batch_size, **loader_args)
        val_num_real = val_sampler.num_real_samples
    get_logger().info(
        "samples: train %d, validation %s", len(train_set), len(val_loader.dataset) if val_loader else "-"
    )

    model = wrap_model(model, fsdp_config, info.device, precision, weights_source)
    log_fsdp_layout(model, precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_config.lr, weight_decay=train_config.weight_decay)
    scheduler = StepLR(optimizer, step_size=1, gamma=train_config.gamma)
    # fp16 gradients underflow without loss scaling; the sharded scaler agrees on inf/NaN across ranks.
    scaler = ShardedGradScaler(device=info.device.type) if precision == "fpSixteen" else None
    progress = TrainProgress()
    if resume_state is not None:
        progress = load_training_state(
            resume_from, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, info=info
        )
        get_logger().info("resumed from %s: epoch %d, step %d", resume_from, progress.epoch, progress.global_step)
    elif resume_from:
        get_logger().info("started from the weights of %s (new optimizer, epoch 1)", resume_from)

    metrics_path = os.path.join(output_dir, "metrics.jsonl")
    if info.is_main and resume_state is not None:
        truncate_metrics_for_resume(metrics_path, progress.global_step, progress.epoch)
    metrics = MetricsWriter(metrics_path, enabled=info.is_main, append=resume_state is not None)
    try:
        if info.is_main:
            record = run_record(
                train_config,
                fsdp_config,
                world_size=info.world_size,
                backend=info.backend,
                device=str(info.device),
                precision=precision,
            )
            record["resumed_from"] = resume_from
            write_json_atomic(os.path.join(output_dir, "config.json"), record)
        settings = LoopSettings(
            epochs=train_config.epochs,
            batch_size=train_config.batch_size_training,
            log_every_n_steps=train_config.log_every_n_steps,
            save_every_n_steps=train_config.save_every_n_steps,
            track_memory=train_config.track_memory,
            save_model=train_config.save_model,
            output_dir=output_dir,
            run_id=datetime.now().strftime("%Y%m%d-%H%M%S"),
        )
        save_checkpoint = None
        if train_config.keep_last_n > 0:
            save_checkpoint = functools.partial(
                save_training_checkpoint,
                output_dir=output_dir,
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

        def write_memory_account() -> None:
            for record in memory_records(
                model,
                optimizer,
                device=info.device,
                load_rss_delta_bytes=load_rss_delta,
                param_numel_total=param_numel_total,
            ):
                metrics.write(record)

        with StopRequest() as stop:
            finished = fit(
                model,
                optimizer,
                scheduler,
                scaler,
                train_loader=train_loader,
                train_sampler=train_sampler,
                val_loader=val_loader,
                val_num_real_samples=val_num_real,
                info=info,
                settings=settings,
                metrics=metrics,
                progress=progress,
                save_checkpoint=save_checkpoint,
                stop=stop,
                after_first_step=write_memory_account,
            )
        if finished:
            export_hf_model(model, model_config, tokenizer, output_dir, info)
        # No rank tears its process group down while another still communicates (seen once as an abort,
        # "terminate called without an active exception", on a loaded 2-core machine).
        dist.barrier()
    finally:
        metrics.close()


# Phrases of the errors a rank gets when a peer died mid-collective: a consequence, not the cause.
PEER_FAILURE_PHRASES = ("Connection closed by peer", "Connection reset by peer", "remote worker crash")


def is_peer_failure(err: BaseException) -> bool:
    return isinstance(err, dist.DistError) or any(phrase in str(err) for phrase in PEER_FAILURE_PHRASES)


@record
def main(argv: list[str] | None = None) -> int:
    rank, _, _ = launcher_ranks()
    setup_logging(rank)
    try:
        train_config, fsdp_config = parse_args(argv)
        run(train_config, fsdp_config)
    except UserError as err:
        # The same input error happens on every rank: rank 0 says it once, every rank exits non-zero.
        # torchrun stops the other ranks as soon as one exits non-zero; the other ranks wait a moment so
        # rank 0 is not killed before its message is out.
        if rank == 0:
            get_logger().error("%s", err)
        else:
            time.sleep(RANK0_MESSAGE_GRACE_S)
        return 2 if isinstance(err, ConfigError) else 1
    except LOAD_ERRORS as err:  # Exception, and DCP's CheckpointException (a BaseException)
        if is_peer_failure(err):
            # Another rank failed first and printed why; N copies of "connection closed" would bury it.
            get_logger().error("stopped: another rank failed (its error is above)")
        else:
            # Logged here once; re-raising would print it again, and again in torchrun's summary.
            get_logger().exception("failed: %s", err)
        return 1
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
