"""TensorBoard curves (--tensorboard true): every record rank 0 writes to metrics.jsonl also becomes
scalars in output_dir/tensorboard, through torch.utils.tensorboard (which needs the `tensorboard` package).

The tags and their axes: utils/observe/scalars.py.
"""

import os

from utils.base import layout
from utils.observe.scalars import scalars_of


class TensorBoardSink:
    """Writes metrics records as TensorBoard scalars (rank 0 only: build it there). `purge_step`: on resume,
    the first step the resumed run writes again; TensorBoard then hides the old run's later events."""

    name = "TensorBoard"

    def __init__(self, log_dir: str, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for

        self.writer = SummaryWriter(log_dir, purge_step=purge_step)

    def write(self, record: dict) -> None:
        for tag, value, x in scalars_of(record):
            self.writer.add_scalar(tag, value, x)
        self.writer.flush()

    def close(self, failed: bool) -> None:  # noqa: ARG002 - a sink's signature: TensorBoard has no run status
        self.writer.close()


def tensorboard_sink(metrics_path: str, enabled: bool, purge_step: int | None = None) -> "TensorBoardSink | None":
    """The sink beside a run's metrics.jsonl (output_dir/tensorboard), or None when not enabled here."""
    if not enabled:
        return None
    return TensorBoardSink(os.path.join(os.path.dirname(metrics_path), layout.TENSORBOARD_DIR), purge_step)
