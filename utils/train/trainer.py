"""The training loop: epochs of steps, validation, ROUGE, the LR schedule, the epoch record and checkpoints.

    trainer = Trainer(model=model, optimizer=optimizer, ..., spec=spec)
    trainer.lay_out(progress)                           # where it ends; the LR schedule over the steps left
    finished = trainer.train(progress, resumed, stop)   # False: stopped early (SIGTERM, Ctrl-C), saved first

`train` is the tutorial's `for epoch in range(1, epochs + 1): train(); validation(); scheduler.step(); save`,
read top to bottom in one method, with what this package adds as named steps inside it: a resumed epoch
starting mid-way (`_train_pass`), periodic evaluation and checkpoints inside an epoch, SIGTERM and Ctrl-C,
--max_steps and early stopping, the epoch's end (`_end_epoch`: its record, the best model by
--metric_for_best, its checkpoint). One optimizer step's arithmetic (forward, token-mean loss,
backward, clipping, optimizer step) is utils/train/step.py's `train_step`.
"""

import contextlib
import dataclasses
import math
import os
import time

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim.lr_scheduler import LRScheduler
from tqdm import tqdm

from configs.evaluation import EvalConfig
from configs.observability import ObserveConfig
from configs.recipe import RecipeConfig
from configs.training import TrainConfig
from utils.base import layout
from utils.base.log import format_duration, get_logger, progress_bar
from utils.checkpoint.manager import CheckpointManager
from utils.checkpoint.progress import TrainProgress
from utils.data.loaders import Loaders, move_batch
from utils.distributed.hang_report import WHERE
from utils.distributed.process_group import DistInfo, StopAgreed, any_rank, rank0_decides
from utils.eval.evaluator import Evaluator
from utils.fsdp.parallelism import Parallelism
from utils.fsdp.shard import forward_warnings_ignored
from utils.observe.flops import Throughput
from utils.observe.memory import (
    MemoryBaseline,
    SavedTensorCounter,
    gather_peaks,
    memory_records,
    reset_peak_memory,
)
from utils.observe.metrics import MetricsWriter, open_metrics
from utils.observe.profiler import StepProfiler
from utils.spec import ModelSpec
from utils.train import optim
from utils.train.preemption import StopRequest, StopVote
from utils.train.step import (
    HARDWARE_FLOPS,
    INPUT_TOKENS,
    LOSS_SUM,
    MODEL_FLOPS,
    SAMPLES,
    TARGET_TOKENS,
    StepSettings,
    train_step,
    validate,
)
from utils.train.step_log import StallWatch, StepLog


class Trainer:
    """One run's training: handed the sharded model, its optimizer, scheduler and scaler, the loaders, the
    checkpoint manager and the evaluator (None without ROUGE) once."""

    def __init__(
        self,
        *,
        model: nn.Module,
        parallelism: Parallelism,
        optimizer: torch.optim.Optimizer,
        scheduler: LRScheduler,
        scaler: ShardedGradScaler | None,
        loaders: Loaders,
        checkpoints: CheckpointManager,
        evaluator: Evaluator | None,
        info: DistInfo,
        train: TrainConfig,
        recipe: RecipeConfig,
        evaluation: EvalConfig,
        observe: ObserveConfig,
        throughput: Throughput,
        memory_baseline: MemoryBaseline,
        spec: ModelSpec,
    ):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.loaders = loaders
        self.checkpoints = checkpoints
        self.evaluator = evaluator
        self.info = info
        self.train_config, self.recipe, self.evaluation, self.observe = train, recipe, evaluation, observe
        self.throughput = throughput
        self.memory_baseline = memory_baseline
        self.spec = spec
        self.step_settings = StepSettings(
            parallelism,
            max_grad_norm=recipe.max_grad_norm,
            sync_each_micro_batch=recipe.accumulate_grad_sync,
            skip_nonfinite=recipe.on_nonfinite == "skip",
            flops=throughput.flops,
            recompute=throughput.recompute,
            spec=spec,
        )
        batches_per_epoch = len(loaders.train) if loaders.train is not None else 0
        unreached = optim.unreached_step_budget(recipe, train.epochs, batches_per_epoch)
        if unreached:
            get_logger().info("%s", unreached)
        # The global step the run ends at (for the time left), and what a resume in another shape changed in the
        # LR schedule: set by lay_out, before training starts.
        self.total_steps, self.schedule_change = 0, None
        self.shown_step: int | None = None  # the step last shown
        self.memory_account_due = True  # written once per process, after its first optimizer step
        self.metrics: MetricsWriter | None = None  # open while train() runs
        self.stop_vote = StopVote(info.world_size)  # collective: every rank makes its gloo group
        self.stall = StallWatch()
        self.best_stalled_since: int | None = None  # the stall the best epoch's model was chosen in, if any

    def train(self, progress: TrainProgress, resumed: bool, stop: StopRequest) -> bool:
        """Train from `progress` (a new run's, or a checkpoint's) to the last epoch, then export the final
        model. Returns False if a stop request (SIGTERM, Ctrl-C, which `stop` watches from the first step on)
        ended it early, after a checkpoint. Collective."""
        started = time.perf_counter()
        resumed_at = (progress.global_step, progress.epoch) if resumed else None
        path = os.path.join(self.train_config.output_dir, layout.METRICS_FILE)
        self.metrics = open_metrics(path, self.info.is_main, resumed_at, self.observe)
        last_epoch = 0  # the epoch trained last in this run
        # The metrics and their sinks are closed however training ends; a tracker learns if it failed.
        with self.metrics:
            # --profile_start_step's traces, and on CUDA an out-of-memory error's memory snapshot.
            profiler = StepProfiler(
                self.observe,
                self.train_config.output_dir,
                self.info.rank,
                self.info.device,
                progress.global_step,
                recompute=self.throughput.recompute,
            )
            if self.observe.profile_start_step > self.total_steps:
                get_logger().warning(
                    "--profile_start_step %d: this run trains steps up to %d, so nothing is profiled",
                    self.observe.profile_start_step, self.total_steps,
                )  # fmt: skip
            if not self.done(progress) and progress.global_step < self.total_steps:
                # The load phase is over (scripts/checkpoint_costs.py reads this line). A run resumed for its
                # last evaluation alone has no step left to name.
                get_logger().info(
                    "training steps %d-%d, from epoch %d of %d%s",
                    progress.global_step + 1, self.total_steps, progress.epoch, self.train_config.epochs,
                    f"; {self.schedule_change}" if self.schedule_change else "",
                )  # fmt: skip
            with forward_warnings_ignored(), profiler, stop.watching():
                if self.evaluation.eval_on_start and progress.global_step == 0 and not resumed:
                    try:
                        self._evaluate_midway(progress.epoch, 0, None, stop)  # the model as it starts: step 0
                    except StopAgreed:
                        get_logger().info("stopped during the evaluation before training on %s", stop.name)
                        return False
                while not self.done(progress):
                    epoch = last_epoch = progress.epoch
                    epoch_start = time.perf_counter()
                    if self.train_config.track_memory:
                        reset_peak_memory(self.info.device)

                    # ---- train: one pass over the loader (the whole epoch, or its rest after a resume),
                    # ended early by --max_steps, or by a stop request (which saves first).
                    run = self._train_pass(progress, stop, profiler)
                    if run.stopped:
                        get_logger().info("stopped at step %d on %s; %s", run.step, stop.name, run.continue_with)
                        return False

                    # ---- validation, ROUGE, and the tutorial's scheduler.step() after each epoch. A stop request
                    # during them abandons them within two batches on every rank; the checkpoint then holds the
                    # trained epoch, and the resumed run evaluates it.
                    try:
                        val_loss = self._validation(epoch, stop)
                        scores = self._evaluate(epoch, run.step, stop)
                    except StopAgreed:
                        self.checkpoints.save(run.position, blocking=True)
                        get_logger().info(
                            "stopped during epoch %d's evaluation on %s; --resume true evaluates it",
                            epoch,
                            stop.name,
                        )
                        return False
                    if self.recipe.lr_scheduler == "step" and run.epoch_finished:  # StepLR steps at the epoch's
                        self.scheduler.step()  # real end: a checkpoint inside it resumes at its learning rate

                    # ---- the epoch record, the best model (.pt, hf_model/), then the epoch's checkpoint
                    progress = self._end_epoch(epoch, run, val_loss, scores, progress, epoch_start)
                    if any_rank(stop.requested, self.info.device):
                        get_logger().info(
                            "stopped after epoch %d on %s; continue with --resume true", epoch, stop.name
                        )
                        return False
            get_logger().info("training ends: %s", self.done(progress))
            self.final_export(progress, last_epoch)
            self._log_summary(progress, last_epoch, time.perf_counter() - started)
            return True

    def _train_pass(self, progress: TrainProgress, stop: StopRequest, profiler: StepProfiler) -> "EpochPass":
        """One pass over the train loader from `progress` (inside the epoch after a resume): the steps (each
        inside `profiler.step`, which traces the --profile_start_step range), their records, periodic
        evaluation and checkpoints, --max_steps, and a stop request (agreed by the ranks' vote a step after the
        step it came in, saved, then the pass ends). Evaluation and saves inside the epoch are off the training
        clock. Collective."""
        train, recipe, info = self.train_config, self.recipe, self.info
        epoch, every_eval = progress.epoch, self.evaluation.eval_every_n_steps
        # Without set_epoch every epoch would see the same order; a resumed epoch skips what the checkpoint
        # already trained on.
        self.loaders.train_sampler.set_epoch(epoch, progress.samples_consumed)
        step_log = StepLog(
            self.observe.log_every_n_steps,
            lambda records: self._write_steps(epoch, records),
            totals=progress.epoch_totals,
            # fp16's scaler skips non-finite steps by design (they calibrate its scale): never a reason to stop.
            stop_on_nonfinite=recipe.on_nonfinite == "stop" and self.scaler is None,
            throughput=self.throughput,
            stall=self.stall,
        )
        clock = EpochClock(progress.epoch_train_seconds if progress.samples_consumed else 0.0)
        total_batches = len(self.loaders.train)
        samples_per_batch = train.batch_size_training * info.world_size
        done_before = progress.samples_consumed // samples_per_batch
        run = EpochPass(step=progress.global_step, step_log=step_log)
        # The pass's last step (the epoch's end, or the run's: lay_out) saves anyway: a stop is saved there at the
        # latest.
        last_step = min(run.step + optim.steps_per_epoch(recipe, total_batches), self.total_steps)

        def position(evaluation_due: bool = False) -> TrainProgress:
            """Where the pass stands, as a checkpoint resumes it (the step log must be flushed)."""
            consumed = progress.samples_consumed + run.batches_done * samples_per_batch
            here = inside_epoch(progress, consumed, run.step, step_log, clock.train_seconds())
            return dataclasses.replace(here, evaluation_due=evaluation_due)

        if progress.evaluation_due:  # a stop abandoned this step's evaluation: it comes first
            with clock.paused(step_log), stop.saved_at(run.step):
                try:
                    self._evaluate_midway(epoch, run.step, step_log, stop)
                except StopAgreed:  # stopped again: the checkpoint resumed from still says to redo it
                    run.stopped = True
                    run.continue_with = "the evaluation was not redone; the same command continues from there"
                    return run
            progress = dataclasses.replace(progress, evaluation_due=False)
        self.model.train()
        self.stop_vote.expect(stop, run.step, last_step)
        with progress_bar(total_batches + done_before, f"Training epoch {epoch}", unit="batch", colour="blue",
                      initial=done_before, lines=False) as bar:  # fmt: skip
            for micro_batches in _groups(self.loaders.train, recipe.gradient_accumulation_steps):
                run.step += 1
                with profiler.step(run.step):
                    self._step(run.step, micro_batches, step_log)
                stopping = self.stop_vote.after_step(stop, run.step, last_step)  # every rank votes every step
                run.batches_done += len(micro_batches)
                bar.update(len(micro_batches))
                self._show_progress(bar, step_log, epoch, total_batches - run.batches_done)
                if run.batches_done == total_batches:
                    break  # the epoch's end: validation, evaluation and the checkpoint follow
                # Inside the epoch: the step budget, periodic evaluation, periodic and stop checkpoints.
                if 0 < recipe.max_steps <= run.step:
                    break  # the epoch then ends as usual, and the run after it
                # An evaluation due when a stop is agreed is left to the resumed run, as one abandoned for it is.
                evaluation_due = bool(every_eval) and run.step % every_eval == 0
                if evaluation_due and not stopping:
                    with clock.paused(step_log), stop.saved_at(run.step):
                        try:
                            self._evaluate_midway(epoch, run.step, step_log, stop)
                            evaluation_due = False
                        except StopAgreed:  # a stop request during it: abandoned, saved and stopped below
                            stopping = True
                if self.checkpoints.due(run.step, stopping):
                    step_log.flush()  # collective; metrics.jsonl then holds every step saved
                    with clock.paused(step_log):  # a stop's save is written before the run stops
                        self.checkpoints.save(position(evaluation_due), blocking=stopping)
                if stopping:
                    run.stopped = True
                    break
            self.stop_vote.settle()  # every rank cast it: none is left in flight past the pass
            stop.save_step = run.step  # the epoch's evaluation and checkpoint come at this step
            step_log.flush()  # the pass's last steps, shown too
            self._show_progress(bar, step_log, epoch, total_batches - run.batches_done)
        run.epoch_finished = run.batches_done == total_batches
        run.train_seconds = clock.train_seconds()
        run.position = position()
        return run

    def lay_out(self, progress: TrainProgress) -> None:
        """Where the run that starts from `progress` ends, counted in this run's batches and ranks; a resume that
        changed the run's shape spreads the rest of the LR schedule over the steps it has left (and is refused,
        a ConfigError, where a decayed schedule had ended). Before anything of the run is written."""
        self.total_steps = progress.global_step + self._steps_left(progress)
        self.schedule_change = optim.continue_schedule(
            self.scheduler, progress.global_step, self.total_steps, self.train_config.output_dir
        )

    def _steps_left(self, progress: TrainProgress) -> int:
        """The optimizer steps this run has left from `progress`: the rest of its epoch from the data position
        (in this run's batches and ranks, which a resume may have changed), the later epochs', within
        --max_steps; none once it is done."""
        if self.done(progress):
            return 0
        sampler, batch_size = self.loaders.train_sampler, self.train_config.batch_size_training

        def epoch_steps(samples_consumed: int) -> int:
            batches = math.ceil(sampler.share_after(samples_consumed) / batch_size)
            return optim.steps_per_epoch(self.recipe, batches)

        later_epochs = self.train_config.epochs - progress.epoch
        left = epoch_steps(progress.samples_consumed) + later_epochs * epoch_steps(0)
        if self.recipe.max_steps:
            left = min(left, self.recipe.max_steps - progress.global_step)
        return left

    def _show_progress(self, bar: tqdm, step_log: StepLog, epoch: int, batches_left: int) -> None:
        """After each flush of the step log (rank 0): the loss, samples/s, tokens/s, MFU and the time left in
        the epoch and the run at the window's pace, beside the bar on a terminal, else (a log file, where the
        bar is off) as a log line. The time left counts training steps only: evaluations and saves add to it."""
        if not self.info.is_main or step_log.latest_step in (None, self.shown_step):
            return
        self.shown_step = step = step_log.latest_step
        step_seconds = step_log.latest_step_seconds
        epoch_left = optim.steps_per_epoch(self.recipe, batches_left) * step_seconds
        run_left = max(self.total_steps - step, 0) * step_seconds
        shown = {
            "loss": f"{step_log.latest_loss:.3f}",
            "samples/s": f"{step_log.latest_samples_per_s:.1f}",
            "tokens/s": f"{step_log.latest_tokens_per_s:.0f}",
        }
        if step_log.latest_mfu is not None:
            shown["mfu"] = f"{step_log.latest_mfu:.1%}"
        if not bar.disable:
            # tqdm shows the epoch's time left itself
            bar.set_postfix({**shown, "run left": format_duration(run_left)}, refresh=False)
            return
        get_logger().info(
            "step %d/%d (epoch %d) | %s | epoch left %s | run left %s",
            step, self.total_steps, epoch, " | ".join(f"{k} {v}" for k, v in shown.items()),
            format_duration(epoch_left), format_duration(run_left),
        )  # fmt: skip

    def _step(self, step: int, micro_batches: list[dict], step_log: StepLog) -> None:
        """One optimizer step (utils/train/step.py: train_step) and what follows it: its statistics, a finished
        background save completed, the per-step LR schedule, and after the run's first step the memory
        account."""
        WHERE.enter("training step", step)  # where a hang report says the rank was
        batches = [move_batch(batch, self.info.device) for batch in micro_batches]
        settings = self.step_settings
        if self.memory_account_due:  # the run's first step also counts what backward keeps
            settings = dataclasses.replace(settings, saved_counter=SavedTensorCounter())
        stats = train_step(self.model, batches, self.optimizer, self.scaler, self.info.world_size, settings)
        step_log.add(step, self.optimizer.param_groups[0]["lr"], stats)
        self.checkpoints.poll()  # a background save whose write has finished is completed
        if self.recipe.lr_scheduler != "step":  # else the tutorial's StepLR, once per epoch
            self.scheduler.step()
        if self.memory_account_due:  # AdamW's state exists from the first step on
            self._write_memory_account(step, batches[0], settings.saved_counter.bytes)
            self.memory_account_due = False

    def _end_epoch(
        self,
        epoch: int,
        run: "EpochPass",
        val_loss: float | None,
        scores: dict | None,
        progress: TrainProgress,
        epoch_start: float,
    ) -> TrainProgress:
        """The epoch record, the best model by --metric_for_best (hf_model/, the --save_model .pt), and the
        epoch's checkpoint. Returns where the next epoch starts (inside this one when --max_steps ended it)."""
        peaks, reserved = gather_peaks(self.info.device) if self.train_config.track_memory else (None, None)
        epoch_seconds = time.perf_counter() - epoch_start
        record = self._epoch_record(epoch, run.step_log, val_loss, epoch_seconds, run.train_seconds, peaks)
        if reserved is not None:
            record["peak_memory_reserved_bytes"] = reserved
        self.metrics.write(record)
        _log_epoch(record, peaks)
        metric_name = self.evaluation.metric_for_best
        metric = val_loss if metric_name == "val_loss" else (scores or {}).get(metric_name)
        improved = metric is not None and self.spec.is_better(metric_name, metric, progress.best_metric)
        # Without a metric there is no "best": every epoch's .pt is saved, under its own name.
        if self.train_config.save_model and (improved or metric is None):
            self.checkpoints.save_full_model(epoch, val_loss)
        best_metric, best_epoch = progress.best_metric, progress.best_epoch
        if improved:
            get_logger().info("new best %s %.4f (epoch %d)", metric_name, metric, epoch)
            self.checkpoints.export_hf()
            best_metric, best_epoch = metric, epoch
            self.best_stalled_since = self.stall.stalled_since
        # The next epoch starts at its beginning; where --max_steps ended this one early, inside it.
        following = TrainProgress(epoch=epoch + 1, global_step=run.step) if run.epoch_finished else run.position
        following = dataclasses.replace(following, best_metric=best_metric, best_epoch=best_epoch)
        self.checkpoints.save(following)
        return following

    def done(self, progress: TrainProgress) -> str | None:
        """Why training ends before the epoch `progress` is at, or None (`ending`)."""
        ending = self.ending(progress)
        return ending[0] if ending else None

    def ending(self, progress: TrainProgress) -> tuple[str, str] | None:
        """(why training ends before the epoch `progress` is at, the setting a resume would change to train
        on), or None: every epoch trained, --max_steps reached, or --early_stopping_patience epochs without a
        new best (counted from the best epoch kept in the progress, so the count is the same after a resume)."""
        epochs, max_steps = self.train_config.epochs, self.recipe.max_steps
        patience, best = self.recipe.early_stopping_patience, progress.best_epoch
        metric = self.evaluation.metric_for_best
        ended = [
            (progress.epoch > epochs, f"all {epochs} epochs trained", f"more --epochs than {epochs}"),
            (
                0 < max_steps <= progress.global_step,
                f"--max_steps {max_steps} reached",
                f"a higher --max_steps than {max_steps} (0: none)",
            ),
            (
                bool(patience) and best is not None and progress.epoch - 1 - best >= patience,
                f"early stopping: {patience} epochs without a better {metric} than epoch {best}'s",
                f"a higher --early_stopping_patience than {patience} (0: never)",
            ),
        ]
        holding = [(why, fix) for holds, why, fix in ended if holds]
        if not holding:
            return None
        return holding[0][0], " and ".join(fix for _, fix in holding)  # each that would end it again

    def final_export(self, progress: TrainProgress, last_epoch: int) -> None:
        """hf_model/ holds the best epoch's model; the final one goes there when there is no metric, or beside
        it (hf_model_last/) when the last epoch was not the best. Collective."""
        if progress.best_epoch is None:
            self.checkpoints.export_hf()
        elif progress.best_epoch != last_epoch:
            self.checkpoints.export_hf(last=True)

    def _log_summary(self, progress: TrainProgress, last_epoch: int, seconds: float) -> None:
        """The run's closing line: how long, how far, the best metric, where the model and the metrics are; and
        whether that model was chosen while training had stalled (StallWatch), which a low loss does not say."""
        output_dir, metric = self.train_config.output_dir, self.evaluation.metric_for_best
        stalled_since = self.stall.stalled_since if progress.best_epoch is None else self.best_stalled_since
        stalled = "" if stalled_since is None else f"a stalled model: gradient norm 0.0 since step {stalled_since}"
        if progress.best_epoch is None:
            best = "no metric to choose a best epoch by" + (f" (the final model is {stalled})" if stalled else "")
        else:
            best = f"best {metric} {progress.best_metric:.4f} (epoch {progress.best_epoch}"
            best += f", {stalled})" if stalled else ")"
        models = [self.checkpoints.final_folder(last=False)]
        if progress.best_epoch not in (None, last_epoch):
            models.append(f"{self.checkpoints.final_folder(last=True)} (the last epoch's)")
        get_logger().info(
            "run finished in %s: step %d, %s; model: %s; metrics: %s",
            format_duration(seconds), progress.global_step, best,
            ", ".join(os.path.join(output_dir, folder) for folder in models),
            os.path.join(output_dir, layout.METRICS_FILE),
        )  # fmt: skip

    def finish_finished_run(self, progress: TrainProgress) -> None:
        """A resume of a run that had ended: it says so and changes nothing, unless its final export is
        missing (killed during it), which it writes. Collective."""
        last_epoch = progress.epoch if progress.samples_consumed else progress.epoch - 1
        last = progress.best_epoch is not None and progress.best_epoch != last_epoch
        folder = os.path.join(self.train_config.output_dir, self.checkpoints.final_folder(last))
        reason, train_on = self.ending(progress)
        if rank0_decides(lambda: os.path.isdir(folder)):  # one answer: the export below is collective
            get_logger().info(
                "the run in %s had finished (%s; step %d): nothing to do, nothing changed. To train on, resume "
                "with %s.",
                self.train_config.output_dir, reason, progress.global_step, train_on,
            )  # fmt: skip
            return
        get_logger().warning(
            "the run had finished (%s), but its final model %s is missing: writing it", reason, folder
        )
        self.final_export(progress, last_epoch)

    def _validation(self, epoch: int, stop: StopRequest) -> float | None:
        """The tutorial's validation(): the token-mean loss over the validation articles of every rank.
        Abandoned on every rank within two batches of a SIGTERM on any (StopAgreed)."""
        if self.loaders.val is None:
            return None
        with progress_bar(len(self.loaders.val), f"Validation epoch {epoch}", unit="batch", colour="green") as bar:
            return validate(
                self.model,
                self.loaders.val,
                device=self.info.device,
                num_real_samples=self.loaders.val_num_real_samples,
                progress=bar,
                stop_requested=lambda: stop.requested,
                spec=self.spec,
            )

    def _evaluate(self, epoch: int, step: int, stop: StopRequest) -> dict | None:
        """ROUGE of the evaluation set (collective): the eval record, also written to metrics.jsonl.
        Abandoned on every rank within two batches of a SIGTERM on any (StopAgreed)."""
        if self.evaluator is None:
            return None
        record = self.evaluator.evaluate(self.model, epoch, step, lambda: stop.requested)
        self.metrics.write(record)
        return record

    def _evaluate_midway(self, epoch: int, step: int, step_log: StepLog | None, stop: StopRequest) -> None:
        """--eval_every_n_steps (and --eval_on_start, before any step: no `step_log`): the validation loss (a
        validation record) and ROUGE (an eval record) inside an epoch. Collective; flushes the step log first,
        so a NaN step stops the run before it is evaluated. The validation record is written after ROUGE: a
        stop during either leaves neither in metrics.jsonl, and the resumed run writes both
        (TrainProgress.evaluation_due)."""
        if step_log is not None:
            step_log.flush()
        val_loss = self._validation(epoch, stop)
        self._evaluate(epoch, step, stop)
        if val_loss is not None:
            record = {"type": "validation", "epoch": epoch, "step": step, "val_loss": val_loss,
                      **self.spec.loss_metrics(val_loss)}  # fmt: skip
            get_logger().info("step %d: val_loss %s", step, _val_loss_text(record))
            self.metrics.write(record)
        self.model.train()

    def _write_memory_account(self, step: int, first_batch: dict, saved_activation_bytes: int) -> None:
        """The memory records (utils/observe/memory.py) after this process's first optimizer step, `step`: a
        run's start, and each resume's (whose load restored a checkpoint)."""
        counted = self.spec.batch_shape(first_batch)
        for record in memory_records(
            self.model, self.optimizer, self.info.device, self.memory_baseline, saved_activation_bytes, counted
        ):
            self.metrics.write({**record, "step": step})

    def _epoch_record(
        self,
        epoch: int,
        step_log: StepLog,
        val_loss: float | None,
        epoch_seconds: float,
        train_seconds: float,
        peaks: list[int] | None,
    ) -> dict:
        """metrics.jsonl's epoch record: losses are token means over all ranks, rates over training time."""
        totals = step_log.totals
        flops = float(totals[MODEL_FLOPS]), float(totals[HARDWARE_FLOPS])
        trained_tokens = float(totals[TARGET_TOKENS])  # 0 when --on_nonfinite skip skipped every step
        return {
            "type": "epoch",
            "epoch": epoch,
            "train_loss": float(totals[LOSS_SUM]) / trained_tokens if trained_tokens else None,
            "val_loss": val_loss,
            **self.spec.loss_metrics(val_loss),
            "epoch_seconds": epoch_seconds,
            "samples_per_s": int(totals[SAMPLES]) / train_seconds,
            "tokens_per_s": int(totals[INPUT_TOKENS]) / train_seconds,
            **self.throughput.rates(*flops, train_seconds),
            "peak_memory_bytes": peaks,
        }

    def _write_steps(self, epoch: int, records: list[dict]) -> None:
        for record in records:
            self.metrics.write({"type": "step", "epoch": epoch, **record})


@dataclasses.dataclass
class EpochPass:
    """How a pass over the train loader ended (Trainer._train_pass)."""

    step: int  # the global step reached
    step_log: StepLog
    batches_done: int = 0  # loader batches of this pass (micro-batches)
    stopped: bool = False  # a stop request ended it (after its checkpoint)
    continue_with: str = "continue with --resume true"
    epoch_finished: bool = False  # the loader's end was reached (else --max_steps or a stop ended it)
    train_seconds: float = 0.0  # the epoch's training time (evaluations and saves inside it left out)
    position: TrainProgress | None = None  # where a checkpoint taken now resumes


def inside_epoch(
    progress: TrainProgress, samples_consumed: int, step: int, step_log: StepLog, train_seconds: float
) -> TrainProgress:
    """The position inside an epoch that a checkpoint resumes from: the samples of the epoch's order trained
    so far, the step, the epoch's flushed statistics and training seconds (the step log must be flushed)."""
    return dataclasses.replace(
        progress,
        samples_consumed=samples_consumed,
        global_step=step,
        epoch_totals=step_log.totals.tolist(),
        epoch_train_seconds=train_seconds,
    )


class EpochClock:
    """An epoch's training seconds: evaluation and checkpoint saves inside the epoch are taken out of them
    (and out of the current step-log window), so throughput, TFLOP/s and MFU are over training time only.
    `seconds_before`: the training seconds a resumed epoch had before its checkpoint."""

    def __init__(self, seconds_before: float):
        self.seconds_before = seconds_before
        self.started = time.perf_counter()

    def train_seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.started

    @contextlib.contextmanager
    def paused(self, step_log: StepLog):
        start = time.perf_counter()
        try:
            yield
        finally:
            paused = time.perf_counter() - start
            self.started += paused
            step_log.window_start += paused


def _log_epoch(record: dict, peaks: list[int] | None) -> None:
    train_loss, val_loss = record["train_loss"], record["val_loss"]
    get_logger().info(
        "epoch %d: train_loss %s | val_loss %s | %.1f s | %.1f samples/s | peak memory per rank %s",
        record["epoch"],
        "- (every step skipped)" if train_loss is None else f"{train_loss:.4f}",
        "-" if val_loss is None else _val_loss_text(record),
        record["epoch_seconds"],
        record["samples_per_s"],
        "-" if peaks is None else ", ".join(f"{p / 2**20:.0f} MiB" for p in peaks),
    )


def _val_loss_text(record: dict) -> str:
    """A record's validation loss as the log says it, with the perplexity where the spec gives one."""
    perplexity = f" (perplexity {record['val_perplexity']:.2f})" if "val_perplexity" in record else ""
    return f"{record['val_loss']:.4f}{perplexity}"


def _groups(loader, size: int):
    """The loader's batches in lists of `size` (the last list may be shorter)."""
    group = []
    for batch in loader:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group
