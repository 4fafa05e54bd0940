"""metrics.jsonl: one JSON record per line (step, memory, epoch, ...), written by rank 0 as the run goes,
and handed to the sinks asked for: TensorBoard (--tensorboard true, utils/observe/tensorboard.py), W&B and
MLflow (--wandb true, --mlflow true, utils/observe/trackers.py)."""

import json
import math
import os

from configs.observability import ObserveConfig
from utils.base.files import atomic_path
from utils.base.log import get_logger
from utils.observe.tensorboard import tensorboard_sink
from utils.observe.trackers import open_trackers


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most the line being written.

    A disabled writer (every rank but 0) ignores records, so callers need no rank checks. Unlike the other
    files of a run, metrics.jsonl is appended in place (a resumed run first cuts it back atomically). `sinks`:
    where the same records also go (TensorBoard, W&B, MLflow; rank 0 only), each with a name, write(record)
    and close(failed); a sink that fails is dropped with a warning. As a context manager it closes them however
    the block ends, telling them if it failed.
    """

    def __init__(self, path: str, enabled: bool, append: bool = False, sinks: list | None = None):
        mode = "a" if append else "w"
        self.file = open(path, mode, encoding="utf-8") if enabled else None  # noqa: SIM115 - closed in close()
        self.sinks = sinks or []

    def write(self, record: dict) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self.file.flush()
        for sink in list(self.sinks):
            try:
                sink.write(record)
            except Exception as err:  # a tracker's server gone must not end training: metrics.jsonl has it all
                get_logger().warning("%s failed (%s): it gets no more records in this run", sink.name, err)
                self.sinks.remove(sink)

    def close(self, failed: bool = False) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close(failed)
            except Exception as err:  # the others are closed still, and the run's own error stays the one told
                get_logger().warning("%s could not be closed (%s)", sink.name, err)

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close(failed=exc_type is not None)


def json_safe(value):
    """`value` with every NaN or infinite float replaced by None: JSON has no NaN, and a diverged run's
    NaN validation loss must not make metrics.jsonl unreadable to strict parsers (jq, JavaScript)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


# The records that name the step they were written after.
STEPPED = ("step", "eval", "validation", "memory", "test")


def truncate_metrics_for_resume(path: str, last_step: int, next_epoch: int) -> None:
    """Keep the records a checkpoint covers (step, eval, validation, test and memory records <= last_step, epochs <
    next_epoch), drop the rest.

    The resumed run writes the later steps again, so the file ends as an uninterrupted run's would.
    """
    if not os.path.isfile(path):
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the crash
                continue
            if record.get("type") in STEPPED and record.get("step", 0) > last_step:  # memory: older ones have none
                continue
            if record.get("type") == "epoch" and record["epoch"] >= next_epoch:
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)


def open_metrics(
    path: str, is_main: bool, resumed_at: tuple[int, int] | None, observe: ObserveConfig
) -> MetricsWriter:
    """The run's metrics writer (rank 0 writes; others ignore). `resumed_at`: (global step, epoch) of the
    checkpoint a resumed run continues from; the file is cut back to it and appended to. `observe`: which
    sinks also get the records (TensorBoard beside metrics.jsonl, W&B, MLflow)."""
    if not is_main:
        return MetricsWriter(path, enabled=False)
    if resumed_at is not None:
        truncate_metrics_for_resume(path, *resumed_at)
    purge_step = resumed_at[0] + 1 if resumed_at else None
    tensorboard = tensorboard_sink(path, observe.tensorboard, purge_step)
    sinks = [tensorboard] if tensorboard else []
    sinks += open_trackers(observe, os.path.dirname(path), resumed=resumed_at is not None)
    return MetricsWriter(path, enabled=True, append=resumed_at is not None, sinks=sinks)
