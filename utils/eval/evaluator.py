"""Generation evaluation under FSDP: every rank generates outputs for its share of the evaluation rows, scores
them with --eval_metric (ROUGE, or exact-match accuracy), and rank 0 gathers the scores in split order, writes
the eval record and the predictions (`predictions_file(split, step)` names their file: utils/base/layout.py).

Each row is scored exactly once: the evaluation sampler's padding repeats are generated (every rank
must join every collective) but never scored.
"""

import json
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from configs.evaluation import METRIC_NAMES
from utils.base.files import atomic_path
from utils.base.log import get_logger, progress_bar
from utils.data.loaders import EvalSet, move_batch
from utils.distributed.hang_report import WHERE
from utils.distributed.process_group import DistInfo, StopCheck
from utils.eval.generation import (
    NO_TURN_END,
    TurnEnd,
    cut_at_stop_strings,
    gathered_for_generation,
    generate,
    generation_stops,
    keep_gathered,
)
from utils.eval.rouge import lead_sentences, lead_steps, rouge_scores
from utils.eval.scores import SCORERS, mean_scores
from utils.fsdp.parallelism import Parallelism
from utils.spec import ModelSpec

EXAMPLES_LOGGED = 3
# ROUGE's extractive baselines: the first sentence of every line (WikiHow's steps), the first three (lead-3).
BASELINES = {"lead_steps": lead_steps, "lead3": lead_sentences}


def lead_steps_label(cleaning: str) -> str:
    """What the log calls `lead_steps`: a WikiHow step's first sentence, or in other data a line's."""
    return "first sentence of each step" if cleaning == "wikihow" else "first sentence of each line"


def generated_lengths(ids: torch.Tensor, pad_id: int, stop_ids: list[int]) -> list[int]:
    """The tokens each row of `ids` wrote, its stop token included: the non-padding ones before the first of
    `stop_ids` (generation_stops), and that one. Apart from padding, which a decoder-only model's tokenizer may
    share with its EOS (Llama's, GPT-2's): counting non-padding tokens alone would leave their EOS out, and
    count T5's."""
    if not stop_ids:
        return (ids != pad_id).sum(dim=1).tolist()
    ended = torch.isin(ids, torch.tensor(stop_ids, device=ids.device))
    before_end = ended.int().cumsum(dim=1) == 0
    return (((ids != pad_id) & before_end).sum(dim=1) + ended.any(dim=1)).tolist()


def prompts_within(prompts: dict, room: int | None) -> tuple[dict, int]:
    """Left-padded `prompts` with each row's latest `room` tokens (None: all), and how many rows lost some."""
    if room is None or prompts["input_ids"].shape[1] <= room:
        return prompts, 0
    cut = int((prompts["attention_mask"][:, :-room].sum(dim=1) > 0).sum())
    return {name: tensor[:, -room:] for name, tensor in prompts.items()}, cut


class Evaluator:
    """Generates, scores and records one evaluation set (the first N rows of a split)."""

    def __init__(
        self,
        *,
        eval_set: EvalSet,
        parallelism: Parallelism,
        spec: ModelSpec,
        generation: dict,
        metric: str,
        predictions_file: Callable[[str, int], str],
        info: DistInfo,
        gather_for_generation: str = "false",
        compute_dtype: torch.dtype = torch.float32,
        turn_end: TurnEnd = NO_TURN_END,
        prompt_room: int | None = None,
    ):
        self.eval_set = eval_set
        self.parallelism = parallelism  # how generation gathers the sharded model
        self.spec = spec  # what generation reads of a batch (its prompts), and which of its outputs are new
        self.generation = generation  # generate's settings (utils/spec.py: generation_kwargs)
        self.metric = metric  # --eval_metric: a key of utils/eval/scores.py's SCORERS
        self.predictions_file = predictions_file  # (split, step) -> where its predictions go
        self.info = info
        # --gather_for_generation, and the dtype the gathered parameters take (generation.keep_gathered)
        self.gather_for_generation, self.compute_dtype = gather_for_generation, compute_dtype
        self.turn_end = turn_end  # --eos_token: where generation stops besides the EOS (generation.turn_end)
        self.prompt_room = prompt_room  # the most prompt tokens generate may read (ModelSpec.prompt_room)
        self.prompts_cut = 0  # rows whose prompt lost its start to prompt_room, said once
        # The extractive baselines (scored in the first evaluation) are summaries: a chat's reply has none.
        self.scores_baselines = metric == "rouge" and eval_set.dataset.cleaning != "chat"
        self.baselines: dict | None = None

    def evaluate(self, model: nn.Module, epoch: int, step: int, stop_requested=None) -> dict:
        """Generate and score every row of the set; the eval record, on every rank. Collective. When
        `stop_requested()` is true on any rank, every rank abandons the pass (StopCheck), writing nothing."""
        WHERE.enter("generation")
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
        self.baselines = outcome[0].get("baselines")
        return outcome[0]

    def _within_room(self, prompts: dict) -> dict:
        """prompts_within prompt_room; one warning the first time a row loses its start."""
        fitted, cut = prompts_within(prompts, self.prompt_room)
        if cut and not self.prompts_cut and self.info.is_main:
            get_logger().warning(
                "generation reads a prompt's last %d tokens: the model's positions hold the prompt and the %d "
                "tokens it writes (--max_new_tokens), and a %d-token prompt would not fit; its start is left out",
                self.prompt_room, self.generation["max_new_tokens"], prompts["input_ids"].shape[1],
            )  # fmt: skip
        self.prompts_cut += cut
        return fitted

    def _generate_share(self, model: nn.Module, stop_requested) -> list[dict]:
        """This rank's real samples: index, prediction, generated length and scores."""
        dataset, sampler = self.eval_set.dataset, self.eval_set.sampler
        pad_id = dataset.tokenizer.pad_token_id
        rows, position = [], 0
        score = SCORERS[self.metric]
        with_baselines = self.scores_baselines and self.baselines is None
        desc = f"{METRIC_NAMES[self.metric]} evaluation"
        keep = keep_gathered(
            model, self.parallelism, self.gather_for_generation, self.compute_dtype, self.info.device
        )
        stops = generation_stops(model, self.parallelism, dataset.tokenizer, self.turn_end)
        # The tokenizer's padding token: a decoder-only model's config may name none (Llama's). Every stop token:
        # the tokenizer's EOS, which each trained row ends with, also where the model's config names another.
        settings = {**self.generation, "pad_token_id": pad_id, "eos_token_id": list(stops.ids)}
        if stops.strings:  # generate matches them in the text, through the tokenizer
            settings.update(stop_strings=list(stops.strings), tokenizer=dataset.tokenizer)
        with (
            progress_bar(len(self.eval_set.loader), desc, unit="batch", colour="magenta") as bar,
            gathered_for_generation(model, self.parallelism, keep),
        ):
            check_stop = StopCheck(stop_requested, self.info.device)
            for batch in self.eval_set.loader:
                check_stop()
                prompts = self._within_room(self.spec.prompts(move_batch(batch, self.info.device)))
                outputs = generate(model, self.parallelism, prompts, settings)
                ids = self.spec.completions(outputs, prompts).cpu()
                texts = dataset.tokenizer.batch_decode(ids, skip_special_tokens=True)
                lengths = generated_lengths(ids, pad_id, list(stops.ids))
                if stops.strings:
                    texts, lengths = cut_at_stop_strings(ids, texts, lengths, pad_id, stops.strings)
                for text, length in zip(texts, lengths, strict=True):
                    if position < sampler.num_real_samples:
                        index = sampler.indices[position]
                        prediction = text.strip()
                        scores = score(dataset.reference(index), prediction)
                        row = {"index": index, "prediction": prediction, "gen_len": length, **scores}
                        if with_baselines:
                            row["baselines"] = self._baseline_scores(index)
                        rows.append(row)
                    position += 1
                bar.update(1)
        return rows

    def _record(self, ordered: list[dict], epoch: int, step: int, seconds: float) -> dict:
        record = {
            "type": "eval",
            "epoch": epoch,
            "step": step,
            "split": self.eval_set.split,
            **mean_scores(ordered, self.metric),
            "gen_len": sum(row["gen_len"] for row in ordered) / len(ordered),
            "num_samples": len(ordered),
            "seconds": seconds,
        }
        if self.scores_baselines:
            record["baselines"] = self.baselines or {
                name: mean_scores([row["baselines"][name] for row in ordered], "rouge") for name in BASELINES
            }
        return record

    def _baseline_scores(self, index: int) -> dict:
        """ROUGE of one row's extractive baselines, scored by the rank that holds it, not by rank 0 alone."""
        dataset = self.eval_set.dataset
        article, reference = dataset.article(index), dataset.reference(index)
        clean = dataset.clean_text
        return {name: rouge_scores(reference, make(article, clean)) for name, make in BASELINES.items()}

    def _write_predictions(self, ordered: list[dict], step: int) -> None:
        """One line per scored row, in split order; `reference` is exactly the text scored."""
        dataset = self.eval_set.dataset
        path = self.predictions_file(self.eval_set.split, step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            for row in ordered:
                index = row["index"]
                line = {"id": dataset.row_id(index), "reference": dataset.reference(index),
                        "prediction": row["prediction"]}  # fmt: skip
                f.write(json.dumps(line, ensure_ascii=False) + "\n")

    def _log(self, record: dict, ordered: list[dict]) -> None:
        what = f"{record['split']}, {record['num_samples']} rows, step {record['step']}"
        if self.metric == "rouge":
            baselines = record.get("baselines")
            compared = "" if baselines is None else (
                f" (baselines RL: lead-3 {baselines['lead3']['rougeL']:.2f}, "
                f"{lead_steps_label(self.eval_set.dataset.cleaning)} {baselines['lead_steps']['rougeL']:.2f})"
            )  # fmt: skip
            get_logger().info(
                "ROUGE (%s): R1 %.2f | R2 %.2f | RL %.2f | RLsum %.2f | gen_len %.1f | %.1f s%s",
                what, record["rouge1"], record["rouge2"], record["rougeL"], record["rougeLsum"], record["gen_len"],
                record["seconds"], compared,
            )  # fmt: skip
        else:
            get_logger().info("accuracy (%s): %.2f%% | gen_len %.1f | %.1f s", what, record["accuracy"],
                              record["gen_len"], record["seconds"])  # fmt: skip
        for row in ordered[:EXAMPLES_LOGGED]:
            reference = self.eval_set.dataset.reference(row["index"])
            get_logger().info("  reference:  %s\n  prediction: %s", reference[:200], row["prediction"][:200])
