"""Per-step statistics kept on the device and reduced over ranks every few steps."""

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from configs.errors import TrainingDivergedError
from utils.base.log import get_logger
from utils.distributed.hang_report import WHERE
from utils.distributed.process_group import is_rank0
from utils.observe.flops import Throughput
from utils.train.step import (
    GRAD_NORM,
    HARDWARE_FLOPS,
    INPUT_TOKENS,
    LOSS_SUM,
    MODEL_FLOPS,
    SAMPLES,
    STAT_COLUMNS,
    STAT_DTYPE,
    TARGET_TOKENS,
)


class StepLog:
    """Per-step statistics kept on the device and reduced every `every` steps.

    Reading a loss with .item() each step would stall the GPU pipeline once per step; here one
    all-reduce and one device-to-host copy serve `every` steps. Step seconds are the window's wall time
    divided by its steps: on a GPU the host runs ahead of the device, so a single step's host time would
    not be its real time. The all-reduce shows every rank the same NaN/Inf losses and norms: such a
    step is recorded as nonfinite (and skipped where --on_nonfinite skip or fp16's scaler skipped it) and
    left out of the epoch's loss, or, with `stop_on_nonfinite`, ends the run on every rank before anything
    else is saved. `stall` (the run's StallWatch) reads each flushed step's gradient norm.
    """

    def __init__(
        self,
        every: int,
        on_flush: Callable[[list[dict]], None],
        totals: list[float] | None = None,
        stop_on_nonfinite: bool = False,
        throughput: Throughput | None = None,
        stall: "StallWatch | None" = None,
    ):
        self.every = every
        self.stop_on_nonfinite = stop_on_nonfinite
        self.throughput = throughput
        self.on_flush = on_flush
        self.stall = stall
        self.pending: list[tuple[int, float, torch.Tensor]] = []
        # Sums over all flushed steps and all ranks (carried over from a checkpoint when resuming mid-epoch).
        # (A checkpoint written before the gradient norm or FLOP columns existed has fewer; they start at 0.)
        totals = list(totals or []) + [0.0] * (STAT_COLUMNS - len(totals or []))
        self.totals = torch.tensor(totals, dtype=STAT_DTYPE)
        self.window_start = time.perf_counter()
        # The newest flushed window, for the progress bar and line: its last step, that step's loss, all ranks'
        # samples and tokens per second, seconds per step, and the window's MFU (None without a peak).
        self.latest_step: int | None = None
        self.latest_loss: float | None = None
        self.latest_samples_per_s: float | None = None
        self.latest_tokens_per_s: float | None = None
        self.latest_step_seconds: float | None = None
        self.latest_mfu: float | None = None

    def add(self, step: int, lr: float, stats: torch.Tensor) -> None:
        self.pending.append((step, lr, stats))
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        """Reduce the pending steps over ranks and hand their records to on_flush. Collective."""
        if not self.pending:
            return
        WHERE.enter("step-log all-reduce")
        reduced = torch.stack([stats for _, _, stats in self.pending])
        dist.all_reduce(reduced)
        rows = reduced.tolist()  # host sync
        now = time.perf_counter()
        elapsed = now - self.window_start
        seconds = elapsed / len(rows)
        pending = zip(self.pending, rows, strict=True)
        records = [step_record(step, lr, row, seconds) for (step, lr, _), row in pending]
        if self.throughput is not None:
            for record, row in zip(records, rows, strict=True):
                record.update(self.throughput.rates(row[MODEL_FLOPS], row[HARDWARE_FLOPS], seconds))
        if not self.stop_on_nonfinite:  # the step was skipped where the norm was not finite (found_inf, scaler)
            for record in records:
                if record.get("nonfinite") and not math.isfinite(record["grad_norm"]):
                    record["skipped"] = True
        if self.stall is not None:  # after step_record, which zeroes the tokens of a nonfinite step
            self.stall.read(records, [row[TARGET_TOKENS] for row in rows])
        window = torch.tensor(rows, dtype=STAT_DTYPE).sum(dim=0)
        self.totals += window
        self.latest_step, self.latest_loss = records[-1]["step"], records[-1]["loss"]
        self.latest_samples_per_s = float(window[SAMPLES]) / max(elapsed, 1e-9)
        self.latest_tokens_per_s = float(window[INPUT_TOKENS]) / max(elapsed, 1e-9)
        self.latest_step_seconds = seconds
        if self.throughput is not None:
            flops = float(window[MODEL_FLOPS]), float(window[HARDWARE_FLOPS])
            self.latest_mfu = self.throughput.rates(*flops, elapsed).get("mfu")
        self.pending = []
        self.window_start = now
        self.on_flush(records)
        self._check_nonfinite(records)

    def _check_nonfinite(self, records: list[dict]) -> None:
        """End the run at the first non-finite step when stopping is on; else warn about each."""
        for record in records:
            if not record.get("nonfinite"):
                continue
            if self.stop_on_nonfinite:
                raise TrainingDivergedError(
                    f"step {record['step']}: NaN or infinite loss or gradient norm (loss {record['loss']:.4g}, "
                    f"grad_norm {record['grad_norm']:.4g}). Stopped without saving: the "
                    "checkpoints already in output_dir are kept (--resume true continues from the last). "
                    "Lower --lr, set --max_grad_norm, train in fp32 (--mixed_precision false), or skip such "
                    "steps with --on_nonfinite skip."
                )
            outcome = "skipped" if record.get("skipped") else "not skipped: its gradient norm is finite"
            get_logger().warning("step %d: NaN or infinite loss or gradient norm, %s", record["step"], outcome)


def step_record(step: int, lr: float, row: list[float], seconds: float) -> dict:
    """A step's metrics.jsonl record from its all-ranks sums (grad_norm: the global norm before clipping; tokens:
    the real tokens it read, as the epoch's tokens_per_s counts them). A NaN/Inf loss or norm marks the record
    nonfinite (metrics.jsonl writes such values as null) and is zeroed in `row`, so that the epoch's train_loss
    stays the token mean of the steps that trained."""
    loss = row[LOSS_SUM] / max(row[TARGET_TOKENS], 1.0)
    record = {"step": step, "loss": loss, "lr": lr, "grad_norm": row[GRAD_NORM], "seconds": seconds,
              "tokens": int(row[INPUT_TOKENS])}  # fmt: skip
    if math.isfinite(loss) and math.isfinite(row[GRAD_NORM]):
        return record
    row[LOSS_SUM] = row[TARGET_TOKENS] = row[GRAD_NORM] = 0.0
    return {**record, "nonfinite": True}


# Optimizer steps in a row whose global gradient norm is exactly 0.0 that make a stall. A step that trains on
# tokens has an exactly zero gradient only where every parameter's gradient vanished or none is trained, which a
# learning model never shows; 3 in a row say it lasts (AdamW's momentum still moves the weights for a few steps
# after the gradient vanished, and could carry them out), and still come within a run's first log windows.
STALL_STEPS = 3


class StallWatch:
    """Says when training stalls: the global gradient norm (before clipping) exactly 0.0 on STALL_STEPS
    optimizer steps in a row, from the step log's flushed records (no sync of its own). A run that collapses
    without a NaN (a learning rate far too high: the loss flat, every gradient 0) is otherwise silent. Steps
    that trained on no token (their gradient is 0 by construction) or whose loss or norm was not finite (said
    on their own; skipped by --on_nonfinite skip or fp16's scaler) neither count nor break a row. One watch per
    run, across its epochs; each row of STALL_STEPS or more is said once."""

    def __init__(self) -> None:
        self.row_start: int | None = None  # the first step of the current row of zero norms
        self.row_length = 0

    @property
    def stalled_since(self) -> int | None:
        """The first step of the stall the run is in now, or None."""
        return self.row_start if self.row_length >= STALL_STEPS else None

    def read(self, records: list[dict], trained_tokens: list[float]) -> None:
        for record, tokens in zip(records, trained_tokens, strict=True):
            if not tokens:
                continue
            if record["grad_norm"] != 0.0:
                self.row_start, self.row_length = None, 0
                continue
            self.row_start = record["step"] if self.row_start is None else self.row_start
            self.row_length += 1
            if self.row_length == STALL_STEPS and is_rank0():  # once a row
                get_logger().warning(
                    "step %d: training has stalled: the gradient norm has been exactly 0.0 since step %d (loss "
                    "%.4g), so the model no longer learns. Likely causes: a learning rate too high (--lr) drove "
                    "the weights where every gradient vanishes (a loss flat at ln(vocabulary size) is a uniform "
                    "guess), or no parameter is trained (all frozen). Start again with a lower --lr, or with "
                    "parameters that train.",
                    record["step"], self.row_start, record["loss"],
                )  # fmt: skip
