"""ROUGE evaluation under FSDP: every rank generates summaries for its share of the evaluation articles,
scores them, and rank 0 gathers the scores in article order, writes the eval record and the predictions.

    evaluator = Evaluator(eval_set, generation_kwargs(config.evaluation, max_target_length), where, info)
    record = evaluator.evaluate(model, epoch, step)   # collective; the record on every rank

`where(split, step)` names the predictions file (utils/layout.py: training's, or --evaluate_only's own).

Each article is scored exactly once: the evaluation sampler's padding repeats are generated (every rank
must join every collective) but never scored.
"""

import json
import os
import time
from collections.abc import Callable

import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from utils.data.loaders import EvalSet, move_batch
from utils.distributed.process_group import DistInfo, stop_if_any_rank
from utils.eval.generation import generate
from utils.eval.rouge import lead_sentences, lead_steps, mean_scores, rouge_scores
from utils.files import atomic_path
from utils.log import get_logger

EXAMPLES_LOGGED = 3


class Evaluator:
    """Generates, scores and records one evaluation set (the first N articles of a split)."""

    def __init__(
        self, eval_set: EvalSet, generation: dict, predictions_file: Callable[[str, int], str], info: DistInfo
    ):
        self.eval_set = eval_set
        self.generation = generation  # generate's settings (utils/eval/generation.py: generation_kwargs)
        self.predictions_file = predictions_file  # (split, step) -> where its predictions go (utils/layout.py)
        self.info = info
        self._baselines: dict | None = None  # computed once, on rank 0

    def evaluate(self, model: nn.Module, epoch: int, step: int, stop_requested=None) -> dict:
        """Generate and score every article of the set; the eval record, on every rank. Collective.
        `stop_requested` (a callable): when it is true on any rank, every rank abandons the pass at the next
        batch (StopAgreed), writing nothing."""
        started = time.perf_counter()
        model.eval()
        rows = self._generate_share(model, stop_requested)
        gathered = [None] * self.info.world_size if self.info.is_main else None
        dist.gather_object(rows, gathered, dst=0)
        outcome = [None]
        if self.info.is_main:
            ordered = sorted((row for share in gathered for row in share), key=lambda row: row["index"])
            record = self._record(ordered, epoch, step, time.perf_counter() - started)
            self._write_predictions(ordered, step)
            self._log(record, ordered)
            outcome = [record]
        dist.broadcast_object_list(outcome, src=0)
        return outcome[0]

    def _generate_share(self, model: nn.Module, stop_requested) -> list[dict]:
        """This rank's real samples: index, prediction, generated length and ROUGE scores."""
        dataset, sampler = self.eval_set.dataset, self.eval_set.sampler
        pad_id = dataset.tokenizer.pad_token_id
        rows, position = [], 0
        bar = tqdm(total=len(self.eval_set.loader), desc="ROUGE evaluation", colour="magenta",
                   disable=not self.info.is_main, dynamic_ncols=True)  # fmt: skip
        with bar:
            for batch in self.eval_set.loader:
                stop_if_any_rank(stop_requested, self.info.device)
                ids = generate(model, move_batch(batch, self.info.device), self.generation).cpu()
                texts = dataset.tokenizer.batch_decode(ids, skip_special_tokens=True)
                for text, length in zip(texts, (ids != pad_id).sum(dim=1).tolist(), strict=True):
                    if position < sampler.num_real_samples:
                        index = sampler.indices[position]
                        prediction = text.strip()
                        scores = rouge_scores(dataset.reference(index), prediction)
                        rows.append({"index": index, "prediction": prediction, "gen_len": length, **scores})
                    position += 1
                bar.update(1)
        return rows

    def _record(self, ordered: list[dict], epoch: int, step: int, seconds: float) -> dict:
        return {
            "type": "eval",
            "epoch": epoch,
            "step": step,
            "split": self.eval_set.split,
            **mean_scores(ordered),
            "gen_len": sum(row["gen_len"] for row in ordered) / len(ordered),
            "num_samples": len(ordered),
            "seconds": seconds,
            "baselines": self.baselines(),
        }

    def baselines(self) -> dict:
        """ROUGE of two extractive baselines on the same articles: the first sentence of every step
        (`lead_steps`) and the article's first three sentences (`lead3`). Computed once."""
        if self._baselines is None:
            dataset = self.eval_set.dataset
            indices = range(len(dataset))
            self._baselines = {
                name: mean_scores([rouge_scores(dataset.reference(i), make(dataset.article(i), dataset.clean_text))
                                   for i in indices])
                for name, make in (("lead_steps", lead_steps), ("lead3", lead_sentences))
            }  # fmt: skip
        return self._baselines

    def _write_predictions(self, ordered: list[dict], step: int) -> None:
        """One line per scored article, in split order; `reference` is exactly the text scored."""
        dataset = self.eval_set.dataset
        path = self.predictions_file(self.eval_set.split, step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            for row in ordered:
                index = row["index"]
                line = {"title": dataset.title(index), "reference": dataset.reference(index),
                        "prediction": row["prediction"]}  # fmt: skip
                f.write(json.dumps(line, ensure_ascii=False) + "\n")

    def _log(self, record: dict, ordered: list[dict]) -> None:
        lead3 = record["baselines"]["lead3"]["rougeL"]
        get_logger().info(
            "ROUGE (%s, %d articles, step %d): R1 %.2f | R2 %.2f | RL %.2f | RLsum %.2f | gen_len %.1f | "
            "%.1f s (baselines RL: lead-3 %.2f, first sentence of each step %.2f)",
            record["split"], record["num_samples"], record["step"], record["rouge1"], record["rouge2"],
            record["rougeL"], record["rougeLsum"], record["gen_len"], record["seconds"], lead3,
            record["baselines"]["lead_steps"]["rougeL"],
        )  # fmt: skip
        for row in ordered[:EXAMPLES_LOGGED]:
            reference = self.eval_set.dataset.reference(row["index"])
            get_logger().info("  reference:  %s\n  prediction: %s", reference[:200], row["prediction"][:200])
