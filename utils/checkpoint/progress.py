"""Where training stands: what a checkpoint records so that a resumed run continues exactly."""

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainProgress:
    """The next sample to train on is `samples_consumed` into epoch `epoch`."""

    epoch: int = 1
    # The items of this epoch's (padded, shuffled) order the sampler has handed out, summed over ranks: Dataset
    # items, each a sample (or a packed block, where a Dataset packs), so the position is exact either way.
    samples_consumed: int = 0
    global_step: int = 0
    best_metric: float | None = None  # the best value of --metric_for_best so far
    best_epoch: int | None = None  # the epoch that reached it (its model is hf_model/)
    # The epoch's statistics so far (utils.train.step_log.StepLog totals) and training seconds, so that a
    # resumed epoch reports the same train_loss and throughput as an uninterrupted one.
    epoch_totals: list[float] | None = None
    epoch_train_seconds: float = 0.0
    # A stop (SIGTERM) abandoned the evaluation of --eval_every_n_steps at global_step: the resumed run does
    # it before training on, so metrics.jsonl holds it once, as an uninterrupted run's does.
    evaluation_due: bool = False
