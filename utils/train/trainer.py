"""The training loop: epochs of steps, validation, ROUGE, the LR schedule, the epoch's end and checkpoints.

    trainer = Trainer(model=model, optimizer=optimizer, ..., spec=spec)
    trainer.lay_out(progress)                           # where it ends; the LR schedule over the steps left
    finished = trainer.train(progress, resumed, stop)   # False: stopped early (SIGTERM, Ctrl-C), saved first

`train` is the tutorial's `for epoch in range(1, epochs + 1): train(); validation(); scheduler.step(); save`,
read top to bottom in one method, with what this package adds as named steps inside it: a resumed epoch
starting mid-way (`_train_pass`), periodic evaluation and checkpoints inside an epoch, SIGTERM and Ctrl-C,
--max_steps and early stopping, the epoch's end (`_end_epoch`: its record, the best model, its checkpoint).
Beside it: the policies it asks (utils/train/policies.py: the best model by --metric_for_best, when the run
ends) and what it records and shows (utils/train/records.py). One optimizer step's arithmetic (forward,
token-mean loss, backward, clipping, optimizer step) is utils/train/step.py's `train_step`.
"""

import contextlib
import dataclasses
import itertools
import math
import os
import time

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim.lr_scheduler import LRScheduler

from configs.evaluation import EvalConfig
from configs.observability import ObserveConfig
from configs.recipe import RecipeConfig
from configs.training import TrainConfig
from utils.base.log import get_logger, progress_bar
from utils.checkpoint.final_models import FinalModels
from utils.checkpoint.manager import CheckpointManager
from utils.checkpoint.progress import TrainProgress
from utils.data.loaders import Loaders, move_batch
from utils.distributed.hang_report import WHERE
from utils.distributed.process_group import DistInfo, StopAgreed, any_rank, rank0_decides
from utils.eval.evaluator import Evaluator
from utils.fsdp.parallelism import Parallelism
from utils.fsdp.shard import forward_warnings_ignored
from utils.observe.flops import Throughput
from utils.observe.memory import MemoryBaseline, SavedTensorCounter, reset_peak_memory
from utils.observe.profiler import StepProfiler
from utils.spec import ModelSpec
from utils.train import optim
from utils.train.policies import BestModel, RunEnd
from utils.train.preemption import StopRequest, StopVote
from utils.train.records import RunRecords
from utils.train.step import StepSettings, train_step, validate
from utils.train.step_log import StepLog


class Trainer:
    """One run's training: handed the sharded model, its optimizer, scheduler and scaler, the loaders, the
    checkpoint manager, the final models and the evaluator (None without ROUGE) once."""

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
        final_models: FinalModels,
        evaluator: Evaluator | None,
        final_evaluator: Evaluator | None,
        info: DistInfo,
        train: TrainConfig,
        recipe: RecipeConfig,
        evaluation: EvalConfig,
        observe: ObserveConfig,
        throughput: Throughput,
        memory_baseline: MemoryBaseline,
        spec: ModelSpec,
        recomputes: bool,
    ):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.loaders, self.checkpoints, self.evaluator, self.info = loaders, checkpoints, evaluator, info
        self.final_evaluator = final_evaluator  # generation on the split scored once after training, if any
        self.train_config, self.recipe, self.evaluation, self.observe = train, recipe, evaluation, observe
        self.throughput, self.spec = throughput, spec
        # Backward runs forward ops again (activation checkpointing of either scope, the chunked loss's head).
        self.recomputes = recomputes
        self.end = RunEnd(train, recipe, evaluation)
        self.best = BestModel(evaluation, train.save_model, spec, final_models)
        self.records = RunRecords(
            train=train, observe=observe, info=info, spec=spec, throughput=throughput,
            memory_baseline=memory_baseline, recipe=recipe,
        )  # fmt: skip
        self.step_settings = StepSettings(
            parallelism, max_grad_norm=recipe.max_grad_norm, sync_each_micro_batch=recipe.accumulate_grad_sync,
            skip_nonfinite=recipe.on_nonfinite == "skip", flops=throughput.flops, recompute=throughput.recompute,
            recompute_head=throughput.recompute_head, spec=spec,
        )  # fmt: skip
        # The global step and epoch the run ends at (for the time left), and what a resume in another shape
        # changed in the LR schedule: set by lay_out, before training starts.
        self.total_steps, self.last_epoch, self.schedule_change = 0, 0, None
        self.memory_account_due = True  # written once per process, after its first optimizer step
        self.stop_vote = StopVote(info.world_size)  # collective: every rank makes its gloo group

    def train(self, progress: TrainProgress, resumed: bool, stop: StopRequest) -> bool:
        """Train from `progress` (a new run's, or a checkpoint's) to the last epoch, then export the final
        model. Returns False if a stop request (SIGTERM, Ctrl-C, which `stop` watches from the first step on)
        ended it early, after a checkpoint. Collective."""
        started = time.perf_counter()
        resumed_at = (progress.global_step, progress.epoch) if resumed else None
        last_epoch = 0  # the epoch trained last in this run
        # The metrics and their sinks are closed however training ends; a tracker learns if it failed.
        with self.records.open(resumed_at, self.total_steps):
            # --profile_start_step's traces, and on CUDA an out-of-memory error's memory snapshot.
            profiler = StepProfiler(self.observe, self.train_config.output_dir, self.info.rank, self.info.device,
                                    progress.global_step, recompute=self.recomputes)  # fmt: skip
            if self.observe.profile_start_step > self.total_steps:
                get_logger().warning(
                    "--profile_start_step %d: this run trains steps up to %d, so nothing is profiled",
                    self.observe.profile_start_step, self.total_steps,
                )  # fmt: skip
            if not self.end.done(progress) and progress.global_step < self.total_steps:
                # The load phase is over (scripts/checkpoint_costs.py reads this line). A run resumed for its
                # last evaluation alone has no step left to name.
                get_logger().info(
                    "training steps %d-%d, from epoch %d of %d%s",
                    progress.global_step + 1, self.total_steps, progress.epoch, self.last_epoch,
                    f"; {self.schedule_change}" if self.schedule_change else "",
                )  # fmt: skip
            with forward_warnings_ignored(), profiler, stop.watching():
                if self.evaluation.eval_on_start and progress.global_step == 0 and not resumed:
                    try:
                        self._evaluate_midway(progress.epoch, 0, None, stop)  # the model as it starts: step 0
                    except StopAgreed:
                        get_logger().info("stopped during the evaluation before training on %s", stop.name)
                        return False
                while not self.end.done(progress):
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
                        get_logger().info("stopped during epoch %d's evaluation on %s; --resume true evaluates it",
                                          epoch, stop.name)  # fmt: skip
                        return False
                    if self.recipe.lr_scheduler == "step" and run.epoch_finished:  # StepLR steps at the epoch's
                        self.scheduler.step()  # real end: a checkpoint inside it resumes at its learning rate

                    # ---- the epoch record, the best model (.pt, hf_model/), then the epoch's checkpoint
                    progress = self._end_epoch(run, val_loss, scores, progress, epoch_start)
                    if any_rank(stop.requested, self.info.device):
                        get_logger().info(
                            "stopped after epoch %d on %s; continue with --resume true", epoch, stop.name
                        )
                        return False
            get_logger().info("training ends: %s", self.end.done(progress))
            self.best.export_final(progress, last_epoch)
            self.records.summary(progress, last_epoch, time.perf_counter() - started, self.best)
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
        # fp16's scaler skips non-finite steps by design (they calibrate its scale): never a reason to stop.
        stop_on_nonfinite = recipe.on_nonfinite == "stop" and self.scaler is None
        step_log = StepLog(
            self.observe.log_every_n_steps, lambda records: self.records.steps(epoch, records),
            totals=progress.epoch_totals, stop_on_nonfinite=stop_on_nonfinite, throughput=self.throughput,
            stall=self.records.stall,
        )  # fmt: skip
        clock = EpochClock(progress.epoch_train_seconds if progress.samples_consumed else 0.0)
        total_batches = len(self.loaders.train)
        samples_per_batch = train.batch_size_training * info.world_size
        done_before = progress.samples_consumed // samples_per_batch
        run = EpochPass(step=progress.global_step, step_log=step_log)
        # The pass's last step (the epoch's end, or the run's: lay_out) saves anyway: a stop is saved there at the
        # latest.
        last_step = min(run.step + optim.steps_per_epoch(recipe, total_batches), self.total_steps)

        def position(evaluation_due: bool = False) -> TrainProgress:
            """Where the pass stands, as a checkpoint resumes it: the samples of the epoch's order trained so far,
            the step, the epoch's flushed statistics and training seconds (the step log must be flushed)."""
            consumed = progress.samples_consumed + run.batches_done * samples_per_batch
            return dataclasses.replace(
                progress, samples_consumed=consumed, global_step=run.step, epoch_totals=step_log.totals.tolist(),
                epoch_train_seconds=clock.train_seconds(), evaluation_due=evaluation_due,
            )  # fmt: skip

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
                self.records.show_progress(bar, step_log, epoch, total_batches - run.batches_done)
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
            self.records.show_progress(bar, step_log, epoch, total_batches - run.batches_done)
        run.epoch_finished = run.batches_done == total_batches
        run.train_seconds = clock.train_seconds()
        run.position = position()
        return run

    def lay_out(self, progress: TrainProgress) -> None:
        """Where the run that starts from `progress` ends, counted in this run's batches and ranks; a resume that
        changed the run's shape spreads the rest of the LR schedule over the steps it has left (and is refused,
        a ConfigError, where a decayed schedule had ended). Before anything of the run is written."""
        left, self.last_epoch = self._steps_left(progress)
        self.total_steps = progress.global_step + left
        max_steps = self.recipe.max_steps
        if max_steps and progress.global_step < max_steps:
            get_logger().info("%s", optim.run_length(max_steps, self._epoch_steps(0)))
        self.schedule_change = optim.continue_schedule(
            self.scheduler, progress.global_step, self.total_steps, self.train_config.output_dir
        )

    def _steps_left(self, progress: TrainProgress) -> tuple[int, int]:
        """The optimizer steps this run has left from `progress`, and the epoch it ends in: the rest of its epoch
        from the data position (in this run's batches and ranks, which a resume may have changed) and the later
        epochs', to --epochs; or --max_steps's, over as many epochs as they take (the last one partial); none
        once it is done."""
        if self.end.done(progress):
            return 0, progress.epoch
        this_epoch, every_epoch = self._epoch_steps(progress.samples_consumed), self._epoch_steps(0)
        if not self.recipe.max_steps:
            later_epochs = self.train_config.epochs - progress.epoch
            return this_epoch + later_epochs * every_epoch, self.train_config.epochs
        left = self.recipe.max_steps - progress.global_step
        return left, progress.epoch + max(math.ceil((left - this_epoch) / every_epoch), 0)

    def _epoch_steps(self, samples_consumed: int) -> int:
        """The optimizer steps of an epoch once `samples_consumed` of its order were trained on (in this run's
        batches and ranks)."""
        batches = math.ceil(
            self.loaders.train_sampler.share_after(samples_consumed) / self.train_config.batch_size_training
        )
        return optim.steps_per_epoch(self.recipe, batches)

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
            self.records.memory_account(self.model, self.optimizer, step, batches[0], settings.saved_counter.bytes)
            self.memory_account_due = False

    def _end_epoch(
        self,
        run: "EpochPass",
        val_loss: float | None,
        scores: dict | None,
        progress: TrainProgress,
        epoch_start: float,
    ) -> TrainProgress:
        """The epoch record, the best model by --metric_for_best (hf_model/, the --save_model .pt), and the
        epoch's checkpoint. Returns where the next epoch starts (inside this one when --max_steps ended it)."""
        epoch = progress.epoch
        self.records.epoch(epoch, run.step_log, val_loss, epoch_start, run.train_seconds)
        best_metric, best_epoch = self.best.keep(progress, val_loss, scores, self.records.stall.stalled_since)
        # The next epoch starts at its beginning; where --max_steps ended this one early, inside it.
        following = TrainProgress(epoch=epoch + 1, global_step=run.step) if run.epoch_finished else run.position
        following = dataclasses.replace(following, best_metric=best_metric, best_epoch=best_epoch)
        if self.end.done(following):  # training ends here: the split scored once after it, in this checkpoint
            self._score_final(epoch, run.step)
        self.checkpoints.save(following)
        return following

    def finish_finished_run(self, progress: TrainProgress) -> None:
        """A resume of a run that had ended: it says so and changes nothing, unless its final export is
        missing (killed during it), which it writes. Collective."""
        last_epoch = progress.epoch if progress.samples_consumed else progress.epoch - 1
        last = self.best.last_apart(progress, last_epoch)
        folder = os.path.join(self.train_config.output_dir, self.best.final_models.final_folder(last))
        reason, train_on = self.end.ending(progress)
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
        self.best.export_final(progress, last_epoch)

    def _validation(self, epoch: int, stop: StopRequest) -> float | None:
        """The tutorial's validation(): the token-mean loss over the validation articles of every rank.
        Abandoned on every rank within two batches of a SIGTERM on any (StopAgreed)."""
        if self.loaders.val is None:
            return None
        with progress_bar(len(self.loaders.val), f"Validation epoch {epoch}", unit="batch", colour="green") as bar:
            return validate(
                self.model, self.loaders.val, device=self.info.device, spec=self.spec, progress=bar,
                num_real_samples=self.loaders.val_num_real_samples, stop_requested=lambda: stop.requested,
            )  # fmt: skip

    def _evaluate(self, epoch: int, step: int, stop: StopRequest) -> dict | None:
        """ROUGE of the evaluation set (collective): the eval record, also written to metrics.jsonl.
        Abandoned on every rank within two batches of a SIGTERM on any (StopAgreed)."""
        if self.evaluator is None:
            return None
        record = self.evaluator.evaluate(self.model, epoch, step, lambda: stop.requested)
        self.records.metrics.write(record)
        return record

    def _score_final(self, epoch: int, step: int) -> None:
        """The split scored once after training (utils/data/cache.py: SplitPlan.final; --eval_split auto's test
        split, where validation is held out of train), by the last step's model: its loss (a test record) and
        generation's scores (an eval record and its predictions file). Before the last checkpoint, so a run
        stopped before it is saved scores it when resumed. Collective."""
        final = self.loaders.final
        if final is None:
            return
        split = self.loaders.plan.final
        with progress_bar(len(final.loader), f"{split.capitalize()} loss", unit="batch", colour="green") as bar:
            loss = validate(
                self.model, final.loader, device=self.info.device, spec=self.spec, progress=bar,
                num_real_samples=final.num_real_samples,
            )  # fmt: skip
        if self.final_evaluator is not None:
            self.records.metrics.write(self.final_evaluator.evaluate(self.model, epoch, step))
        self.records.final(epoch, step, split, loss)

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
            self.records.validation(epoch, step, val_loss)
        self.model.train()


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


def _groups(loader, size: int):
    """The loader's batches in lists of `size` (the last list may be shorter)."""
    batches = iter(loader)
    while group := list(itertools.islice(batches, size)):
        yield group
