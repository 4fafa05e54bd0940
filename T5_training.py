"""Fine-tune T5 on WikiHow summarization (or your own data) with FSDP: the Advanced FSDP tutorial's
T5_training.py, working.

    torchrun --nproc_per_node N T5_training.py [--field value ...]

Every field of every configs/ section is a flag; `--help` lists them. Without arguments it trains the
embedded tiny T5 on the embedded WikiHow sample (offline, CPU or GPU).

`fsdp_main` is the tutorial's skeleton, in its order: setup -> datasets and loaders -> model -> FSDP ->
AdamW and the LR scheduler (each made once by `build_run`, utils/train/build.py) -> the epoch loop
(utils/train/trainer.py: train, validation, scheduler.step(), save) -> cleanup. What this package adds (where a
run starts from, LoRA, evaluation, checkpoints, measurement) appears as named steps inside them.

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

from configs import accelerate_env, cli, validate
from configs.errors import ConfigError, UserError
from configs.run import RunConfig
from utils.base.log import get_logger, setup_logging
from utils.checkpoint.record import recorded_run, records_inputs
from utils.data import sources
from utils.distributed.launcher import launcher_ranks, point_launcher_to_the_log, tell_the_launcher
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
    if config.recipe.max_steps and "epochs" in cli.given_fields(argv):
        get_logger().info(
            "--epochs %d is left aside: --max_steps %d is the run's length in optimizer steps, over as many "
            "epochs as it takes (HF's meaning)", config.train.epochs, config.recipe.max_steps,
        )  # fmt: skip
    from_accelerate = cli.fields_from_accelerate(sys.argv[1:] if argv is None else argv)
    if from_accelerate:
        values = {
            name: value for section in cli.config_to_dict(config).values() for name, value in section.items()
        }
        taken = (
            f"--{name} {cli.format_value(values[name])} ({source})" for name, source in from_accelerate.items()
        )
        get_logger().info("from accelerate launch's environment: %s", ", ".join(taken))
    for note in cli.implied_notes(argv) if recorded is None else ():  # a resume's are its record's
        get_logger().info("%s", note)
    try:
        validate.check_settings(config, launcher_ranks()[2])
    except ConfigError as err:
        raise accelerate_env.naming_config_keys(err, from_accelerate, os.environ) from None
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
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    from configs.errors import FAILURES, error_summary, is_disk_full
    from utils.base import layout
    from utils.base.log import quiet_helper_process
    from utils.checkpoint.run_lock import claimed_output_dir
    from utils.distributed import hang_report, process_group
    from utils.fsdp.shard import forward_warnings_ignored
    from utils.observe import memory, metrics, run_record, tensorboard
    from utils.train.build import Run, build_run
    from utils.train.preemption import StopRequest

if __name__ == "__mp_main__":  # imported by a process torch starts from this one: the background checkpoint
    quiet_helper_process()  # writer of --async_checkpoint (utils/checkpoint/manager.py)


def fsdp_main(config: RunConfig, info: process_group.DistInfo, from_accelerate: dict, **overrides) -> None:
    """One run, on every rank (collective): datasets -> model -> FSDP -> optimizer -> train -> export.
    `overrides`: build_run's (a parallelism or a model spec of the caller's own)."""
    # The tutorial's setup, datasets and loaders, model, FSDP, AdamW and the LR scheduler, and the checkpoint
    # manager that owns every save and load (utils/train/build.py).
    run = build_run(config, info, **overrides)
    # SIGTERM and Ctrl-C: before training they end the run at once, as they always do; in training they ask
    # for a save and a stop; after it they are noted until the manager is closed (utils/train/preemption.py).
    # The manager is closed however the run ends (a background save being written is finished, or abandoned).
    with StopRequest() as stop, run.checkpoints:
        # A GEMM probe on CPU: before the load. --evaluate_only trains nothing, so it has no MFU to say.
        throughput = None if config.evaluation.evaluate_only else run.throughput()
        progress = run.checkpoints.load(run.start)
        memory_baseline = run.loaded.memory_baseline()  # loading measured until sharded and restored
        memory.trim_host_heap()  # what loading freed goes back to the OS instead of inflating the run's peak

        if config.evaluation.evaluate_only:
            evaluate_saved_model(run, progress)
        else:
            train(run, progress, stop, throughput, memory_baseline, from_accelerate)
        # No rank tears its process group down while another still communicates (seen once as an abort,
        # "terminate called without an active exception", on a loaded 2-core machine).
        dist.barrier()


def train(run: Run, progress, stop: StopRequest, throughput, memory_baseline, from_accelerate: dict) -> None:
    """The tutorial's epoch loop (utils/train/trainer.py), from where the run starts; a resume of a finished run
    changes nothing."""
    trainer = run.trainer(throughput, memory_baseline)
    if run.start.is_checkpoint and trainer.end.done(progress):
        trainer.finish_finished_run(progress)
        return
    trainer.lay_out(progress)  # where it ends; a resume in another shape re-lays the schedule's rest
    progress = run.checkpoints.begin_training(run.start, progress)  # a rollback's abandoned branch set aside
    if run.info.is_main:  # only now: a run that fails to start leaves the previous run's record as it was
        record_ = run_record.run_record(
            config=run.config, from_accelerate=from_accelerate, info=run.info, precision=run.precision,
            throughput=throughput, torchrun_job=run.torchrun_job, unknown_tokens=run.loaders.unknown_tokens(),
        )  # fmt: skip
        config_file = os.path.join(run.config.train.output_dir, layout.CONFIG_FILE)
        run_record.write_run_record(config_file, record_, run.start.path)
    trainer.train(progress, resumed=run.start.is_checkpoint, stop=stop)


def evaluate_saved_model(run: Run, progress) -> None:
    """--evaluate_only: the --eval_metric scores of the loaded (or resumed) model on the evaluation split
    (--eval_split), no training. Collective.

    Its eval record (appended to output_dir/evaluate_only/metrics.jsonl, naming the model evaluated) and its
    predictions (a file per evaluation) go apart from what training wrote, which stays as it was."""
    config = run.config
    output_dir = config.train.output_dir
    stamp = layout.time_stamp()

    def predictions_file(split: str, step: int) -> str:
        return layout.evaluate_only_predictions_file(output_dir, split, step, stamp)

    with forward_warnings_ignored():
        scores = run.evaluator(predictions_file).evaluate(run.model, progress.epoch - 1, progress.global_step)
    path = os.path.join(output_dir, layout.EVALUATE_ONLY_DIR, layout.METRICS_FILE)
    if run.info.is_main:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    if config.observe.wandb or config.observe.mlflow:
        get_logger().info("--evaluate_only logs to %s (and TensorBoard), not to W&B or MLflow", path)
    sink = tensorboard.tensorboard_sink(path, run.info.is_main and config.observe.tensorboard)
    with metrics.MetricsWriter(path, run.info.is_main, append=True, sinks=[sink] if sink else []) as writer:
        writer.write({**scores, "model": run.start.path or config.train.model_name})


@record
def main(argv: list[str] | None = None) -> int:
    """Read and check the settings, set up the process group, run, tear down; one message on bad input."""
    rank = launcher_ranks()[0]
    setup_logging(rank)
    args = sys.argv[1:] if argv is None else argv
    if rank != 0 and ("-h" in args or "--help" in args):
        return 0  # under torchrun every rank would print the same help: rank 0 does
    from_accelerate = {}  # a refusal names the accelerate config's keys behind the flags it names
    try:
        config, from_accelerate = read_settings(argv)
        info = process_group.describe_launch(config.train.device, config.fsdp.fsdp_cpu_offload)
        # now with the device's rules
        validate.check_settings(config, info.world_size, info.device.type, info.compute_capability)
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
        return refusal(accelerate_env.naming_config_keys(err, from_accelerate, os.environ), rank)
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
