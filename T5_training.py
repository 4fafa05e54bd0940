"""Fine-tune T5 on WikiHow summarization with FSDP.

    torchrun --nproc_per_node N T5_training.py [--field value ...]

Every field of configs/training.py and configs/fsdp.py is a flag; `--help` lists them. Without arguments
it trains the embedded tiny T5 on the embedded WikiHow sample (offline, CPU or GPU).
"""

import os
import sys
import time
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
from utils.environment import DistInfo, destroy_distributed, init_distributed, launcher_ranks
from utils.errors import ConfigError, UserError
from utils.fsdp_setup import choose_precision, log_fsdp_layout, wrap_model
from utils.logging_utils import get_logger, setup_logging
from utils.metrics import MetricsWriter, run_record, write_json_atomic
from utils.model_builder import load_model_and_tokenizer
from utils.trainer import LoopSettings, fit

RANK0_MESSAGE_GRACE_S = 2.0


def check_output_dir(output_dir: str, info: DistInfo) -> None:
    """Rank 0 creates output_dir and checks it is writable; every rank learns the outcome (collective)."""
    problem = None
    if info.is_main:
        try:
            os.makedirs(output_dir, exist_ok=True)
            probe = os.path.join(output_dir, f".write_test_{os.getpid()}")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as err:
            problem = f"output_dir {output_dir!r} is not writable ({err.strerror}); choose another --output_dir"
    shared = [problem]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is not None:
        raise ConfigError(shared[0])


def run(train_config: TrainConfig, fsdp_config: FSDPConfig) -> None:
    info = init_distributed(train_config.device, train_config.dist_timeout_s)
    torch.manual_seed(train_config.seed)
    check_output_dir(train_config.output_dir, info)
    precision = choose_precision(fsdp_config, info.device)
    check_csv_header(require_csv(train_config.data_dir))  # before the model: seconds, not minutes

    model, tokenizer = load_model_and_tokenizer(train_config.model_name)
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

    model = wrap_model(model, fsdp_config, info.device, precision)
    log_fsdp_layout(model, precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_config.lr, weight_decay=train_config.weight_decay)
    scheduler = StepLR(optimizer, step_size=1, gamma=train_config.gamma)
    # fp16 gradients underflow without loss scaling; the sharded scaler agrees on inf/NaN across ranks.
    scaler = ShardedGradScaler(device=info.device.type) if precision == "fpSixteen" else None

    run_id = datetime.now().strftime("%Y%m%d-%H%M%S")
    metrics = MetricsWriter(os.path.join(train_config.output_dir, "metrics.jsonl"), enabled=info.is_main)
    try:
        if info.is_main:
            write_json_atomic(
                os.path.join(train_config.output_dir, "config.json"),
                run_record(
                    train_config,
                    fsdp_config,
                    world_size=info.world_size,
                    backend=info.backend,
                    device=str(info.device),
                    precision=precision,
                ),
            )
        settings = LoopSettings(
            epochs=train_config.epochs,
            log_every_n_steps=train_config.log_every_n_steps,
            track_memory=train_config.track_memory,
            save_model=train_config.save_model,
            output_dir=train_config.output_dir,
            run_id=run_id,
        )
        fit(
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
        )
    finally:
        metrics.close()


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
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
