"""What a run records and shows of its training, as the loop (utils/train/trainer.py) reaches it: metrics.jsonl's
step, memory, validation and epoch records, their log lines, the progress beside the bar (or as log lines), and
the closing summary."""

import dataclasses
import os
import time

import torch
from torch import nn
from tqdm import tqdm

from configs.observability import ObserveConfig
from configs.recipe import RecipeConfig
from configs.training import TrainConfig
from policies.private_api import compiled_graphs
from utils.base import layout
from utils.base.log import format_duration, get_logger
from utils.checkpoint.progress import TrainProgress
from utils.distributed.process_group import DistInfo
from utils.observe.flops import Throughput
from utils.observe.memory import MemoryBaseline, gather_peaks, memory_records
from utils.observe.metrics import MetricsWriter, open_metrics
from utils.spec import ModelSpec
from utils.train import optim
from utils.train.policies import BestModel
from utils.train.step import HARDWARE_FLOPS, INPUT_TOKENS, LOSS_SUM, MODEL_FLOPS, SAMPLES, TARGET_TOKENS
from utils.train.step_log import StallWatch, StepLog


@dataclasses.dataclass(kw_only=True)
class RunRecords:
    """One run's records, written from `open` on: every rank calls, rank 0 writes and says."""

    train: TrainConfig
    recipe: RecipeConfig
    observe: ObserveConfig
    info: DistInfo
    spec: ModelSpec
    throughput: Throughput
    memory_baseline: MemoryBaseline
    metrics: MetricsWriter | None = None  # open while the run trains
    total_steps: int = 0  # the global step the run ends at, for the time left
    shown_step: int | None = None  # the step last shown
    stall: StallWatch = dataclasses.field(default_factory=StallWatch)
    graphs_before: int = 0  # compiled_graphs() when the run opened its records

    def open(self, resumed_at: tuple[int, int] | None, total_steps: int) -> MetricsWriter:
        """metrics.jsonl and its sinks (cut back to a resume's checkpoint at `resumed_at`, its step and epoch),
        for a run that ends at step `total_steps`; the caller closes them however training ends."""
        self.total_steps = total_steps
        self.graphs_before = compiled_graphs()
        path = os.path.join(self.train.output_dir, layout.METRICS_FILE)
        self.metrics = open_metrics(path, self.info.is_main, resumed_at, self.observe)
        return self.metrics

    def steps(self, epoch: int, records: list[dict]) -> None:
        for record in records:
            self.metrics.write({"type": "step", "epoch": epoch, **record})

    def memory_account(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, first_batch: dict, saved_bytes: int
    ) -> None:
        """The memory records (utils/observe/memory.py) after this process's first optimizer step, `step`: a
        run's start, and each resume's (whose load restored a checkpoint)."""
        counted = self.spec.batch_shape(first_batch)
        for record in memory_records(
            model, optimizer, self.info.device, self.memory_baseline, saved_bytes, counted
        ):
            self.metrics.write({**record, "step": step})

    def validation(self, epoch: int, step: int, val_loss: float) -> None:
        """A validation record inside an epoch (--eval_every_n_steps, --eval_on_start), and its line."""
        record = {"type": "validation", "epoch": epoch, "step": step, "val_loss": val_loss,
                  **self.spec.loss_metrics(val_loss)}  # fmt: skip
        get_logger().info("step %d: val_loss %s", step, val_loss_text(record))
        self.metrics.write(record)

    def final(self, epoch: int, step: int, split: str, loss: float) -> None:
        """The test record of a split scored once after training (SplitPlan.final): its loss (and perplexity,
        where the spec gives one) by the last step's model, and its line."""
        metrics = {key.removeprefix("val_"): value for key, value in self.spec.loss_metrics(loss).items()}
        record = {"type": "test", "epoch": epoch, "step": step, "split": split, "loss": loss, **metrics}
        perplexity = f" (perplexity {metrics['perplexity']:.2f})" if "perplexity" in metrics else ""
        get_logger().info("%s split after training (the last step's model, step %d): loss %.4f%s", split, step,
                          loss, perplexity)  # fmt: skip
        self.metrics.write(record)

    def epoch(
        self, epoch: int, step_log: StepLog, val_loss: float | None, epoch_start: float, train_seconds: float
    ) -> None:
        """metrics.jsonl's epoch record and its line: losses are token means over all ranks, rates over training
        time; with --track_memory every rank's peak. Collective."""
        peaks, reserved = gather_peaks(self.info.device) if self.train.track_memory else (None, None)
        epoch_seconds = time.perf_counter() - epoch_start
        totals = step_log.totals
        flops = float(totals[MODEL_FLOPS]), float(totals[HARDWARE_FLOPS])
        trained_tokens = float(totals[TARGET_TOKENS])  # 0 when --on_nonfinite skip skipped every step
        record = {
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
            "compiled_graphs": compiled_graphs() - self.graphs_before,
        }
        if reserved is not None:
            record["peak_memory_reserved_bytes"] = reserved
        self.metrics.write(record)
        train_loss = record["train_loss"]
        compiled = record["compiled_graphs"]
        get_logger().info(
            "epoch %d: train_loss %s | val_loss %s | %.1f s | %.1f samples/s | peak memory per rank %s%s",
            epoch, "- (every step skipped)" if train_loss is None else f"{train_loss:.4f}",
            "-" if val_loss is None else val_loss_text(record), epoch_seconds, record["samples_per_s"],
            "-" if peaks is None else ", ".join(f"{p / 2**20:.0f} MiB" for p in peaks),
            f" | {compiled} graph(s) compiled so far" if compiled else "",
        )  # fmt: skip

    def show_progress(self, bar: tqdm, step_log: StepLog, epoch: int, batches_left: int) -> None:
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

    def summary(self, progress: TrainProgress, last_epoch: int, seconds: float, best: BestModel) -> None:
        """The run's closing line: how long, how far, the best metric, where the model and the metrics are, and
        where generation from it stops; and whether that model was chosen while training had stalled
        (StallWatch), which a low loss does not say."""
        metric, final_models = best.evaluation.metric_for_best, best.final_models
        stalled_since = self.stall.stalled_since if progress.best_epoch is None else best.stalled_since
        stalled = "" if stalled_since is None else f"a stalled model: gradient norm 0.0 since step {stalled_since}"
        if progress.best_epoch is None:
            said = "no metric to choose a best epoch by" + (f" (the final model is {stalled})" if stalled else "")
        else:
            said = f"best {metric} {progress.best_metric:.4f} (epoch {progress.best_epoch}"
            said += f", {stalled})" if stalled else ")"
        models = [final_models.final_folder(last=False)]
        if best.last_apart(progress, last_epoch):
            models.append(f"{final_models.final_folder(last=True)} (the last epoch's)")
        get_logger().info(
            "run finished in %s: step %d, %s; model: %s; metrics: %s; generation from the model stops at %s",
            format_duration(seconds), progress.global_step, said,
            ", ".join(os.path.join(self.train.output_dir, folder) for folder in models),
            os.path.join(self.train.output_dir, layout.METRICS_FILE), final_models.generation_stops(),
        )  # fmt: skip


def val_loss_text(record: dict) -> str:
    """A record's validation loss as the log says it, with the perplexity where the spec gives one."""
    perplexity = f" (perplexity {record['val_perplexity']:.2f})" if "val_perplexity" in record else ""
    return f"{record['val_loss']:.4f}{perplexity}"
