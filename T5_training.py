"""Fine-tune T5 on WikiHow summarization with FSDP.

    torchrun --nproc_per_node N T5_training.py [--field value ...]

Every field of configs/training.py and configs/fsdp.py is a flag; `--help` lists them. Without arguments
it trains the embedded tiny T5 on the embedded WikiHow sample (offline, CPU or GPU).

The run, top to bottom: parse the flags, check every combination (before anything is read), set up the
process group, build (data, model, FSDP, optimizer, checkpointer, trainer), train, export, tear down.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from configs.cli import parse_args
from configs.fsdp import FSDPConfig
from configs.training import TrainConfig
from configs.validate import check_settings
from policies.mixed_precision import POLICIES, choose_precision
from summarization_dataset import check_csv_header, require_csv
from utils.checkpoint.checkpointer import Checkpointer, CheckpointSettings
from utils.checkpoint.layout import (
    CONFIG_FILE,
    METRICS_FILE,
    choose_start,
    full_weights_file,
    is_checkpoint_folder,
    prepare_output_dir,
)
from utils.checkpoint.state_dicts import load_full_model_weights
from utils.data.loaders import build_eval_set, build_loaders
from utils.distributed.process_group import (
    DistInfo,
    describe_launch,
    destroy_distributed,
    init_distributed,
    is_peer_failure,
    launcher_ranks,
    rank0_decides,
)
from utils.errors import FAILURES, ConfigError, UserError
from utils.eval.evaluator import Evaluator
from utils.eval.generation import GenerationSettings, summarization_params
from utils.fsdp.wrap import log_fsdp_layout, wrap_model
from utils.model.loading import (
    LoadedModel,
    builds_on_meta,
    load_model_for_run,
    load_tokenizer,
    model_config_overrides,
)
from utils.model.lora import LoraSettings, apply_lora, holds_adapters, trainable_share
from utils.observe.flops import T5Flops, Throughput, device_peak_flops
from utils.observe.log import get_logger, setup_logging
from utils.observe.memory import trim_host_heap
from utils.observe.metrics import MetricsWriter
from utils.observe.run_record import run_record, write_run_record
from utils.observe.tensorboard import tensorboard_sink
from utils.train.trainables import build_trainables, total_optimizer_steps
from utils.train.trainer import Measures, Trainer

RANK0_MESSAGE_GRACE_S = 2.0


def build_trainer(
    train_config: TrainConfig, fsdp_config: FSDPConfig, info: DistInfo, precision: str, start: str | None
) -> Trainer:
    """config -> tokenizer + loaders -> model (+ LoRA) -> FSDP model -> optimizer -> checkpointer -> trainer."""
    check_csv_header(require_csv(train_config.data_dir))  # before the model: seconds, not minutes
    # The data is read and checked before the model loads, so a data error costs seconds, not minutes.
    tokenizer = load_tokenizer(train_config.model_name)
    loaders = build_loaders(tokenizer, train_config, info)
    lora = LoraSettings.from_config(train_config)
    loaded = build_model(train_config, fsdp_config, info, lora, start, tokenizer)
    model_config = loaded.model.config
    # Checkpoints and hf_model/ carry how to summarise with this model (scripts/summarize.py reads it).
    model_config.task_specific_params = {
        **(getattr(model_config, "task_specific_params", None) or {}),
        "summarization": summarization_params(train_config),
    }
    model = wrap_model(loaded.model, fsdp_config, info.device, precision, loaded.weights_source)
    memory_baseline = loaded.memory_baseline()  # loading measured until sharded
    trim_host_heap()  # what loading freed goes back to the OS instead of inflating the run's peak
    log_fsdp_layout(model, precision)
    total_steps = total_optimizer_steps(train_config, len(loaders.train))
    trainables = build_trainables(model, train_config, precision, info.device, total_steps)
    settings = CheckpointSettings.from_configs(train_config, fsdp_config, lora)
    checkpointer = Checkpointer(settings, trainables, model_config, loaded.tokenizer, info)
    throughput = build_throughput(model_config, fsdp_config, train_config, info, precision)
    measures = Measures(memory_baseline, throughput)
    return Trainer(trainables, loaders, checkpointer, train_config, info, measures)


def build_model(
    train_config: TrainConfig,
    fsdp_config: FSDPConfig,
    info: DistInfo,
    lora: LoraSettings | None,
    start: str | None,
    tokenizer,
) -> LoadedModel:
    """The unwrapped model: pretrained (or a skeleton for rank-0-only loading), with the weights of a full
    .pt start, and LoRA adapters. A LoRA run's own .pt (adapters included) is loaded after the adapters."""
    on_meta = builds_on_meta(fsdp_config.cpu_ram_efficient_loading, fsdp_config.fsdp_version, info.is_main)
    weights_file = full_weights_file(start)
    adapter_weights = weights_file if lora and weights_file and holds_adapters(weights_file) else None
    if lora and weights_file and not adapter_weights and not is_checkpoint_folder(start) and not lora.merge:
        raise ConfigError(
            f"--peft lora from the weights of {start}: the adapter would name {lora.base_model} as its base, "
            "whose weights differ. Add --merge_lora true (the merged hf_model/ stands alone)."
        )
    overrides = model_config_overrides(train_config)
    weights = None if adapter_weights else weights_file
    loaded = load_model_for_run(train_config.model_name, on_meta, weights, overrides, tokenizer)
    if lora is not None:
        loaded.model = add_lora_adapters(loaded.model, lora)
        if adapter_weights:
            load_full_model_weights(loaded.model, adapter_weights)
        loaded.param_numel_total = trainable_share(loaded.model)[1]
    return loaded


def add_lora_adapters(model, lora: LoraSettings):
    """--peft lora: the PEFT model, only its adapters trainable (before wrapping, like the model itself)."""
    model = apply_lora(model, lora)
    trainable, total = trainable_share(model)
    get_logger().info(
        "LoRA r=%d alpha=%d on %s: %d of %d parameters train (%.2f%%)",
        lora.r, lora.alpha, ",".join(lora.target_modules), trainable, total, 100 * trainable / total,
    )  # fmt: skip
    return model


def build_throughput(
    model_config, fsdp_config: FSDPConfig, train_config: TrainConfig, info: DistInfo, precision: str
) -> Throughput:
    """How steps are counted in FLOPs and rated against the device's peak in the compute dtype. Collective."""
    dtype = POLICIES[precision].param_dtype
    peak, source = device_peak_flops(info.device, dtype, train_config.peak_tflops)
    if peak:
        get_logger().info("MFU against a peak of %.4g TFLOP/s per device (%s)", peak / 1e12, source)
    else:
        get_logger().warning("no MFU: %s", source)
    recompute = fsdp_config.fsdp_activation_checkpointing
    flops = T5Flops.from_config(model_config, frozen_weights=train_config.peft == "lora")
    return Throughput(flops, recompute, info.world_size, peak, source)


def evaluate_saved_model(trainer: Trainer, train_config: TrainConfig, info: DistInfo) -> None:
    """--evaluate_only: ROUGE of the loaded (or resumed) model on --eval_split, no training. Collective.

    The eval record is appended to output_dir/metrics.jsonl; nothing else of the folder is touched."""
    eval_set = build_eval_set(trainer.checkpointer.tokenizer, train_config, info, train_config.eval_split)
    settings = GenerationSettings.from_config(train_config)
    evaluator = Evaluator(eval_set, settings, train_config.output_dir, info)
    progress = trainer.progress
    record = evaluator.evaluate(trainer.trainables.model, progress.epoch - 1, progress.global_step)
    path = os.path.join(train_config.output_dir, METRICS_FILE)
    sink = tensorboard_sink(path, info.is_main and train_config.tensorboard)
    metrics = MetricsWriter(path, info.is_main, append=True, tensorboard=sink)
    try:
        metrics.write(record)
    finally:
        metrics.close()


def run(train_config: TrainConfig, fsdp_config: FSDPConfig, info: DistInfo) -> None:
    """Set up the output folder, build, (resume,) train, export. Collective: every rank runs it."""
    torch.manual_seed(train_config.seed)
    output_dir = train_config.output_dir
    rank0_decides(lambda: prepare_output_dir(output_dir))
    start = rank0_decides(lambda: choose_start(train_config.resume, output_dir))
    precision = choose_precision(fsdp_config, info.device)
    trainer = build_trainer(train_config, fsdp_config, info, precision, start)
    if is_checkpoint_folder(start):
        trainer.resume(start)
    elif start:
        get_logger().info("started from the weights of %s (new optimizer, epoch 1)", start)
    if train_config.evaluate_only:
        evaluate_saved_model(trainer, train_config, info)
    else:
        if info.is_main:  # only now: a run that fails to start leaves the previous run's record as it was
            record = run_record(train_config, fsdp_config, info, precision, trainer.measures.throughput)
            write_run_record(os.path.join(output_dir, CONFIG_FILE), record, start)
        trainer.train()
    # No rank tears its process group down while another still communicates (seen once as an abort,
    # "terminate called without an active exception", on a loaded 2-core machine).
    dist.barrier()


@record
def main(argv: list[str] | None = None) -> int:
    rank, _, _ = launcher_ranks()
    setup_logging(rank)
    try:
        train_config, fsdp_config = parse_args(argv)
        info = describe_launch(train_config.device)
        check_settings(train_config, fsdp_config, info.world_size, info.device.type)
        init_distributed(info, train_config.dist_timeout_s)
        run(train_config, fsdp_config, info)
    except UserError as err:
        # The same input error happens on every rank: rank 0 says it once, every rank exits non-zero.
        # torchrun stops the other ranks as soon as one exits non-zero; the other ranks wait a moment so
        # rank 0 is not killed before its message is out.
        if rank == 0:
            get_logger().error("%s", err)
        else:
            time.sleep(RANK0_MESSAGE_GRACE_S)
        return 2 if isinstance(err, ConfigError) else 1
    except FAILURES as err:  # Exception, and DCP's CheckpointException (a BaseException)
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
