"""--wandb and --mlflow (utils/observe/trackers.py) with the real libraries: W&B in offline mode (its run
file read back record by record), MLflow on a local file store read back with its own client; and --config
(configs/config_file.py): a run's config.json starts the same run again.

The replay is one torchrun launch of the session's reference run (tests/reference_run.py) from its
config.json, with both trackers on: its per-step losses equal the reference's exactly, and both trackers hold
exactly its metrics.jsonl's numbers."""

import glob
import json
import struct

import pytest

from configs.observability import ObserveConfig
from tests.launch import pooled
from tests.reference_run import read_records
from utils.base.layout import CONFIG_FILE, TRACKERS_FILE
from utils.observe.metrics import open_metrics
from utils.observe.scalars import scalars_of

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")

REPLAYED_STEPS = 6  # of the reference's 24: the replay stops there (--max_steps), before any evaluation
RECORDS = [
    {"type": "step", "epoch": 1, "step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 3.0},
    {"type": "step", "epoch": 1, "step": 2, "loss": 2.25, "lr": 1e-3, "grad_norm": None},
    {"type": "memory", "rank": 1, "peak_rss_bytes": 3 * 2**20},
    {"type": "validation", "epoch": 1, "step": 2, "val_loss": 2.0},
    {"type": "epoch", "epoch": 1, "train_loss": 2.4, "val_loss": 2.1, "tokens_per_s": 900.0},
]


@pytest.fixture
def tracker_environment(monkeypatch, tmp_path):
    """W&B offline, MLflow on a file store in tmp_path (MLflow 3 keeps the file store behind a switch)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


def wandb_history(output_dir) -> dict[str, list]:
    """{run id: [each logged row, as W&B stored it]} from the offline run files under output_dir/wandb: the
    LevelDB-style log that W&B writes (a 7-byte header, then 32 KiB blocks of records, each with a 7-byte
    header: CRC, length, kind), each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    block, full, last = 32768, 1, 4
    rows = {}
    for path in sorted(glob.glob(str(output_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        data = open(path, "rb").read()
        assert data[:4] == b":W&B", path
        position, pieces, run_id = 7, b"", None
        while position + 7 <= len(data):
            if block - position % block < 7:  # a block's tail too short for a header is padding
                position += block - position % block
                continue
            _, length, kind = struct.unpack("<IHB", data[position : position + 7])
            pieces += data[position + 7 : position + 7 + length]
            position += 7 + length
            if kind not in (full, last):
                continue
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            if record.WhichOneof("record_type") == "run":
                run_id = record.run.run_id
            elif record.WhichOneof("record_type") == "history":
                # A key with a slash is stored split at it (nested_key), others whole (key).
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                rows.setdefault(run_id, []).append(row)
    return rows


def mlflow_history(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    client = mlflow.MlflowClient(uri)
    run = client.get_run(run_id)
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in run.data.metrics
    }


def expected_scalars(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(x, value)]}: what a tracker must hold for these metrics.jsonl records."""
    expected = {}
    for record in records:
        for tag, value, x in scalars_of(record):
            expected.setdefault(tag, []).append((x, value))
    return {tag: sorted(points) for tag, points in expected.items()}


def wandb_scalars(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(x, value)]} of W&B rows, each tag against the axis the row logged with it."""
    scalars = {}
    for row in rows:
        axis = next(name for name in ("step", "epoch", "rank") if name in row)
        for tag, value in row.items():
            if tag not in ("step", "epoch", "rank") and not tag.startswith("_"):
                scalars.setdefault(tag, []).append((row[axis], value))
    return {tag: sorted(points) for tag, points in scalars.items()}


@pytest.mark.slow  # two whole runs with both trackers (3.5 s)
def test_both_trackers_hold_the_records_and_a_resume_continues_their_runs(tmp_path, tracker_environment):
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"train_config": {"lr": 0.001, "epochs": 2}}))
    observe = ObserveConfig(wandb=True, mlflow=True, tracker_project="tests")
    with open_metrics(str(tmp_path / "metrics.jsonl"), True, None, observe) as metrics:
        for record in RECORDS:
            metrics.write(record)
    ids = json.loads((tmp_path / TRACKERS_FILE).read_text())
    # Resumed from a checkpoint at step 1 of epoch 1: the same tracker runs go on.
    with open_metrics(str(tmp_path / "metrics.jsonl"), True, (1, 1), observe) as metrics:
        metrics.write({"type": "step", "epoch": 1, "step": 2, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0})
    assert json.loads((tmp_path / TRACKERS_FILE).read_text()) == ids

    history = wandb_history(tmp_path)
    assert list(history) == [ids["wandb"]]  # both processes logged into one W&B run
    scalars = wandb_scalars(history[ids["wandb"]])
    expected = expected_scalars(RECORDS)
    assert scalars["train/loss"] == sorted(expected["train/loss"] + [(2, 2.0)])  # step 2 trained again: twice
    assert scalars["epoch/tokens_per_s"] == expected["epoch/tokens_per_s"] == [(1, 900.0)]
    assert scalars["memory/peak_rss_mib"] == [(1, 3.0)]

    logged = mlflow_history(tracker_environment, ids["mlflow"])
    assert logged["train/loss"] == [(1, 2.5), (2, 2.0), (2, 2.25)]
    assert logged["validation/val_loss"] == expected["validation/val_loss"] == [(2, 2.0)]
    run = mlflow.MlflowClient(tracker_environment).get_run(ids["mlflow"])
    assert run.data.params["train_config.lr"] == "0.001" and run.info.status == "FINISHED"


def test_a_failed_run_is_marked_failed_in_mlflow(tmp_path, tracker_environment):
    (tmp_path / CONFIG_FILE).write_text("{}")
    observe = ObserveConfig(mlflow=True, tracker_project="tests")
    with pytest.raises(RuntimeError), open_metrics(str(tmp_path / "metrics.jsonl"), True, None, observe):
        raise RuntimeError("a step failed")
    run_id = json.loads((tmp_path / TRACKERS_FILE).read_text())["mlflow"]
    assert mlflow.MlflowClient(tracker_environment).get_run(run_id).info.status == "FAILED"


@pytest.mark.slow
def test_config_json_replays_the_run_exactly_and_the_trackers_hold_its_metrics(
    reference, tmp_path, tracker_environment
):
    output_dir = tmp_path / "replay"
    run = pooled(
        ["--config", str(reference / CONFIG_FILE), "--output_dir", str(output_dir),
         "--max_steps", str(REPLAYED_STEPS), "--wandb", "true", "--mlflow", "true", "--tracker_project", "replay"],
    )  # fmt: skip
    assert run.returncode == 0, run.describe()

    records = read_records(output_dir)
    replayed = {r["step"]: r["loss"] for r in records if r["type"] == "step"}
    original = {r["step"]: r["loss"] for r in read_records(reference) if r["type"] == "step"}
    assert sorted(replayed) == list(range(1, REPLAYED_STEPS + 1))
    assert max(abs(replayed[s] - original[s]) / abs(original[s]) for s in replayed) == 0.0

    expected = expected_scalars(records)
    ids = json.loads((output_dir / TRACKERS_FILE).read_text())
    assert wandb_scalars(wandb_history(output_dir)[ids["wandb"]]) == expected
    assert mlflow_history(tracker_environment, ids["mlflow"]) == expected


class BrokenSink:
    """A tracker whose server went away: writing (after `writes_ok` records) and closing raise."""

    name = "Broken"

    def __init__(self, writes_ok: int):
        self.writes_ok, self.written, self.closed = writes_ok, 0, None

    def write(self, record: dict) -> None:
        if self.written == self.writes_ok:
            raise ConnectionError("server gone")
        self.written += 1

    def close(self, failed: bool) -> None:
        self.closed = failed
        raise ConnectionError("server gone")


class GoodSink(BrokenSink):
    name = "Good"

    def write(self, record: dict) -> None:
        self.written += 1

    def close(self, failed: bool) -> None:
        self.closed = failed


def test_a_failing_tracker_is_dropped_and_training_goes_on(tmp_path, log_records):
    from utils.observe.metrics import MetricsWriter

    broken, closes_badly, good = BrokenSink(writes_ok=1), BrokenSink(writes_ok=len(RECORDS)), GoodSink(0)
    path = tmp_path / "metrics.jsonl"
    with (
        pytest.raises(ValueError, match="the run's own error"),
        MetricsWriter(str(path), True, sinks=[broken, closes_badly, good]) as metrics,
    ):
        for record in RECORDS:
            metrics.write(record)
        raise ValueError("the run's own error")  # stays the error raised, though a sink's close fails
    assert len(path.read_text().splitlines()) == len(RECORDS)
    assert broken.written == 1 and broken.closed is None  # dropped at its failure
    assert closes_badly.closed is True and good.written == len(RECORDS) and good.closed is True  # told it failed
    warnings = [r.getMessage() for r in log_records if r.levelname == "WARNING"]
    assert warnings == [
        "Broken failed (server gone): it gets no more records in this run",
        "Broken could not be closed (server gone)",
    ], warnings
