"""How a generated output is scored against its target (--eval_metric): ROUGE (utils/eval/rouge.py), or
exact-match accuracy for classification as text. Every score is per sample, in percent; an eval record holds
their means, summed in split order (deterministic).
"""

from collections.abc import Callable

from configs.evaluation import METRIC_KEYS
from utils.eval.rouge import rouge_scores


def accuracy_scores(reference: str, prediction: str) -> dict[str, float]:
    """{accuracy}: 100 when the output is the target exactly (surrounding white space aside), else 0."""
    return {"accuracy": 100.0 if prediction.strip() == reference.strip() else 0.0}


SCORERS: dict[str, Callable[[str, str], dict[str, float]]] = {"rouge": rouge_scores, "accuracy": accuracy_scores}


def mean_scores(per_sample: list[dict[str, float]], metric: str) -> dict[str, float]:
    """The mean of each of the metric's keys over samples, summed in the given order (deterministic)."""
    return {key: sum(s[key] for s in per_sample) / len(per_sample) for key in METRIC_KEYS[metric]}
