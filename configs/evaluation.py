"""Generated outputs and their scores (utils/eval/): what is generated, how it is scored (ROUGE, or exact-match
accuracy for classification-as-text tasks), and which epoch counts as the best.

The validation loss is the tutorial's (--run_validation, configs/training.py); --run_validation false turns all
evaluation off, generation included. --eval_rouge false keeps the validation loss and drops generation alone.
"""

from dataclasses import dataclass
from typing import Literal

from configs.options import option

# The scores each --eval_metric writes into an eval record (utils/eval/scores.py computes them).
METRIC_KEYS = {"rouge": ("rouge1", "rouge2", "rougeL", "rougeLsum"), "accuracy": ("accuracy",)}
METRIC_NAMES = {"rouge": "ROUGE", "accuracy": "accuracy"}  # as messages, bars and the log say them


@dataclass
class EvalConfig:
    eval_rouge: bool = option(
        default=True,
        help=(
            "With --run_validation true: after each epoch (and every eval_every_n_steps), also generate "
            "outputs for the first eval_num_samples validation rows (by default the validation loss's own "
            "--num_val_samples) on every rank and score them with "
            "--eval_metric (ROUGE by default): an eval record in metrics.jsonl and "
            "output_dir/predictions/validation_step_<N>.jsonl. false: the validation loss alone."
        ),
    )
    eval_metric: Literal["rouge", "accuracy"] = option(
        default="rouge",
        help=(
            "How generated outputs are scored: rouge (rouge-score's ROUGE-1/2/L/Lsum, with the lead-3 baselines), "
            "or accuracy (exact match of the stripped output and target, in percent: for classification as "
            "text, such as FinancialPhraseBank's positive/negative/neutral)."
        ),
    )
    eval_num_samples: int | None = option(
        default=None,
        help=(
            "Rows that generation evaluates: the first N of the split, each scored once; 0 = the whole split. "
            "NONE: the rows the validation loss reads, the first --num_val_samples (with --evaluate_only, of "
            "--eval_split), so a small run's evaluation is as small as the run."
        ),
        minimum=0,
    )
    eval_every_n_steps: int = option(
        default=0,
        help=(
            "Also evaluate every N optimizer steps inside an epoch: the validation loss (a validation record) "
            "and, with eval_rouge, ROUGE (an eval record). Needs --run_validation true. 0: at epoch ends only."
        ),
        minimum=0,
    )
    eval_on_start: bool = option(
        default=False,
        help=(
            "Also evaluate before the first step of a new run (HF's name): the validation loss (perplexity for "
            "a decoder-only model) and ROUGE of the model as it starts, as step 0's records: what training "
            "should beat. Needs --run_validation true."
        ),
    )
    num_beams: int = option(
        default=1,
        help="Beams of the summaries' beam search; 1 = greedy decoding (fastest, deterministic).",
        minimum=1,
    )
    max_new_tokens: int = option(
        default=0,
        help=(
            "Longest output generated, in tokens; 0 = --max_target_length (an encoder-decoder's trained target "
            "length; for a decoder-only model, whose rows --max_seq_len bounds, its default reply length)."
        ),
        minimum=0,
    )
    length_penalty: float = option(
        default=1.0,
        help=(
            "Beam search only: exponent on the length in the beam score; > 1 favours longer summaries, "
            "< 1 shorter (transformers' default 1.0)."
        ),
    )
    no_repeat_ngram_size: int = option(
        default=0,
        help="Forbid repeating any n-gram of this size in a summary (0 = off; 3 curbs loops of small models).",
        minimum=0,
    )
    gather_for_generation: Literal["auto", "true", "false"] = option(
        default="auto",
        help=(
            "true: every FSDP unit's parameters are gathered once per evaluation and kept until it ends; false: "
            "each unit is gathered again for every generated token (for t5-11b about 13 GB of all-gather per "
            "token per rank), holding about one unit at a time. auto: true where the whole model's parameters, "
            "in the compute dtype, take at most half of the free memory of every rank's device (the GPU's, or "
            "the host's MemAvailable shared by its ranks), with more than one rank."
        ),
    )
    metric_for_best: Literal["val_loss", "rouge1", "rouge2", "rougeL", "rougeLsum", "accuracy"] = option(
        default="val_loss",
        help=(
            "Which epoch is the best: lowest val_loss, or highest score of --eval_metric (a ROUGE key, or "
            "accuracy). The best epoch's model is "
            "hf_model/ (and the --save_model .pt); kept across --resume."
        ),
        on_resume="fixed",
    )
    evaluate_only: bool = option(
        default=False,
        help=(
            "Score a saved model without training: --model_name (a hub name, a folder such as "
            "OUTPUT_DIR/hf_model, or a LoRA run's local OUTPUT_DIR/hf_adapter, merged into its base), or the "
            "checkpoint or .pt of --resume, on --eval_split, under FSDP on every "
            "rank. Writes the eval record and the predictions file into output_dir/evaluate_only/, apart from "
            "what training wrote."
        ),
        on_resume="launch",
    )
    eval_split: Literal["auto", "validation", "test", "train"] = option(
        default="auto",
        help=(
            "The split evaluation reads (said at start). Training: auto evaluates on the validation split (the "
            "data's own, else --validation_split_percentage of train held out), and where that is held out and "
            "the data has a test split, also scores the test split once after training (its loss, "
            "--eval_metric and predictions, by the last step's model); validation: the validation split alone; "
            "test: the test split, after each epoch, choosing the best model (train keeps every row: none is held "
            "out). A resume keeps the splits its checkpoint trained with. --evaluate_only: the split it scores; "
            "auto: the validation split where the data has one of its own, else its test split; train: "
            "--evaluate_only alone."
        ),
    )


def generation_rows(evaluation: EvalConfig, num_val_samples: int | None) -> int | None:
    """How many rows of its split generation scores (0: all; None: by source, configs/data.rows_to_read):
    --eval_num_samples, or with NONE as many as the validation loss reads (--num_val_samples), so that both
    see the same articles."""
    return num_val_samples if evaluation.eval_num_samples is None else evaluation.eval_num_samples
