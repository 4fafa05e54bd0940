"""The run record: output_dir/config.json and output_dir/metrics.jsonl, written by rank 0 only."""

import json
import os
import platform
import sys
from datetime import datetime, timezone

import torch
import transformers

from configs.cli import config_to_dict


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most the line being written.

    A disabled writer (every rank but 0) ignores records, so callers need no rank checks.
    """

    def __init__(self, path: str, enabled: bool, append: bool = False):
        self.path = path
        mode = "a" if append else "w"
        self.file = open(path, mode, encoding="utf-8") if enabled else None  # noqa: SIM115 - closed in close()

    def write(self, record: dict) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def run_record(train_config, fsdp_config, *, world_size: int, backend: str, device: str, precision: str) -> dict:
    return {
        "train_config": config_to_dict(train_config),
        "fsdp_config": config_to_dict(fsdp_config),
        "world_size": world_size,
        "backend": backend,
        "device": device,
        "mixed_precision_policy": precision,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "command": sys.argv,
    }


def write_json_atomic(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def truncate_metrics_for_resume(path: str, last_step: int, next_epoch: int) -> None:
    """Keep the records a checkpoint covers (steps <= last_step, epochs < next_epoch) and drop the rest.

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
            if record.get("type") == "step" and record["step"] > last_step:
                continue
            if record.get("type") == "epoch" and record["epoch"] >= next_epoch:
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
