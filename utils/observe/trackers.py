"""Weights & Biases (--wandb true) and MLflow (--mlflow true): every record rank 0 writes to metrics.jsonl,
also logged to the tracker, with the run's settings (output_dir/config.json) as its config or parameters.
Each tracker run's id is kept in output_dir/trackers.json, so that a resume logs into the same tracker run
(docs/observability.md#trackers-weights--biases-and-mlflow). Each library is imported only when asked for.
"""

import json
import os
import time

from configs.errors import UserError
from configs.observability import ObserveConfig
from utils.base import layout
from utils.base.files import write_json
from utils.base.log import get_logger
from utils.observe.scalars import AXIS_OF_TYPE, scalars_of

MLFLOW_BATCH = 100  # MLflow's log_batch takes at most 100 parameters per call
MLFLOW_PARAM_CHARS = 6000  # and a parameter's value at most this many characters (a long command line is cut)


class WandbSink:
    """A W&B run: each record's scalars logged against the record's own x-axis (step, epoch or rank, declared
    with define_metric), so that W&B's internal step counter is not the x-axis and the steps a resume logs
    again are accepted."""

    name = "W&B"

    def __init__(self, observe: ObserveConfig, output_dir: str, run_id: str | None, settings: dict):
        import wandb

        try:
            self.run = wandb.init(
                project=observe.tracker_project,
                name=run_name(observe, output_dir),
                id=run_id,  # None: a new run, W&B picks its id
                resume="allow",
                dir=output_dir,  # W&B's files go to output_dir/wandb
                config=settings,
                settings=wandb.Settings(console="off"),  # the console stays the package's: no stdout capture
            )
        except wandb.Error as err:
            raise UserError(
                f"--wandb true: W&B did not start a run ({err}). Log in (`wandb login` or WANDB_API_KEY), or log "
                "offline with WANDB_MODE=offline (then `wandb sync` output_dir/wandb/offline-run-*)."
            ) from None
        self.run_id = self.run.id
        for axis in set(AXIS_OF_TYPE.values()):
            self.run.define_metric(axis, hidden=True)
        for prefix in ("train", "validation", "test", "rouge", "accuracy"):
            self.run.define_metric(f"{prefix}/*", step_metric="step")
        self.run.define_metric("epoch/*", step_metric="epoch")
        self.run.define_metric("memory/*", step_metric="rank")

    def write(self, record: dict) -> None:
        scalars = scalars_of(record)
        if scalars:
            self.run.log({AXIS_OF_TYPE[record["type"]]: scalars[0][2], **{tag: v for tag, v, _ in scalars}})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowSink:
    """An MLflow run in experiment --tracker_project, through MlflowClient (no global active run): each
    record's scalars logged at the record's x (its step, epoch or rank)."""

    name = "MLflow"

    def __init__(self, observe: ObserveConfig, output_dir: str, run_id: str | None, settings: dict):
        from mlflow import MlflowClient, MlflowException
        from mlflow.entities import Metric, Param

        self.metric = Metric

        try:
            self.client = MlflowClient()
            if run_id is not None:  # a resume: the same run, running again
                self.client.update_run(run_id, status="RUNNING")
            else:
                run_id = self.client.create_run(
                    self._experiment_id(observe.tracker_project), run_name=run_name(observe, output_dir)
                ).info.run_id
                # Parameters cannot change once logged: a resume keeps the first run's (config.json has the
                # resumed run's own).
                flat = flat_settings(settings)
                params = [Param(key, str(value)[:MLFLOW_PARAM_CHARS]) for key, value in flat.items()]
                for start in range(0, len(params), MLFLOW_BATCH):
                    self.client.log_batch(run_id, params=params[start : start + MLFLOW_BATCH])
        except MlflowException as err:
            uri = os.environ.get("MLFLOW_TRACKING_URI", "MLflow's default")
            if run_id is not None:
                raise UserError(
                    f"--mlflow true: the MLflow run {run_id} that this run logged to "
                    f"({os.path.join(output_dir, layout.TRACKERS_FILE)}) is not in the tracking store ({uri}): "
                    f"{err.message}. Set MLFLOW_TRACKING_URI to the store it was in, or remove the mlflow entry "
                    "from that file to log to a new run."
                ) from None
            raise UserError(
                f"--mlflow true: MLflow could not log to its tracking store ({uri}): {err.message}. Set "
                "MLFLOW_TRACKING_URI to a server (http://host:5000) or a database (sqlite:///mlflow.db, "
                "which needs pip install mlflow)."
            ) from None
        self.run_id = run_id

    def _experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment else self.client.create_experiment(name)

    def write(self, record: dict) -> None:
        now_ms = int(time.time() * 1000)
        metrics = [self.metric(tag, value, now_ms, int(x)) for tag, value, x in scalars_of(record)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


TRACKERS = {"wandb": WandbSink, "mlflow": MlflowSink}


def open_trackers(observe: ObserveConfig, output_dir: str, resumed: bool) -> list:
    """The trackers asked for, each continuing its run of trackers.json on a resume (rank 0 only). Their
    settings are config.json's, which rank 0 wrote before training."""
    asked = [name for name in TRACKERS if getattr(observe, name)]
    if not asked:
        return []
    ids_file = os.path.join(output_dir, layout.TRACKERS_FILE)
    known = read_json(ids_file) if resumed else {}
    settings = read_json(os.path.join(output_dir, layout.CONFIG_FILE))
    sinks = []
    try:
        for name in asked:
            sink = TRACKERS[name](observe, output_dir, known.get(name), settings)
            continued = "continues" if known.get(name) == sink.run_id else "starts"
            get_logger().info("%s: this run %s tracker run %s", name, continued, sink.run_id)
            sinks.append(sink)
    except BaseException:
        for sink in sinks:  # those started are closed as failed, not left running
            sink.close(failed=True)
        raise
    write_json(ids_file, {**known, **{name: sink.run_id for name, sink in zip(asked, sinks, strict=True)}})
    return sinks


def run_name(observe: ObserveConfig, output_dir: str) -> str:
    return observe.tracker_run_name or os.path.basename(os.path.abspath(output_dir))


def flat_settings(settings: dict, prefix: str = "") -> dict:
    """{"train_config.lr": 0.001, ...}: a nested record as one level of dotted keys (MLflow's parameters)."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(flat_settings(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise UserError(f"{path} is not valid JSON ({err}): fix it, or remove it to log to new runs") from None
