"""The training loop's two policies: which epoch's model is kept as the best (--metric_for_best: hf_model/, the
--save_model .pt) and when the run ends (--epochs, --max_steps, --early_stopping_patience). Both read only what
the progress keeps, so a resumed run decides as the run it continues would have."""

import dataclasses

from configs.evaluation import EvalConfig
from configs.recipe import RecipeConfig
from configs.training import TrainConfig
from utils.base.log import get_logger
from utils.checkpoint.final_models import FinalModels
from utils.checkpoint.progress import TrainProgress
from utils.spec import ModelSpec


@dataclasses.dataclass
class RunEnd:
    """When training ends: every epoch trained (without --max_steps), --max_steps reached (over as many epochs as
    it takes), or --early_stopping_patience epochs without a new best (counted from the best epoch kept in the
    progress, so the count is the same after a resume)."""

    train: TrainConfig
    recipe: RecipeConfig
    evaluation: EvalConfig

    def done(self, progress: TrainProgress) -> str | None:
        """Why training ends before the epoch `progress` is at, or None (`ending`)."""
        ending = self.ending(progress)
        return ending[0] if ending else None

    def ending(self, progress: TrainProgress) -> tuple[str, str] | None:
        """(why training ends before the epoch `progress` is at, the setting a resume would change to train
        on), or None."""
        epochs, max_steps = self.train.epochs, self.recipe.max_steps
        patience, best = self.recipe.early_stopping_patience, progress.best_epoch
        metric = self.evaluation.metric_for_best
        ended = [  # --max_steps, where given, is the run's length whatever --epochs says (HF's meaning)
            (not max_steps and progress.epoch > epochs, f"all {epochs} epochs trained",
             f"more --epochs than {epochs}"),
            (0 < max_steps <= progress.global_step, f"--max_steps {max_steps} reached",
             f"a higher --max_steps than {max_steps} (0: none)"),
            (bool(patience) and best is not None and progress.epoch - 1 - best >= patience,
             f"early stopping: {patience} epochs without a better {metric} than epoch {best}'s",
             f"a higher --early_stopping_patience than {patience} (0: never)"),
        ]  # fmt: skip
        holding = [(why, fix) for holds, why, fix in ended if holds]
        if not holding:
            return None
        return holding[0][0], " and ".join(fix for _, fix in holding)  # each that would end it again


@dataclasses.dataclass
class BestModel:
    """The best epoch by --metric_for_best (the spec says which way is better), kept as the run goes: hf_model/,
    and with --save_model its .pt, each time an epoch beats the best so far. Without a metric there is no
    best: every epoch's .pt is saved, under its own name, and hf_model/ holds the final model."""

    evaluation: EvalConfig
    save_model: bool
    spec: ModelSpec
    final_models: FinalModels
    stalled_since: int | None = None  # the stall (StallWatch) the best epoch's model was chosen in, if any

    def keep(
        self, progress: TrainProgress, val_loss: float | None, scores: dict | None, stalled_since: int | None
    ) -> tuple[float | None, int | None]:
        """Save the model of the epoch `progress` is at where it is the best so far (`progress` holds the best
        before it), or its .pt without a metric; `stalled_since`: the stall training is in. Returns the best
        metric and epoch so far. Collective."""
        epoch, name = progress.epoch, self.evaluation.metric_for_best
        metric = val_loss if name == "val_loss" else (scores or {}).get(name)
        improved = metric is not None and self.spec.is_better(name, metric, progress.best_metric)
        if self.save_model and (improved or metric is None):
            self.final_models.save_full_model(epoch, val_loss)
        if not improved:
            return progress.best_metric, progress.best_epoch
        get_logger().info("new best %s %.4f (epoch %d)", name, metric, epoch)
        self.final_models.export_hf()
        self.stalled_since = stalled_since
        return metric, epoch

    @staticmethod
    def last_apart(progress: TrainProgress, last_epoch: int) -> bool:
        """Whether the last epoch's model goes beside the best's (hf_model_last/): it was not the best."""
        return progress.best_epoch not in (None, last_epoch)

    def export_final(self, progress: TrainProgress, last_epoch: int) -> None:
        """The final model: into hf_model/ without a metric, beside it (hf_model_last/) when the last epoch was
        not the best; nothing when it was (hf_model/ holds it). Collective."""
        if progress.best_epoch != last_epoch:
            self.final_models.export_hf(last=self.last_apart(progress, last_epoch))
