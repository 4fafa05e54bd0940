"""The numbers of a metrics.jsonl record as named scalars against their x-axis: what TensorBoard, W&B and
MLflow draw (utils/observe/tensorboard.py, utils/observe/trackers.py; the tags by record type:
docs/observability.md#trackers-weights--biases-and-mlflow). Null, non-finite and non-numeric fields are left
out, so a skipped step leaves a gap, not a zero.
"""

import math

# The x-axis of each record type that has scalars (a field of the record), and the prefix of its tags (eval's
# names its metric and split; test is a split scored once after training).
AXIS_OF_TYPE = {
    "step": "step",
    "validation": "step",
    "test": "step",
    "eval": "step",
    "epoch": "epoch",
    "memory": "rank",
}
PREFIX_OF_TYPE = {
    "step": "train",
    "validation": "validation",
    "test": "test",
    "epoch": "epoch",
    "memory": "memory",
}
NOT_SCALARS = {"type", "step", "epoch", "rank", "split", "num_samples", "baselines"}


def scalars_of(record: dict) -> list[tuple[str, float, int]]:
    """(tag, value, x) for every finite number of a metrics record; byte counts become MiB."""
    kind = record.get("type")
    if kind not in AXIS_OF_TYPE:
        return []
    metric = "accuracy" if "accuracy" in record else "rouge"  # --eval_metric's
    prefix = f"{metric}/{record['split']}" if kind == "eval" else PREFIX_OF_TYPE[kind]
    x = record[AXIS_OF_TYPE[kind]]
    out = []
    for key, value in record.items():
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if key in NOT_SCALARS or not numeric or not math.isfinite(value):
            continue
        value = float(value)
        if key.endswith("_bytes"):
            key, value = key.removesuffix("_bytes") + "_mib", value / 2**20
        out.append((f"{prefix}/{key}", value, x))
    if kind == "epoch" and record.get("peak_memory_bytes"):  # a list, one peak per rank: the largest
        out.append(("epoch/peak_memory_mib", max(record["peak_memory_bytes"]) / 2**20, x))
    return out
