"""--tensorboard true: metrics records become TensorBoard scalars (utils/observe/tensorboard.py), read back
from the event files with tensorboard's own reader; a missing package is refused with the pip line."""

import pytest

from configs import validate
from configs.errors import ConfigError
from configs.lora import LoraConfig
from configs.observability import ObserveConfig
from configs.validate import TENSORBOARD_HINT, check_optional_packages
from utils.base.layout import TENSORBOARD_DIR
from utils.observe.metrics import open_metrics
from utils.observe.scalars import scalars_of

RECORDS = [
    {"type": "step", "epoch": 1, "step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 3.0, "mfu": 0.25},
    {"type": "step", "epoch": 1, "step": 2, "loss": None, "lr": 1e-3, "grad_norm": None, "mfu": 0.25},
    {"type": "memory", "rank": 1, "peak_rss_bytes": 3 * 2**20, "param_numel_local": 150,
     "cuda_peak_allocated_bytes": None},
    {"type": "validation", "epoch": 1, "step": 2, "val_loss": 2.0},
    {"type": "eval", "epoch": 1, "step": 2, "split": "validation", "rouge1": 12.5, "rougeL": 10.0,
     "num_samples": 4, "baselines": {"lead3": {"rougeL": 40.0}}},
    {"type": "epoch", "epoch": 1, "train_loss": 2.4, "val_loss": 2.1, "tokens_per_s": 900.0,
     "peak_memory_bytes": [2**20, 2 * 2**20]},
]  # fmt: skip


def test_records_map_to_tags_on_their_axes():
    tags = {tag: (value, x) for record in RECORDS for tag, value, x in scalars_of(record)}
    assert tags["train/loss"] == (2.5, 1)
    assert tags["train/grad_norm"] == (3.0, 1)  # step 2's null grad norm and loss left out, not zeros
    assert sum(tag == "train/loss" for record in RECORDS for tag, _, _ in scalars_of(record)) == 1
    assert tags["memory/peak_rss_mib"] == (3.0, 1) and tags["memory/param_numel_local"] == (150.0, 1)
    assert "memory/cuda_peak_allocated_mib" not in tags
    assert tags["validation/val_loss"] == (2.0, 2)
    assert tags["rouge/validation/rouge1"] == (12.5, 2) and "rouge/validation/num_samples" not in tags
    assert tags["epoch/val_loss"] == (2.1, 1) and tags["epoch/peak_memory_mib"] == (2.0, 1)


def read_scalars(log_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_event_files_hold_the_records_and_a_resume_purges_the_steps_it_writes_again(tmp_path):
    pytest.importorskip("tensorboard")
    metrics = open_metrics(str(tmp_path / "metrics.jsonl"), True, None, ObserveConfig(tensorboard=True))
    for record in RECORDS:
        metrics.write(record)
    metrics.close()
    scalars = read_scalars(tmp_path / TENSORBOARD_DIR)
    assert scalars["train/loss"] == [(1, 2.5)]
    assert scalars["train/lr"] == [(1, pytest.approx(1e-3)), (2, pytest.approx(1e-3))]
    assert scalars["rouge/validation/rougeL"] == [(2, 10.0)]
    assert scalars["epoch/tokens_per_s"] == [(1, 900.0)]

    # Resumed from a checkpoint at step 1: step 2 is written again, and the first run's step 2 is purged.
    resumed = open_metrics(str(tmp_path / "metrics.jsonl"), True, (1, 1), ObserveConfig(tensorboard=True))
    resumed.write({"type": "step", "epoch": 1, "step": 2, "loss": 1.5, "lr": 5e-4})
    resumed.close()
    scalars = read_scalars(tmp_path / TENSORBOARD_DIR)
    assert scalars["train/lr"] == [(1, pytest.approx(1e-3)), (2, pytest.approx(5e-4))]


def test_a_missing_tensorboard_package_is_refused_with_the_pip_line(monkeypatch):
    find_spec = validate.importlib.util.find_spec
    monkeypatch.setattr(
        validate.importlib.util, "find_spec", lambda name: None if name == "tensorboard" else find_spec(name)
    )
    with pytest.raises(ConfigError, match="pip install tensorboard") as refused:
        check_optional_packages(ObserveConfig(tensorboard=True), LoraConfig())
    assert str(refused.value) == TENSORBOARD_HINT
    check_optional_packages(ObserveConfig(tensorboard=False), LoraConfig())  # not asked for: nothing needed
