"""Per-step statistics kept on the device and reduced over ranks every few steps."""

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from utils.train.step import GRAD_NORM, INPUT_TOKENS, LOSS_SUM, STAT_COLUMNS, STAT_DTYPE, TARGET_TOKENS


class StepLog:
    """Per-step statistics kept on the device and reduced every `every` steps.

    Reading a loss with .item() each step would stall the GPU pipeline once per step; here one
    all-reduce and one device-to-host copy serve `every` steps. Step seconds are the window's wall time
    divided by its steps: on a GPU the host runs ahead of the device, so a single step's host time would
    not be its real time. The same all-reduce carries each rank's stop flag (SIGTERM), so all ranks learn
    together that one of them must stop.
    """

    def __init__(
        self,
        every: int,
        on_flush: Callable[[list[dict]], None],
        local_stop: Callable[[], bool] = lambda: False,
        totals: list[float] | None = None,
    ):
        self.every = every
        self.on_flush = on_flush
        self.local_stop = local_stop
        self.pending: list[tuple[int, float, torch.Tensor]] = []
        # Sums over all flushed steps and all ranks (carried over from a checkpoint when resuming mid-epoch).
        # (A checkpoint written before the gradient norm column has one column fewer.)
        totals = list(totals or []) + [0.0] * (STAT_COLUMNS - len(totals or []))
        self.totals = torch.tensor(totals, dtype=STAT_DTYPE)
        self.stop_requested = False
        self.window_start = time.perf_counter()
        # The newest flushed window, for the progress bar: its last step's loss, all ranks' tokens per second.
        self.latest_loss: float | None = None
        self.latest_tokens_per_s: float | None = None

    def add(self, step: int, lr: float, stats: torch.Tensor) -> None:
        self.pending.append((step, lr, stats))
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        """Reduce the pending steps over ranks and hand their records to on_flush. Collective."""
        if not self.pending:
            return
        stacked = torch.stack([stats for _, _, stats in self.pending])
        stop = torch.zeros(len(self.pending), 1, dtype=STAT_DTYPE, device=stacked.device)
        stop[-1] = float(self.local_stop())
        reduced = torch.cat([stacked, stop], dim=1)
        dist.all_reduce(reduced)
        rows = reduced.tolist()  # host sync
        self.stop_requested = self.stop_requested or any(row[STAT_COLUMNS] > 0 for row in rows)
        window = torch.tensor([row[:STAT_COLUMNS] for row in rows], dtype=STAT_DTYPE).sum(dim=0)
        self.totals += window
        now = time.perf_counter()
        elapsed = now - self.window_start
        records = [
            {
                "step": step,
                "loss": row[LOSS_SUM] / max(row[TARGET_TOKENS], 1.0),
                "lr": lr,
                "grad_norm": row[GRAD_NORM],  # the global norm before clipping
                "seconds": elapsed / len(rows),
            }
            for (step, lr, _), row in zip(self.pending, rows, strict=True)
        ]
        self.latest_loss = records[-1]["loss"]
        self.latest_tokens_per_s = float(window[INPUT_TOKENS]) / max(elapsed, 1e-9)
        self.pending = []
        self.window_start = now
        self.on_flush(records)
