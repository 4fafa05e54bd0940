"""Summarize articles with a trained model, on CPU or GPU, one process.

    python scripts/summarize.py --model OUTPUT_DIR/hf_model --input articles.txt     # one article per line
    python scripts/summarize.py --model OUTPUT_DIR/hf_model --input test.jsonl       # a data file, as in training
    cat article.txt | python scripts/summarize.py --model OUTPUT_DIR/hf_model         # stdin, one per line

Prints one output per line, in input order. A data file (.csv, .jsonl, .json, .parquet) is read as training
reads it, and its text column is the training default's (text, document, article, ...) or --text_column.
Texts get the training run's cleaning (WikiHow's for a WikiHow run: newlines become spaces, its noise markers
go), source prefix and truncation, and outputs its generation settings (beams, length, ...): the run saved
both with the model (config.json `task_specific_params.summarization`, generation_config.json), so nothing is
typed again. A model trained elsewhere (a hub checkpoint) with no generation length of its own takes its
published summarization settings (T5's config.json: beams, up to 200 tokens), else training's default target
length (150), not transformers' 20 tokens.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from configs.data import DataConfig  # noqa: E402
from configs.errors import UserError  # noqa: E402
from utils.base.log import get_logger, setup_logging  # noqa: E402
from utils.checkpoint.hf_export import summarization_settings  # noqa: E402
from utils.data import sources  # noqa: E402
from utils.data.cache import CLEANINGS  # noqa: E402
from utils.model import loading  # noqa: E402
from utils.spec import SEQ2SEQ, ModelSpec  # noqa: E402

# What a model saved without a run's settings is read and generated with: training's defaults.
TRAINING_DEFAULTS = DataConfig()


# Data files, read as training reads them; anything else is text, one article per line.
DATA_FILE_TYPES = (".csv", ".jsonl", ".json", ".parquet")


def read_articles(source: str | None, text_column: str = "") -> list[str]:
    """Articles from a data file (its text column), a text file (one per line) or stdin (None or '-')."""
    if source in (None, "-"):
        return [line for line in sys.stdin.read().splitlines() if line.strip()]
    path = Path(source)
    if not path.is_file():
        raise UserError(f"--input {source!r}: no such file")
    if path.suffix.lower() in DATA_FILE_TYPES:
        found, columns_from, records = sources.columns_and_records(path)
        column = sources.resolve_column(found, "--text_column", text_column, None, sources.TEXT_COLUMN_NAMES,
                                        columns_from)  # fmt: skip
        return [sources.as_text(record.get(column), column, f"{path}, {where}") for where, record in records]
    try:
        return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise sources.not_utf8(path, "Save it as UTF-8.") from None


# Published summarization settings (T5's config.json task_specific_params) that generate takes as they are.
PUBLISHED_GENERATION_KEYS = ("num_beams", "min_length", "length_penalty", "no_repeat_ngram_size", "early_stopping")


def untrained_generation(model, params: dict) -> dict:
    """generate's settings beyond the model's generation config: none for a model a run saved (its
    generation_config.json holds the run's), nor for one whose generation config sets a length. Otherwise
    transformers would stop at its 20-token default: the model's published summarization settings (T5's:
    beams, lengths up to 200), else training's default target length; said once."""
    own = model.generation_config
    if "max_new_tokens" in params or own.max_new_tokens is not None or own.max_length is not None:
        return {}
    generation = {key: params[key] for key in PUBLISHED_GENERATION_KEYS if key in params}
    generation["max_new_tokens"] = params.get("max_length") or TRAINING_DEFAULTS.max_target_length
    get_logger().warning(
        "the model carries no generation length of its own or of a training run: summaries of up to %d new "
        "tokens%s", generation["max_new_tokens"], " (its published summarization settings)" if params else "",
    )  # fmt: skip
    return generation


def source_cleaning(params: dict) -> str:
    """How the model's training run prepared its texts (CLEANINGS): the run's model names it (one saved before
    the field, with the run's max_source_length, was a WikiHow run's); a model no run saved (the hub's, with
    or without published settings, the embedded base) reads a text as it is."""
    return params.get("cleaning", "wikihow" if "max_source_length" in params else "plain")


def summarize(model, spec: ModelSpec, tokenizer, articles: list[str], batch_size: int) -> list[str]:
    """Summaries of `articles`, prepared and generated as the model's (of `spec`) training run did."""
    params = summarization_settings(model.config, spec)
    cleaning = source_cleaning(params)
    if cleaning not in CLEANINGS:
        raise UserError(f"the model's cleaning {cleaning!r} is unknown to this version: update the package")
    clean = CLEANINGS[cleaning]
    prefix = params.get("prefix", "")
    max_length = params.get("max_source_length", TRAINING_DEFAULTS.max_source_length)
    generation = untrained_generation(model, params)
    summaries = []
    for start in range(0, len(articles), batch_size):
        texts = [prefix + clean(article) for article in articles[start : start + batch_size]]
        inputs = tokenizer(texts, max_length=max_length, truncation=True, padding=True, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**inputs.to(model.device), **generation)
        summaries += [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]
    return summaries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The summaries go to stdout, one per line in input order; messages go to stderr, so "
        "`> summaries.txt` keeps the summaries alone.",
    )
    parser.add_argument("--model", required=True, help="a folder such as OUTPUT_DIR/hf_model (or a "
                        "--peft lora run's OUTPUT_DIR/hf_adapter: its base, adapter merged in), or a hub "
                        "name")  # fmt: skip
    parser.add_argument("--input", help="a data file (.csv, .jsonl, .json, .parquet), or a text file with one "
                        "article per line; default: stdin")  # fmt: skip
    parser.add_argument("--text_column", default="", help="a data file's text column (default: as in training)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--batch_size", type=int, default=8)
    args = parser.parse_args(argv)
    setup_logging(stream=sys.stderr)  # stdout holds the summaries alone
    try:
        # A mistyped folder, or a hub name offline, fails here in seconds (the model's config and tokenizer
        # checked), before the model loads; an adapter's base is checked as it loads.
        device = (
            "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
        )
        if loading.adapter_base_of(args.model) is None:
            config, spec = loading.run_model_config(args.model)
            if spec is not SEQ2SEQ:
                raise UserError(
                    f"{args.model} is a decoder-only model: this script summarises with encoder-decoders. "
                    "Generate with transformers' pipeline('text-generation', model=...) (docs/causal.md)"
                )
            tokenizer = loading.load_tokenizer(args.model, config=config, spec=spec)
            articles = read_articles(args.input, args.text_column)
            model = spec.model_class.from_pretrained(loading.resolved_name(args.model))
        else:  # a --peft lora run's adapter folder: its base with the adapter merged in
            articles = read_articles(args.input, args.text_column)
            model, tokenizer, base, spec = loading.load_adapter_model(args.model)
            get_logger().info("%s is a LoRA adapter: merged into its base model %s", args.model, base)
        model = model.to(device).eval()
        for summary in summarize(model, spec, tokenizer, articles, args.batch_size):
            print(summary)
    except (UserError, OSError) as err:
        get_logger().error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
