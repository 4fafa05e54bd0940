"""Fine-tune T5 on WikiHow summarization with FSDP.

    torchrun --nproc_per_node N T5_training.py [--field value ...]

Every field of configs/training.py and configs/fsdp.py is a flag; `--help` lists them. Without arguments
it trains the embedded tiny T5 on the embedded WikiHow sample (offline, CPU or GPU).
"""

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
from utils.environment import destroy_distributed, init_distributed, launcher_ranks
from utils.errors import ConfigError, UserError
from utils.fsdp_setup import choose_precision, log_fsdp_layout, wrap_model
from utils.hf_export import export_hf_model
from utils.logging_utils import get_logger, setup_logging
from utils.memory_account import memory_records
from utils.preemption import StopRequest
from utils.run_setup import build_loaders, checkpoint_writer, load_model_for_run, open_metrics, write_run_config
from utils.train_checkpoint import (
    LOAD_ERRORS,
    TrainProgress,
    complete_checkpoints,
    load_training_state,
    resolve_resume_path,
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
    """config -> model + tokenizer -> loaders -> FSDP model -> train/validate -> checkpoints, metrics, export."""
    info = init_distributed(train_config.device, train_config.dist_timeout_s)
    torch.manual_seed(train_config.seed)
    output_dir = train_config.output_dir
    rank0_decides(lambda: prepare_output_dir(output_dir))
    resume_from = rank0_decides(lambda: choose_start(train_config.resume, output_dir))
    precision = choose_precision(fsdp_config, info.device)
    check_csv_header(require_csv(train_config.data_dir))  # before the model: seconds, not minutes

    loaded = load_model_for_run(train_config.model_name, fsdp_config, info.is_main, resume_from)
    model_config, tokenizer = loaded.model.config, loaded.tokenizer
    loaders = build_loaders(tokenizer, train_config, info)
    model = wrap_model(loaded.model, fsdp_config, info.device, precision, loaded.weights_source)
    log_fsdp_layout(model, precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_config.lr, weight_decay=train_config.weight_decay)
    scheduler = StepLR(optimizer, step_size=1, gamma=train_config.gamma)
    # fp16 gradients underflow without loss scaling; the sharded scaler agrees on inf/NaN across ranks.
    scaler = ShardedGradScaler(device=info.device.type) if precision == "fpSixteen" else None
    progress = TrainProgress()
    if loaded.resume_state is not None:
        progress = load_training_state(
            resume_from, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, info=info
        )
        get_logger().info("resumed from %s: epoch %d, step %d", resume_from, progress.epoch, progress.global_step)
    elif resume_from:
        get_logger().info("started from the weights of %s (new optimizer, epoch 1)", resume_from)

    metrics = open_metrics(output_dir, info.is_main, progress if loaded.resume_state is not None else None)
    try:
        write_run_config(train_config, fsdp_config, info, precision, resume_from)
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
        save_checkpoint = checkpoint_writer(
            train_config,
            fsdp_config,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            model_config=model_config,
            tokenizer=tokenizer,
            info=info,
        )

        def write_memory_account() -> None:
            for record in memory_records(
                model,
                optimizer,
                device=info.device,
                load_rss_delta_bytes=loaded.load_rss_delta_bytes,
                param_numel_total=loaded.param_numel_total,
            ):
                metrics.write(record)

        with StopRequest() as stop:
            finished = fit(
                model,
                optimizer,
                scheduler,
                scaler,
                train_loader=loaders.train,
                train_sampler=loaders.train_sampler,
                val_loader=loaders.val,
                val_num_real_samples=loaders.val_num_real_samples,
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
