"""Where training stands: what a checkpoint records so that a resumed run continues exactly."""

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainProgress:
    """The next sample to train on is `samples_consumed` into epoch `epoch`."""

    epoch: int = 1
    # The items (samples, or packed blocks) of this epoch's padded, shuffled order handed out, summed over ranks.
    samples_consumed: int = 0
    global_step: int = 0
    best_metric: float | None = None  # the best value of --metric_for_best so far
    best_epoch: int | None = None  # the epoch that reached it (its model is hf_model/)
    # The epoch's StepLog totals and training seconds so far: a resumed epoch reports an uninterrupted one's.
    epoch_totals: list[float] | None = None
    epoch_train_seconds: float = 0.0
    # A stop abandoned the --eval_every_n_steps evaluation at global_step: the resumed run does it first.
    evaluation_due: bool = False
