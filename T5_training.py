"""Fine-tune T5 on WikiHow summarization (or your own data) with FSDP: the Advanced FSDP tutorial's
T5_training.py, working.

    torchrun --nproc_per_node N T5_training.py [--field value ...]

Every field of every configs/ section is a flag; `--help` lists them. Without arguments it trains the
embedded tiny T5 on the embedded WikiHow sample (offline, CPU or GPU).

`fsdp_main` is the tutorial's skeleton, in its order: setup -> datasets and loaders -> model -> FSDP ->
AdamW and the LR scheduler -> the epoch loop (utils/train/trainer.py: train, validation, scheduler.step(),
save) -> cleanup. What this package adds (where a run starts from, LoRA, evaluation, checkpoints,
measurement) appears as named steps inside it.

Run as a program, the file reads and checks the settings and the inputs they name (`read_settings`,
`check_inputs`) before it imports torch, transformers and the training modules, which take 3-10 s of a run's
start: a refused setting, a missing model folder or data file, or --help, answers in about a second.
"""

import contextlib
import gc
import logging
import os
import sys
import time

from configs import cli, validate
from configs.errors import ConfigError, UserError
from configs.run import RunConfig
from utils.checkpoint.record import recorded_run, records_inputs
from utils.data import sources
from utils.distributed.launcher import launcher_ranks, point_launcher_to_the_log, tell_the_launcher
from utils.log import get_logger, setup_logging
from utils.model.source import check_local_model_dir, hub_model_source, looks_like_local_path

RANK0_MESSAGE_GRACE_S = 2.0


def read_settings(argv: list[str] | None) -> tuple[RunConfig, dict]:
    """The run's settings (the flags, a --config file, accelerate launch's environment, and a resume's run
    record under them), checked against each other and the number of ranks; the fields taken from accelerate
    launch's environment. The device's rules wait for torch (main checks them)."""
    config = cli.parse_args(argv)
    # A resume continues the run that was saved: its recorded settings are the defaults, and a flag given
    # that differs is taken with one line, or refused where the checkpoints cannot honour it.
    recorded = recorded_run(config.checkpointing.resume, config.train.output_dir)
    if recorded is not None:
        inputs_recorded = records_inputs(config.checkpointing.resume, config.train.output_dir)
        config, changes = cli.continue_run(argv, recorded[1], recorded[0], inputs_recorded=inputs_recorded)
        changed = f"; changed here: {', '.join(changes)}" if changes else ""
        get_logger().info("resuming with the settings of %s%s", recorded[0], changed)
    for note in cli.hf_name_notes(argv):
        get_logger().info("HF's name: %s", note)
    from_accelerate = cli.fields_from_accelerate(sys.argv[1:] if argv is None else argv)
    if from_accelerate:
        values = {
            name: value for section in cli.config_to_dict(config).values() for name, value in section.items()
        }
        taken = (
            f"--{name} {cli.format_value(values[name])} ({source})" for name, source in from_accelerate.items()
        )
        get_logger().info("from accelerate launch's environment: %s", ", ".join(taken))
    validate.check_settings(config, launcher_ranks()[2])
    return config, from_accelerate


def check_inputs(config: RunConfig) -> None:
    """The model and the data the settings name are there: a folder and files looked at, not read; a hub name
    looked up by rank 0 (one request: the other ranks, still starting, are stopped by torchrun when it refuses);
    a dataset name when it is read. The same checks run again where the model and the data are read."""
    model = config.train.model_name
    if looks_like_local_path(model):
        check_local_model_dir(model, adapter_ok=config.evaluation.evaluate_only)
    elif launcher_ranks()[0] == 0:
        hub_model_source(model)
    sources.check_data_found(config.data)


def refusal(err: UserError, rank: int) -> int:
    """The exit status of a run refused for `err`. An input error usually happens on every rank: rank 0 says it
    once, every rank exits non-zero (2 for a setting). torchrun stops the other ranks as soon as one exits
    non-zero; the other ranks wait a moment so rank 0 is not killed before its message is out. One still
    running then failed where rank 0 did not (a folder missing on its node, a GPU its LOCAL_RANK does not
    have): its error goes to torchrun's closing report, which shows the rank that failed first."""
    if rank == 0:
        get_logger().error("%s", err)
        point_launcher_to_the_log(rank)
    else:
        time.sleep(RANK0_MESSAGE_GRACE_S)
        tell_the_launcher(f"[rank {rank}] {err}")
    return 2 if isinstance(err, ConfigError) else 1


def answer_before_the_imports(argv: list[str]) -> None:
    """--help, a refused setting or a missing input (which end the run here), before the imports below. Says
    nothing else: main reads the settings again and says what they are."""
    rank = launcher_ranks()[0]
    if rank != 0 and ("-h" in argv or "--help" in argv):
        sys.exit(0)  # under torchrun every rank would print the same help: rank 0 does
    setup_logging(rank)
    get_logger().setLevel(logging.ERROR)
    try:
        config, _ = read_settings(argv)  # --help: prints it and exits
        check_inputs(config)
    except UserError as err:
        sys.exit(refusal(err, rank))


@contextlib.contextmanager
def kept_for_the_whole_process():
    """What the block imports (the modules of torch, transformers and the package: about 440,000 objects that live
    as long as the process) is made with the garbage collector off, collected once (its garbage), then frozen,
    with everything else alive then, out of every later collection's walk (gc.freeze): a run's start and exit
    take about 1.5 s less on 2 cores, and a full collection (the one before the process group's teardown, or
    one Python starts) 0.26 s less on this project's CPU (docs/throughput.md). The collector is left on or off
    as it was."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        if collecting:
            gc.enable()


if __name__ == "__main__":
    answer_before_the_imports(sys.argv[1:])

# The rest of the program: imported after the settings are known to be good (E402 allowed here).
with kept_for_the_whole_process():
    import functools

    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from configs import accelerate_env
    from configs.errors import FAILURES, error_summary
    from configs.evaluation import METRIC_NAMES
    from policies.mixed_precision import Precision, resolve_precision
    from policies.wrapping import layer_classes
    from utils import layout
    from utils.checkpoint.inputs import checked_inputs
    from utils.checkpoint.manager import CheckpointManager
    from utils.checkpoint.run_lock import check_writable, claimed_output_dir
    from utils.checkpoint.start import StartPoint, resolve_start
    from utils.data.loaders import Loaders, build_loaders
    from utils.distributed import hang_report, process_group
    from utils.distributed.progress_bounded import progress_bounded
    from utils.eval.evaluator import Evaluator
    from utils.files import is_disk_full
    from utils.fsdp.parallelism import Parallelism, parallelism_for
    from utils.fsdp.shard import forward_warnings_ignored
    from utils.log import quiet_helper_process
    from utils.model import loading, lora
    from utils.observe import flops, memory, metrics, run_record, tensorboard
    from utils.spec import ModelSpec
    from utils.train import optim
    from utils.train.preemption import StopRequest
    from utils.train.trainer import Trainer

if __name__ == "__mp_main__":  # imported by a process torch starts from this one: the background checkpoint
    quiet_helper_process()  # writer of --async_checkpoint (utils/checkpoint/manager.py)


def fsdp_main(config: RunConfig, info: process_group.DistInfo, from_accelerate: dict) -> None:
    """One run, on every rank (collective): datasets -> model -> FSDP -> optimizer -> train -> export."""
    train, recipe, evaluation = config.train, config.recipe, config.evaluation
    torch.manual_seed(train.seed)
    # Every folder of output_dir the run will write, probed on every rank before anything is read or moved: a
    # read-only checkpoints/ is said now, not at the first save after training.
    saves_checkpoints = config.checkpointing.keep_last_n > 0
    check_writable(train.output_dir, evaluating=evaluation.evaluate_only, saves_checkpoints=saves_checkpoints)
    # Where the run starts from (afresh, a .pt, a checkpoint folder): rank 0 looks at output_dir once, every
    # rank checks the checkpoint's files. A torchrun restart of this run continues from its newest intact
    # checkpoint (utils/checkpoint/start.py).
    job, attempt = process_group.torchrun_attempt()
    attempt = process_group.group_attempt(attempt, info.device)
    # --evaluate_only changes nothing of a run: it refuses a damaged checkpoint instead of setting it aside.
    start = resolve_start(
        config.checkpointing.resume, train.output_dir, job, attempt, not evaluation.evaluate_only
    )
    # What the run reads (its data files, the model folder's config and tokenizer), fingerprinted for its
    # checkpoints; a resume on changed ones is refused here, before anything loads (utils/checkpoint/inputs.py).
    # --evaluate_only changes nothing of a run, and may score any data.
    inputs = None
    if not evaluation.evaluate_only:
        inputs = checked_inputs(
            start, data=config.data, model_name=train.model_name, lora=config.lora.peft == "lora",
            accept_changed=config.checkpointing.accept_changed_inputs,
        )  # fmt: skip
    precision = resolve_precision(
        config.fsdp, info.device, functools.partial(process_group.any_rank, device=info.device)
    )
    if precision.fallback:
        get_logger().info("%s", precision.fallback)
    precision.set_matmul_precision()
    # How the model is spread over the ranks (FSDP1, the tutorial's; FSDP2; or one rank unwrapped): chosen
    # once; loading, the step, generation and the checkpoints ask it (utils/fsdp/parallelism.py).
    parallelism = parallelism_for(config.fsdp, info.world_size)

    # The model's config, checked (a model this package cannot train stops the run here), and its spec
    # (utils/spec.py): what this kind of model trains on and is scored by. Its Dataset is read here; the
    # tokenizer, the model, the step, the trainer, evaluation, the FLOP count and the export ask it from here on.
    evaluating = evaluation.evaluate_only
    checked_config, spec = loading.run_model_config(train.model_name, evaluating=evaluating)
    spec.check_data(config.data, checked_config)  # what only some models read (--packing: a decoder-only one)
    # Datasets and loaders (the spec's Dataset and collate; the tutorial's, summarization_dataset.py): the data
    # is read and checked before the model loads, so a data error costs seconds, not the minutes of loading a
    # large model.
    # A node that builds its data cache (utils/data/shared_cache.py) is waited for by its progress, not
    # --dist_timeout_s: the other nodes may have theirs already.
    tokenizer = loading.load_tokenizer(train.model_name, evaluating=evaluating, config=checked_config, spec=spec)
    with progress_bounded("data loading"):
        loaders = build_loaders(
            tokenizer=tokenizer, data_format=spec.data_format, data=config.data, train=train,
            evaluation=evaluation, info=info,
        )  # fmt: skip
    log_evaluation_plan(config, loaders)

    # The model: pretrained weights (a skeleton on the meta device where rank-0-only loading fills it
    # later, or where a checkpoint does), the weights of a .pt, and LoRA adapters. Where rank 0 alone reads
    # them, the others wait for as long as it makes progress, not --dist_timeout_s.
    with progress_bounded("model loading"):
        loaded = build_model(config, info, start, tokenizer, parallelism, spec)
    log_layer_classes_of_accelerate(loaded.model)
    model_config = loaded.model.config
    # Checkpoints and hf_model/ carry how to summarise with this model (scripts/summarize.py reads it).
    model_config.task_specific_params = {
        **(getattr(model_config, "task_specific_params", None) or {}),
        spec.params_key: spec.saved_params(config.data, evaluation, loaders.cleaning),
    }

    # FSDP: FullyShardedDataParallel (--fsdp_version 1, the tutorial's) or fully_shard (2).
    model = parallelism.wrap(
        loaded.model, precision=precision, device=info.device, weights_source=loaded.weights_source,
        restores=start.is_checkpoint,
    )  # fmt: skip
    parallelism.describe(model, precision)

    # AdamW and the LR scheduler, built after sharding: the optimizer must hold FSDP's sharded parameters.
    # fp16 needs a gradient scaler; the sharded one agrees on inf/NaN across ranks, so all skip the same steps.
    scaler = ShardedGradScaler(device=info.device.type) if precision.needs_grad_scaler else None
    fused = optim.uses_fused_adamw(info.device.type, recipe.on_nonfinite, has_grad_scaler=scaler is not None)
    optimizer = torch.optim.AdamW(optim.parameter_groups(model, train.weight_decay), lr=train.lr, fused=fused)
    batches_per_epoch = len(loaders.train) if loaders.train is not None else 1  # --evaluate_only trains none
    total_steps = optim.total_optimizer_steps(recipe, train.epochs, batches_per_epoch)
    scheduler = optim.lr_scheduler(optimizer, train.gamma, recipe, total_steps)

    # The checkpoint manager owns every save and load; it restores where the run starts from, and is closed
    # however the run ends (a background save still being written is finished, or said to be abandoned).
    # SIGTERM and Ctrl-C: before training they end the run at once, as they always do; in training they ask
    # for a save and a stop; after it they are noted until the manager is closed (utils/train/preemption.py).
    base_model = lora.adapter_base(train.model_name)
    checkpoints = CheckpointManager(
        checkpointing=config.checkpointing, fsdp=config.fsdp, output_dir=train.output_dir, model=model,
        parallelism=parallelism, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
        model_config=model_config, tokenizer=tokenizer, info=info, lora=config.lora, base_model=base_model,
        inputs=inputs, spec=spec,
    )  # fmt: skip
    with StopRequest() as stop, checkpoints:
        # A GEMM probe on CPU: before the load. --evaluate_only trains nothing, so it has no MFU to say.
        throughput = (
            None if evaluation.evaluate_only else build_throughput(spec, model_config, config, info, precision)
        )
        progress = checkpoints.load(start)
        memory_baseline = loaded.memory_baseline()  # loading measured until sharded and restored
        memory.trim_host_heap()  # what loading freed goes back to the OS instead of inflating the run's peak

        if evaluation.evaluate_only:
            evaluate_saved_model(
                model=model, parallelism=parallelism, eval_set=loaders.evaluation, spec=spec, config=config,
                info=info, progress=progress, start=start, compute_dtype=precision.compute_dtype,
            )  # fmt: skip
        else:
            evaluator = None
            if loaders.evaluation is not None:
                generate_kwargs = spec.generation_kwargs(evaluation, config.data.max_target_length)
                predictions_file = functools.partial(layout.predictions_file, train.output_dir)
                evaluator = Evaluator(
                    eval_set=loaders.evaluation, parallelism=parallelism, spec=spec, generation=generate_kwargs,
                    metric=evaluation.eval_metric, predictions_file=predictions_file, info=info,
                    gather_for_generation=evaluation.gather_for_generation, compute_dtype=precision.compute_dtype,
                )  # fmt: skip
            trainer = Trainer(
                model=model, parallelism=parallelism, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                loaders=loaders, checkpoints=checkpoints, evaluator=evaluator, info=info, train=train,
                recipe=recipe, evaluation=evaluation, observe=config.observe, throughput=throughput,
                memory_baseline=memory_baseline, spec=spec,
            )  # fmt: skip
            if start.is_checkpoint and trainer.done(progress):
                trainer.finish_finished_run(progress)  # a resume of a finished run changes nothing
            else:
                trainer.lay_out(progress)  # where it ends; a resume in another shape re-lays the schedule's rest
                progress = checkpoints.begin_training(start, progress)  # a rollback's abandoned branch set aside
                if info.is_main:  # only now: a run that fails to start leaves the previous run's record as it was
                    record_ = run_record.run_record(
                        config=config, from_accelerate=from_accelerate, info=info, precision=precision,
                        throughput=throughput, torchrun_job=job, unknown_tokens=loaders.unknown_tokens(),
                    )  # fmt: skip
                    config_file = os.path.join(train.output_dir, layout.CONFIG_FILE)
                    run_record.write_run_record(config_file, record_, start.path)
                trainer.train(progress, resumed=start.is_checkpoint, stop=stop)
        # No rank tears its process group down while another still communicates (seen once as an abort,
        # "terminate called without an active exception", on a loaded 2-core machine).
        dist.barrier()


def log_evaluation_plan(config: RunConfig, loaders: Loaders) -> None:
    """One line saying what is evaluated (the rows generation will really score), and which setting switches
    what off."""
    train, evaluation = config.train, config.evaluation
    if evaluation.evaluate_only:
        return
    if not train.run_validation:
        get_logger().info(
            "evaluation: none (--run_validation false switches off the validation loss and generation)"
        )
        return
    metric = METRIC_NAMES[evaluation.eval_metric]
    scores = f"no {metric} (--eval_rouge false)"
    if config.data.dataset_text_field:
        scores = f"perplexity, no {metric} (--dataset_text_field: whole texts have no reference to score)"
    if loaders.evaluation is not None:
        rows = len(loaders.evaluation.dataset)
        scores = f"{metric} of {rows} generated outputs (--eval_rouge false switches it off)"
    when = "after each epoch"
    if evaluation.eval_every_n_steps:
        when += f" and every {evaluation.eval_every_n_steps} steps"
    get_logger().info(
        "evaluation %s: validation loss and %s; --run_validation false switches all evaluation off", when, scores
    )


def log_layer_classes_of_accelerate(model: torch.nn.Module) -> None:
    """One line where accelerate launch's config names other layer classes than the model's own, which are the
    units (configs/accelerate_env.py checks the name, and does not use it)."""
    named = accelerate_env.layer_classes_named(os.environ)
    own = sorted(cls.__name__ for cls in layer_classes(model))
    if named and sorted(name.lower() for name in named) != [name.lower() for name in own]:  # checked so too
        get_logger().info(
            "accelerate's fsdp_transformer_layer_cls_to_wrap names %s; this %s's layers are %s, and those are "
            "the FSDP units (the config's value is checked, not used)",
            ", ".join(named), type(model).__name__, ", ".join(own),
        )  # fmt: skip


def build_model(
    config: RunConfig,
    info: process_group.DistInfo,
    start: StartPoint,
    tokenizer,
    parallelism: Parallelism,
    spec: ModelSpec,
) -> loading.LoadedModel:
    """The unwrapped model: pretrained (or a skeleton for rank-0-only loading), with the weights a .pt or a
    full checkpoint brings, and LoRA adapters. A LoRA run's own .pt (adapters included) is loaded after the
    adapters are added."""
    train, lora_config = config.train, config.lora
    uses_lora = lora_config.peft == "lora"
    restores = start.is_checkpoint
    on_meta = parallelism.builds_on_meta(info.is_main, restores)
    weights_file = start.weights_file
    adapter_weights = weights_file if uses_lora and weights_file and lora.holds_adapters(weights_file) else None
    plain_pt = weights_file and not adapter_weights  # a plain model's .pt file
    if uses_lora and plain_pt and not lora_config.merge_lora:
        raise ConfigError(
            f"--peft lora from the weights of {start.path}: the adapter would name {train.model_name} as its "
            "base, whose weights differ. Add --merge_lora true (the merged hf_model/ stands alone)."
        )
    overrides = loading.model_config_overrides(config.recipe)
    weights = None if adapter_weights else weights_file
    evaluated_adapter = loading.evaluated_model(train.model_name, config.evaluation.evaluate_only)[1]
    if evaluated_adapter and (restores or weights_file):
        raise ConfigError(
            f"--model_name {train.model_name} is a LoRA adapter to evaluate, and --resume names weights too "
            f"({start.path}): give one. --resume false scores the adapter merged into its base."
        )
    if evaluated_adapter and parallelism.fills_units_from_files:
        raise ConfigError(
            f"--model_name {train.model_name} is a LoRA adapter, merged into its base in memory; FSDP1's "
            "rank-0-only loading fills each unit from the model's files instead. Add --cpu_ram_efficient_loading "
            "false, or --fsdp_version 2 (rank 0 merges, then broadcasts)."
        )
    loaded = loading.load_model_for_run(
        train.model_name, on_meta, weights, overrides, tokenizer, evaluating=config.evaluation.evaluate_only,
        rank0_fills=parallelism.fills_units_from_files and not restores,
    )  # fmt: skip
    if uses_lora:
        loaded.model = lora.apply_lora(loaded.model, lora_config, lora.adapter_base(train.model_name), spec)
        trainable, total = lora.trainable_share(loaded.model)
        targets = ",".join(lora.target_modules(lora_config, loaded.model))
        get_logger().info(
            "LoRA r=%d alpha=%d on %s: %d of %d parameters train (%.2f%%)",
            lora_config.lora_r, lora_config.lora_alpha, targets, trainable, total, 100 * trainable / total,
        )  # fmt: skip
        if adapter_weights and not on_meta:
            loading.load_full_model_weights(loaded.model, adapter_weights)
        loaded.param_numel_total = total
    return loaded


def build_throughput(
    spec: ModelSpec, model_config, config: RunConfig, info: process_group.DistInfo, precision: Precision
) -> flops.Throughput:
    """How steps are counted in FLOPs and rated against the device's peak in the compute dtype. Collective."""
    peak, source = flops.device_peak_flops(
        info.device, precision.compute_dtype, config.observe.peak_tflops, tf32=precision.tf32
    )
    counter = spec.flop_counter(model_config, frozen_weights=config.lora.peft == "lora")
    if counter is None:
        get_logger().warning(
            "no MFU: the FLOPs of a %s model are not counted here (docs/models.md)", model_config.model_type
        )
    elif peak:
        get_logger().info("MFU against a peak of %.4g TFLOP/s per device (%s)", peak / 1e12, source)
    else:
        get_logger().warning("no MFU: %s", source)
    return flops.Throughput(counter, config.fsdp.fsdp_activation_checkpointing, info.world_size, peak, source)


def evaluate_saved_model(
    *,
    model,
    parallelism: Parallelism,
    eval_set,
    spec: ModelSpec,
    config: RunConfig,
    info: process_group.DistInfo,
    progress,
    start: StartPoint,
    compute_dtype: torch.dtype,
) -> None:
    """--evaluate_only: the --eval_metric scores of the loaded (or resumed) model on `eval_set` (--eval_split),
    no training. Collective.

    Its eval record (appended to output_dir/evaluate_only/metrics.jsonl, naming the model evaluated) and its
    predictions (a file per evaluation) go apart from what training wrote, which stays as it was."""
    train, evaluation = config.train, config.evaluation
    generate_kwargs = spec.generation_kwargs(evaluation, config.data.max_target_length)
    stamp = layout.time_stamp()

    def predictions_file(split: str, step: int) -> str:
        return layout.evaluate_only_predictions_file(train.output_dir, split, step, stamp)

    with forward_warnings_ignored():
        evaluator = Evaluator(
            eval_set=eval_set, parallelism=parallelism, spec=spec, generation=generate_kwargs,
            metric=evaluation.eval_metric, predictions_file=predictions_file, info=info,
            gather_for_generation=evaluation.gather_for_generation, compute_dtype=compute_dtype,
        )  # fmt: skip
        scores = evaluator.evaluate(model, progress.epoch - 1, progress.global_step)
    path = os.path.join(train.output_dir, layout.EVALUATE_ONLY_DIR, layout.METRICS_FILE)
    if info.is_main:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    if config.observe.wandb or config.observe.mlflow:
        get_logger().info("--evaluate_only logs to %s (and TensorBoard), not to W&B or MLflow", path)
    sink = tensorboard.tensorboard_sink(path, info.is_main and config.observe.tensorboard)
    with metrics.MetricsWriter(path, info.is_main, append=True, sinks=[sink] if sink else []) as writer:
        writer.write({**scores, "model": start.path or train.model_name})


@record
def main(argv: list[str] | None = None) -> int:
    """Read and check the settings, set up the process group, run, tear down; one message on bad input."""
    rank = launcher_ranks()[0]
    setup_logging(rank)
    args = sys.argv[1:] if argv is None else argv
    if rank != 0 and ("-h" in args or "--help" in args):
        return 0  # under torchrun every rank would print the same help: rank 0 does
    try:
        config, from_accelerate = read_settings(argv)
        info = process_group.describe_launch(config.train.device, config.fsdp.fsdp_cpu_offload)
        validate.check_settings(config, info.world_size, info.device.type)  # now with the device's rules
        process_group.init_distributed(info, config.train.dist_timeout_s, config.train.output_dir)
        with (
            claimed_output_dir(config.train.output_dir),  # one run per output_dir: a second one stops here
            hang_report.reported_hangs(config.train.output_dir, config.train.dist_timeout_s),  # a hang: reports
        ):
            fsdp_main(config, info, from_accelerate)
    except KeyboardInterrupt:
        # A second Ctrl-C (the first asks for a save, utils/train/preemption.py), or one before training. At
        # once means at once: no teardown, which would wait for a background write's thread and its
        # collectives (the operating system releases the run lock and the process group's sockets).
        if rank == 0:
            get_logger().error("interrupted: stopped at once, without saving (resume from the newest checkpoint)")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    except UserError as err:
        return refusal(err, rank)
    except (process_group.GroupNotFormed, hang_report.CollectiveTimedOut) as err:
        # Every rank that waited says so (a timed-out collective: naming its report, which holds the traceback):
        # the rank that never joined, or hangs, may be silent.
        get_logger().error("%s", err)
        point_launcher_to_the_log(rank)
        return 1
    except FAILURES as err:  # Exception, and DCP's CheckpointException (a BaseException)
        if getattr(err, "refusal", None):  # another rank's own input error, which rank 0 says (once)
            if rank == 0:
                get_logger().error("%s", err.refusal)
                point_launcher_to_the_log(rank)
        elif process_group.is_peer_failure(err):
            # Another rank failed first and printed why; N copies of "connection closed" would bury it.
            get_logger().error("stopped: another rank failed (its error is above)")
        elif is_disk_full(err):  # a full disk outside a checkpoint save (which says more): one line, no traceback
            get_logger().error(
                "failed: no space left on a disk (%s) at %s. Free space, or choose another --output_dir, and "
                "resume with --resume true", error_summary(err), hang_report.WHERE.describe(),
            )  # fmt: skip
        else:
            # Logged here once; re-raising would print it again, and again in torchrun's summary.
            get_logger().exception("failed: %s", err)
            point_launcher_to_the_log(rank)
        return 1
    finally:
        process_group.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
