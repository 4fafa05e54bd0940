"""The numbers of a metrics.jsonl record as named scalars against their x-axis: what TensorBoard, W&B and
MLflow draw (utils/observe/tensorboard.py, utils/observe/trackers.py).

Tags by record type, each against its natural x-axis:
- step (global step): train/loss, train/lr, train/grad_norm, train/mfu, train/model_tflops_per_s, ...
- validation (global step): validation/val_loss
- test (global step): test/loss (and test/perplexity): a split scored once after training
- epoch (epoch): epoch/train_loss, epoch/val_loss, epoch/tokens_per_s, epoch/mfu, epoch/peak_memory_mib, ...
- eval (global step): rouge/<split>/rouge1, rouge2, rougeL, rougeLsum, gen_len (accuracy/<split>/accuracy,
  gen_len with --eval_metric accuracy)
- memory (rank): memory/<field> in MiB or elements, one point per rank
Null, non-finite and non-numeric fields are left out, so a skipped step leaves a gap, not a zero.
"""

import math

# The x-axis of each record type (a field of the record), and the prefix of its tags.
AXES = {
    "step": ("step", "train"),
    "validation": ("step", "validation"),
    "test": ("step", "test"),
    "epoch": ("epoch", "epoch"),
}
# The x-axis of each record type that has scalars.
AXIS_OF_TYPE = {
    "step": "step",
    "validation": "step",
    "test": "step",
    "eval": "step",
    "epoch": "epoch",
    "memory": "rank",
}
NOT_SCALARS = {"type", "step", "epoch", "rank", "split", "num_samples", "baselines"}


def _numbers(record: dict) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in record.items()
        if key not in NOT_SCALARS
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


def scalars_of(record: dict) -> list[tuple[str, float, int]]:
    """(tag, value, x) for every finite number of a metrics record; byte counts become MiB."""
    kind = record.get("type")
    if kind == "eval":
        metric = "accuracy" if "accuracy" in record else "rouge"  # --eval_metric's
        prefix, x = f"{metric}/{record['split']}", record["step"]
    elif kind == "memory":
        prefix, x = "memory", record["rank"]
    elif kind in AXES:
        axis, prefix = AXES[kind]
        x = record[axis]
    else:
        return []
    out = []
    for key, value in _numbers(record).items():
        if key.endswith("_bytes"):
            key, value = key.removesuffix("_bytes") + "_mib", value / 2**20
        out.append((f"{prefix}/{key}", value, x))
    if kind == "epoch" and record.get("peak_memory_bytes"):  # a list, one peak per rank: the largest
        out.append(("epoch/peak_memory_mib", max(record["peak_memory_bytes"]) / 2**20, x))
    return out
