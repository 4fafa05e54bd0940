"""The training loop as one object: epochs of steps, validation, the LR schedule, metrics and checkpoints.

    trainer = Trainer(trainables, loaders, checkpointer, train_config, info, measures)
    trainer.resume(checkpoint)        # optional
    finished = trainer.train()        # False: stopped early on SIGTERM, after a checkpoint

Each concern is one method: `_train_pass` (one pass over the loader), `_train_step`, `_end_pass_early`
(periodic evaluation, periodic and SIGTERM checkpoints inside an epoch), `_validate`, `_finish_epoch`
(record, best model, checkpoint); while training, `_advance_progress` is the one place where the progress
a checkpoint records changes (`resume` sets it from a checkpoint before training starts).
"""

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from configs.training import TrainConfig
from utils.checkpoint.checkpointer import Checkpointer
from utils.checkpoint.layout import METRICS_FILE
from utils.data.loaders import Loaders
from utils.distributed.process_group import DistInfo, any_rank
from utils.eval.evaluator import Evaluator
from utils.eval.generation import GenerationSettings
from utils.observe.flops import Throughput
from utils.observe.log import get_logger
from utils.observe.memory import (
    MemoryBaseline,
    SavedTensorCounter,
    gather_peaks,
    memory_records,
    reset_peak_memory,
)
from utils.observe.metrics import MetricsWriter, open_metrics
from utils.train.preemption import StopRequest
from utils.train.progress import TrainProgress
from utils.train.step import (
    HARDWARE_FLOPS,
    INPUT_TOKENS,
    LOSS_SUM,
    MODEL_FLOPS,
    SAMPLES,
    TARGET_TOKENS,
    StepSettings,
    move_batch,
    train_step,
    validate,
)
from utils.train.step_log import StepLog
from utils.train.trainables import Trainables


@dataclass(frozen=True)
class Measures:
    """What the run's figures are measured against: the memory before the model (the memory account) and
    the FLOP counting and peak (model/hardware TFLOP/s and MFU in step and epoch records)."""

    memory_baseline: MemoryBaseline
    throughput: Throughput


@dataclass
class EpochPass:
    """One pass over the training loader: a whole epoch, or the rest of one after a resume."""

    epoch: int
    batches: int  # in this pass
    samples_per_batch: int  # one micro-batch of every rank
    start_consumed: int  # samples of the epoch's order trained before this pass
    seconds_before: float  # training seconds of the epoch before this pass
    step: int  # global step of the last finished batch
    step_log: StepLog
    batches_done: int = 0
    stopped: bool = False  # ended early on SIGTERM (after a checkpoint, if checkpoints are on)
    seconds: float = 0.0  # the epoch's training seconds, once the pass has ended
    started: float = field(default_factory=time.perf_counter)

    def samples_consumed(self) -> int:
        return self.start_consumed + self.batches_done * self.samples_per_batch

    def train_seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.started


class Trainer:
    """Owns one run's training: the trainables, loaders, checkpointer, metrics writer and progress."""

    def __init__(
        self,
        trainables: Trainables,
        loaders: Loaders,
        checkpointer: Checkpointer,
        config: TrainConfig,
        info: DistInfo,
        measures: Measures,
    ):
        self.trainables = trainables
        self.loaders = loaders
        self.checkpointer = checkpointer
        self.config = config
        self.info = info
        self.measures = measures
        self.progress = TrainProgress()
        self.last_epoch = 0  # the epoch trained last in this run
        self.step_settings = StepSettings(
            config.max_grad_norm,
            sync_each_micro_batch=config.accumulate_grad_sync,
            skip_nonfinite=config.on_nonfinite == "skip",
            flops=measures.throughput.flops,
            recompute=measures.throughput.recompute,
        )
        self.resumed = False
        self.evaluator = None
        if loaders.evaluation is not None:
            settings = GenerationSettings.from_config(config)
            self.evaluator = Evaluator(loaders.evaluation, settings, config.output_dir, info)
        self.memory_account_due = True  # written once, after the run's first optimizer step
        self.metrics: MetricsWriter | None = None  # open while train() runs
        self.stop: StopRequest | None = None  # installed while train() runs

    def resume(self, checkpoint: str) -> None:
        """Continue from a checkpoint folder: weights (sharded ones; full ones were loaded before
        wrapping), optimizer, scheduler, scaler, RNG and progress. Collective."""
        self.progress = self.checkpointer.restore(checkpoint)
        self.resumed = True
        get_logger().info(
            "resumed from %s: epoch %d, step %d", checkpoint, self.progress.epoch, self.progress.global_step
        )

    def train(self) -> bool:
        """Train from the current progress to the last epoch. Returns False if SIGTERM stopped it early
        (after saving a checkpoint). Collective."""
        resumed_at = (self.progress.global_step, self.progress.epoch) if self.resumed else None
        path = os.path.join(self.config.output_dir, METRICS_FILE)
        self.metrics = open_metrics(path, self.info.is_main, resumed_at, self.config.tensorboard)
        try:
            with StopRequest() as self.stop:
                while self.progress.epoch <= self.config.epochs and not self._done_early():
                    self.last_epoch = self.progress.epoch
                    if not self._run_epoch():
                        return False
            self._export_final_model()
            return True
        finally:
            self.metrics.close()

    def _run_epoch(self) -> bool:
        """Train, validate, step the LR, record and save one epoch. False when a stop ended the run."""
        epoch = self.progress.epoch
        if self.config.track_memory:
            reset_peak_memory(self.info.device)
        epoch_start = time.perf_counter()
        pass_ = self._train_pass()
        if pass_.stopped:
            get_logger().info("stopped at step %d on SIGTERM; continue with --resume true", pass_.step)
            return False
        val_loss = self._validate(epoch)
        scores = self._evaluate(epoch, pass_.step)
        if not self.trainables.per_step_schedule:
            self.trainables.scheduler.step()
        self._finish_epoch(pass_, val_loss, scores, epoch_start)
        if any_rank(self.stop.requested, self.info.device):
            get_logger().info("stopped after epoch %d on SIGTERM; continue with --resume true", epoch)
            return False
        return True

    def _new_pass(self) -> EpochPass:
        """The pass from the current progress. Without set_epoch every epoch would see the same order; a
        resumed epoch skips what the checkpoint already trained on."""
        progress = self.progress
        self.loaders.train_sampler.set_epoch(progress.epoch, progress.samples_consumed)
        step_log = StepLog(
            self.config.log_every_n_steps,
            lambda records, epoch=progress.epoch: self._write_steps(epoch, records),
            lambda: self.stop.requested,
            totals=progress.epoch_totals,
            # fp16's scaler skips non-finite steps by design (they calibrate its scale): never a reason to stop.
            stop_on_nonfinite=self.config.on_nonfinite == "stop" and self.trainables.scaler is None,
            throughput=self.measures.throughput,
        )
        return EpochPass(
            epoch=progress.epoch,
            batches=len(self.loaders.train),
            samples_per_batch=self.config.batch_size_training * self.info.world_size,
            start_consumed=progress.samples_consumed,
            seconds_before=progress.epoch_train_seconds if progress.samples_consumed else 0.0,
            step=progress.global_step,
            step_log=step_log,
        )

    def _train_pass(self) -> EpochPass:
        """One pass over the training loader, ended early only to checkpoint and stop."""
        pass_ = self._new_pass()
        done_before = pass_.start_consumed // pass_.samples_per_batch
        self.trainables.model.train()
        with self._bar(pass_.batches + done_before, f"Training epoch {pass_.epoch}", "blue", done_before) as bar:
            for micro_batches in _groups(self.loaders.train, self.config.gradient_accumulation_steps):
                self._train_step(micro_batches, pass_)
                bar.update(len(micro_batches))
                _show_latest(bar, pass_.step_log)
                if self._end_pass_early(pass_):
                    break
        pass_.step_log.flush()
        pass_.seconds = pass_.train_seconds()
        return pass_

    def _train_step(self, micro_batches: list[dict], pass_: EpochPass) -> None:
        """One optimizer step on one batch or several accumulated micro-batches; the run's first step also
        writes the memory account."""
        model, optimizer, scaler = self.trainables.model, self.trainables.optimizer, self.trainables.scaler
        pass_.step += 1
        batches = [move_batch(batch, self.info.device) for batch in micro_batches]
        settings, counter = self.step_settings, None
        if self.memory_account_due:  # the run's first step also counts what backward keeps
            counter = SavedTensorCounter()
            settings = dataclasses.replace(settings, saved_counter=counter)
        stats = train_step(model, batches, optimizer, scaler, self.info.world_size, settings)
        pass_.step_log.add(pass_.step, optimizer.param_groups[0]["lr"], stats)
        pass_.batches_done += len(micro_batches)
        if self.trainables.per_step_schedule:
            self.trainables.scheduler.step()
        if self.memory_account_due:  # AdamW's state exists from the first step on
            baseline = self.measures.memory_baseline
            counted = (*batches[0]["source_ids"].shape, batches[0]["target_ids"].shape[1])
            for record in memory_records(model, optimizer, self.info.device, baseline, counter.bytes, counted):
                self.metrics.write(record)
            self.memory_account_due = False

    def _end_pass_early(self, pass_: EpochPass) -> bool:
        """Periodic evaluation, periodic and SIGTERM checkpoints inside an epoch. True when the pass must end
        now: at --max_steps (the epoch then ends as usual, and train() ends the run), or on SIGTERM
        (pass_.stopped; saved first if checkpoints are on). The epoch's last batch is left to _finish_epoch."""
        if pass_.batches_done == pass_.batches:
            return False
        if self.budget_spent(pass_.step):
            return True
        every = self.config.eval_every_n_steps
        if every and pass_.step % every == 0:
            with _off_the_clock(pass_):
                self._evaluate_midway(pass_)
        if self.checkpointer.due(pass_.step, pass_.step_log.stop_requested):
            pass_.step_log.flush()  # collective; afterwards metrics.jsonl holds every step the checkpoint holds
            self._advance_progress(pass_)
            with _off_the_clock(pass_):
                self.checkpointer.save(self.progress)
        pass_.stopped = pass_.step_log.stop_requested
        return pass_.stopped

    def _evaluate_midway(self, pass_: EpochPass) -> None:
        """--eval_every_n_steps: the validation loss (a validation record) and ROUGE (an eval record) inside
        an epoch. Collective; flushes the step log first, so a NaN step stops the run before it is evaluated."""
        pass_.step_log.flush()
        val_loss = self._validate(pass_.epoch)
        if val_loss is not None:
            get_logger().info("step %d: val_loss %.4f", pass_.step, val_loss)
            self.metrics.write(
                {"type": "validation", "epoch": pass_.epoch, "step": pass_.step, "val_loss": val_loss}
            )
        self._evaluate(pass_.epoch, pass_.step)
        self.trainables.model.train()

    def _done_early(self) -> bool:
        """--max_steps reached, or --early_stopping_patience epochs without a new best (from the best epoch
        kept in the progress, so the count is the same after a resume)."""
        if self.budget_spent(self.progress.global_step):
            return True
        patience, best = self.config.early_stopping_patience, self.progress.best_epoch
        if patience and best is not None and self.progress.epoch - 1 - best >= patience:
            get_logger().info(
                "early stopping: %d epochs without a better %s than epoch %d's",
                patience,
                self.config.metric_for_best,
                best,
            )
            return True
        return False

    def budget_spent(self, step: int) -> bool:
        """Whether --max_steps optimizer steps are done."""
        return 0 < self.config.max_steps <= step

    def _evaluate(self, epoch: int, step: int) -> dict | None:
        """ROUGE of the evaluation set (collective): the eval record, also written to metrics.jsonl."""
        if self.evaluator is None:
            return None
        record = self.evaluator.evaluate(self.trainables.model, epoch, step)
        self.metrics.write(record)
        return record

    def _validate(self, epoch: int) -> float | None:
        if self.loaders.val is None:
            return None
        with self._bar(len(self.loaders.val), f"Validation epoch {epoch}", "green") as bar:
            return validate(
                self.trainables.model,
                self.loaders.val,
                device=self.info.device,
                num_real_samples=self.loaders.val_num_real_samples,
                progress=bar,
            )

    def _finish_epoch(self, pass_: EpochPass, val_loss: float | None, scores: dict | None, epoch_start: float):
        """The epoch record and log line, the best model (.pt, hf_model/), then the epoch-end checkpoint."""
        peaks, reserved = gather_peaks(self.info.device) if self.config.track_memory else (None, None)
        record = self._epoch_record(pass_, val_loss, time.perf_counter() - epoch_start, peaks)
        if reserved is not None:
            record["peak_memory_reserved_bytes"] = reserved
        self.metrics.write(record)
        _log_epoch(record, peaks)
        name = self.config.metric_for_best
        metric = val_loss if name == "val_loss" else (scores or {}).get(name)
        improved = metric is not None and is_better(name, metric, self.progress.best_metric)
        # Without a metric there is no "best": every epoch's .pt is saved, under its own name.
        if self.config.save_model and (improved or metric is None):
            self.checkpointer.save_full_model(pass_.epoch, val_loss)
        best = (metric, pass_.epoch) if improved else (self.progress.best_metric, self.progress.best_epoch)
        if improved:
            get_logger().info("new best %s %.4f (epoch %d)", name, metric, pass_.epoch)
            self.checkpointer.export_hf()
        self._advance_progress(pass_, best)
        self.checkpointer.save(self.progress)

    def _export_final_model(self) -> None:
        """hf_model/ holds the best epoch's model; the final one goes there when there is no metric, or
        beside it (hf_model_last/) when the last epoch was not the best. Collective."""
        if self.progress.best_epoch is None:
            self.checkpointer.export_hf()
        elif self.progress.best_epoch != self.last_epoch:
            self.checkpointer.export_hf(last=True)

    def _epoch_record(
        self, pass_: EpochPass, val_loss: float | None, epoch_seconds: float, peaks: list[int] | None
    ) -> dict:
        """metrics.jsonl's epoch record: losses are token means over all ranks, rates over training time."""
        totals = pass_.step_log.totals
        flops = float(totals[MODEL_FLOPS]), float(totals[HARDWARE_FLOPS])
        trained_tokens = float(totals[TARGET_TOKENS])  # 0 when --on_nonfinite skip skipped every step
        return {
            "type": "epoch",
            "epoch": pass_.epoch,
            "train_loss": float(totals[LOSS_SUM]) / trained_tokens if trained_tokens else None,
            "val_loss": val_loss,
            "epoch_seconds": epoch_seconds,
            "samples_per_s": int(totals[SAMPLES]) / pass_.seconds,
            "tokens_per_s": int(totals[INPUT_TOKENS]) / pass_.seconds,
            **self.measures.throughput.rates(*flops, pass_.seconds),
            "peak_memory_bytes": peaks,
        }

    def _advance_progress(self, pass_: EpochPass, best: tuple[float | None, int | None] | None = None) -> None:
        """The one place progress changes. Inside a pass it records the position a checkpoint resumes
        from (the step log must be flushed); after the pass's last batch it points at the next epoch, with
        `best` = (best metric, its epoch) after this epoch."""
        if pass_.batches_done == pass_.batches:
            metric, epoch = best
            self.progress = TrainProgress(
                epoch=pass_.epoch + 1, global_step=pass_.step, best_metric=metric, best_epoch=epoch
            )
            return
        self.progress = dataclasses.replace(
            self.progress,
            samples_consumed=pass_.samples_consumed(),
            global_step=pass_.step,
            epoch_totals=pass_.step_log.totals.tolist(),
            epoch_train_seconds=pass_.train_seconds(),
        )

    def _write_steps(self, epoch: int, records: list[dict]) -> None:
        for record in records:
            self.metrics.write({"type": "step", "epoch": epoch, **record})

    def _bar(self, total: int, desc: str, colour: str, initial: int = 0) -> tqdm:
        # Rank 0 only: N ranks drawing N bars on one terminal is unreadable.
        return tqdm(
            total=total,
            initial=initial,
            desc=desc,
            colour=colour,
            disable=not self.info.is_main,
            dynamic_ncols=True,
        )


@contextlib.contextmanager
def _off_the_clock(pass_: EpochPass):
    """Evaluation and checkpoint saves inside a pass: their time is taken out of the epoch's training
    seconds and of the current step window, so throughput, TFLOP/s and MFU are over training time only."""
    start = time.perf_counter()
    try:
        yield
    finally:
        paused = time.perf_counter() - start
        pass_.started += paused
        pass_.step_log.window_start += paused


def _show_latest(bar: tqdm, step_log: StepLog) -> None:
    """The newest flushed window's loss, all ranks' tokens per second and MFU, beside the bar (rank 0)."""
    if step_log.latest_loss is not None:
        shown = {"loss": f"{step_log.latest_loss:.3f}", "tokens_per_s": f"{step_log.latest_tokens_per_s:.0f}"}
        if step_log.latest_mfu is not None:
            shown["mfu"] = f"{step_log.latest_mfu:.1%}"
        bar.set_postfix(shown, refresh=False)


def is_better(metric_name: str, value: float, best: float | None) -> bool:
    """Lower is better for val_loss, higher for the ROUGE scores. A NaN or infinite value is never better
    (a diverged epoch must not become the exported model), and replaces a best that is not finite."""
    if not math.isfinite(value):
        return False
    if best is None or not math.isfinite(best):
        return True
    return value < best if metric_name == "val_loss" else value > best


def _log_epoch(record: dict, peaks: list[int] | None) -> None:
    train_loss, val_loss = record["train_loss"], record["val_loss"]
    get_logger().info(
        "epoch %d: train_loss %s | val_loss %s | %.1f s | %.1f samples/s | peak memory per rank %s",
        record["epoch"],
        "- (every step skipped)" if train_loss is None else f"{train_loss:.4f}",
        "-" if val_loss is None else f"{val_loss:.4f}",
        record["epoch_seconds"],
        record["samples_per_s"],
        "-" if peaks is None else ", ".join(f"{p / 2**20:.0f} MiB" for p in peaks),
    )


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
