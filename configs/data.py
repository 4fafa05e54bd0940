"""Which rows a run reads (WikiHow, your files, a saved or named dataset), and how they become token ids
(utils/data/sources.py, utils/data/cache.py; docs/your_data.md)."""

from dataclasses import dataclass
from typing import Literal

from configs.options import option
from configs.paths import EMBEDDED_DATA_DIR


@dataclass
class DataConfig:
    data_dir: str = option(
        default=str(EMBEDDED_DATA_DIR),
        help=(
            "Folder of the data: WikiHow (wikihowAll.csv and all_train.txt/all_val.txt/all_test.txt; "
            "scripts/download_wikihow.py), or train/validation/test files (.csv, .jsonl, .json, .parquet; "
            "validation may be val, valid or dev), or a dataset saved by datasets' save_to_disk. Default: the "
            "embedded WikiHow sample."
        ),
        on_resume="fixed",
        path="path",
    )
    train_file: str = option(
        default="",
        help=(
            "Training rows in a file instead of --data_dir: .csv (with a header), .jsonl, .json, .parquet, or "
            ".txt in FinancialPhraseBank's format (sentence@label lines). Without --validation_file, "
            "--validation_split_percentage of it becomes validation."
        ),
        on_resume="fixed",
        path="path",
    )
    validation_file: str = option(
        default="", help="Validation rows in a file (the types of --train_file).", on_resume="fixed", path="path"
    )
    test_file: str = option(
        default="",
        help=(
            "Test rows in a file (the types of --train_file): scored after training where validation is held out "
            "of train, evaluated on instead with --eval_split test, scored by --evaluate_only --eval_split test."
        ),
        on_resume="fixed",
        path="path",
    )
    dataset_name: str = option(
        default="",
        help=(
            "A dataset for datasets.load_dataset instead of --data_dir: a hub name (cnn_dailymail, xsum; needs "
            "the network once, then datasets' cache) or a local dataset folder."
        ),
        on_resume="fixed",
        path="path_or_name",
    )
    dataset_config_name: str = option(
        default="", help="The config of --dataset_name (cnn_dailymail: 3.0.0).", on_resume="fixed"
    )
    text_column: str = option(
        default="",
        help=(
            "The column of the text the model reads. Default: the known dataset's (cnn_dailymail article, xsum "
            "document, WikiHow text, FinancialPhraseBank sentence), else the first of text, document, "
            "article, source, sentence, dialogue, input, content."
        ),
        on_resume="fixed",
    )
    summary_column: str = option(
        default="",
        help=(
            "The column of the text the model learns to write. Default: the known dataset's (cnn_dailymail "
            "highlights, xsum summary, WikiHow headline, FinancialPhraseBank label), else the first of summary, "
            "highlights, target, label, headline, output, abstract."
        ),
        on_resume="fixed",
    )
    validation_split_percentage: int = option(
        default=5,
        help=(
            "Where the data has no validation split: this percentage of train's rows (at least one, from two "
            "rows) becomes validation, drawn by --validation_split_seed, the same on every rank and run."
        ),
        minimum=1,
        maximum=50,
        on_resume="fixed",
    )
    validation_split_seed: int = option(
        default=0,
        help="The seed of --validation_split_percentage's choice of rows.",
        minimum=0,
        on_resume="fixed",
    )
    cache_dir: str = option(
        default="",
        help=(
            "Folder for the memory-mapped Arrow cache of the splits' texts and token ids, built once per "
            "machine and shared by every rank and later run. A changed file, split list, column, tokenizer, "
            "length or prefix gets a new cache folder beside the old ones, which are never removed: delete "
            "them when no run is starting. Default: a cache/ folder beside the data (<data_dir>/cache, the "
            "train file's folder/cache), or in datasets' cache for --dataset_name."
        ),
        path="path",
    )
    num_train_samples: int | None = option(
        default=None,
        help=(
            "Use the first N training rows; 0 = all. NONE: by source: the tutorial's 1500 of WikiHow, every row "
            "of any other source (your files, a dataset)."
        ),
        minimum=0,
        on_resume="fixed",
    )
    num_val_samples: int | None = option(
        default=None,
        help=(
            "Use the first N validation rows (of --eval_split's with --evaluate_only); 0 = all. NONE: by "
            "source: the tutorial's 300 of WikiHow, every row of any other source. Generation scores the same "
            "rows unless --eval_num_samples says otherwise."
        ),
        minimum=0,
        on_resume="fixed",
    )
    max_source_length: int = option(
        default=512,
        help=(
            "An encoder-decoder's source (article) tokens kept (truncation). A decoder-only model's rows are "
            "bounded by --max_seq_len alone, prompt and completion together (TRL's max_length): this does not "
            "apply to them."
        ),
        minimum=2,
        on_resume="fixed",
    )
    max_target_length: int = option(
        default=150,
        help=(
            "An encoder-decoder's target (summary) tokens kept (truncation), and the length generation writes "
            "unless --max_new_tokens says otherwise. A decoder-only model's completions are not cut to it (its "
            "rows are bounded by --max_seq_len); it is only their generated length there."
        ),
        minimum=2,
        on_resume="fixed",
    )
    source_prefix: str = option(
        default="",
        help=(
            "Text put before every source text. The tutorial uses none; pretrained T5 checkpoints were "
            "trained with 'summarize: '."
        ),
        on_resume="fixed",
    )
    dataset_text_field: str = option(
        default="",
        help=(
            "Decoder-only models: the column of whole texts to train on, every token (TRL's name; the Llama 2 "
            "guide's content), instead of prompt/completion columns (--text_column, --summary_column). Each "
            "text is cut to --max_seq_len tokens. Generation has no references to score then: validation is "
            "the loss and perplexity."
        ),
        on_resume="fixed",
    )
    eos_token: str = option(
        default="",
        help=(
            "Decoder-only models: the text that ends a turn in the data (TRL's name; the Llama 2 guide's texts "
            "end each with <|endoftext|>). Generation stops there: the export's generation_config.json gets its "
            "id where it is one of the tokenizer's own tokens (a special or added one), else a stop string "
            "(generate then needs tokenizer=tokenizer), and evaluation's generation stops alike. The data is not "
            "changed. Default: the tokenizer's EOS alone."
        ),
    )
    max_seq_len: int | None = option(
        default=None,
        help=(
            "Decoder-only models: the tokens of a row, prompt and completion together (TRL's max_length), and of "
            "a --packing block. A longer row loses its prompt's start first (the latest turns stay), then its "
            "completion's end, keeping its end of turn (EOS, the chat template's marker); the start line counts "
            "the rows cut and the tokens dropped. Past the model's positions (max_position_embeddings, "
            "n_positions) refused for learned positions (GPT-2, OPT, BART), warned for rotary ones without "
            "rope_scaling. NONE: 1024, or the model's positions where it has fewer (said at start)."
        ),
        minimum=8,
        on_resume="fixed",
    )
    packing: bool = option(
        default=False,
        help=(
            "Decoder-only models: train and validate on blocks of --max_seq_len tokens made of several rows "
            "instead of one padded row per sample (--packing_strategy says how). Generation reads the rows "
            "unpacked."
        ),
        on_resume="fixed",
    )
    packing_strategy: Literal["documents", "bfd", "wrapped"] = option(
        default="documents",
        help=(
            "How --packing fills a block. documents: whole rows in their order (each within a block: "
            "--max_seq_len bounds a row), each attending to itself alone (position ids restart per row; the "
            "loss of a row as if it were alone; a model whose forward takes no position ids is refused), the "
            "rest of the block padding. bfd: the same, the rows placed by best-fit decreasing (TRL's default): "
            "longest first, each into the block it fills best, so fewer blocks and less padding. wrapped: every "
            "row's tokens concatenated and cut into full blocks, the last part dropped, rows attending across "
            "their boundaries (the Llama 2 guide's packing, TRL's 'wrapped')."
        ),
        on_resume="fixed",
    )
    completion_only_loss: bool = option(
        default=True,
        help=(
            "Decoder-only models (Llama, GPT-2, ...): the loss on the completion's tokens (the target column; "
            "a conversation's: every assistant reply) alone, as TRL's SFTTrainer takes it; false: on the "
            "prompt's too. An encoder-decoder trains on its target alone either way."
        ),
        on_resume="fixed",
    )
    pad_to_max_length: bool = option(
        default=False,
        help=(
            "true: pad every sample to the max lengths, as the tutorial does (fixed shapes, predictable "
            "memory). false: pad each batch to its longest sample (much faster on short texts)."
        ),
    )
    group_by_length: bool = option(
        default=False,
        help=(
            "Order each epoch so that a step's batches hold samples of similar length (shuffled, then sorted "
            "by --length_key within groups of 256 x batch_size_training samples): less padding with "
            "pad_to_max_length false. The order stays a function of seed and epoch, the same on every rank "
            "and exactly resumable, also on another number of ranks."
        ),
        on_resume="fixed",
    )
    length_key: Literal["source", "target_then_source"] = option(
        default="source",
        help=(
            "What group_by_length sorts by. source: the articles' token counts. target_then_source: the "
            "summaries' token counts in buckets of 8, then the articles': less padding on both sides (the "
            "decoder's too), most at large batches (scripts/padding_share.py measures it on your data; "
            "docs/throughput.md: the data path). Needs --group_by_length true."
        ),
        on_resume="fixed",
    )
    print_text: bool = option(default=False, help="Log every source text when its item is read (debug).")


# --max_seq_len NONE: this, or a model's positions where it has fewer (utils/spec.py: CausalSpec.fitted_data).
DEFAULT_MAX_SEQ_LEN = 1024


def seq_len(data: DataConfig) -> int:
    """A decoder-only row's tokens: --max_seq_len, or where it is NONE (settings no model has fitted: a Dataset
    built by hand) DEFAULT_MAX_SEQ_LEN."""
    return data.max_seq_len or DEFAULT_MAX_SEQ_LEN


# The tutorial's subset of WikiHow (its data), per split: what NONE means for WikiHow (rows_to_read).
TUTORIAL_ROWS = {"train": 1500, "validation": 300, "test": 300}


def rows_to_read(asked: int | None, split: str, tutorial_data: bool) -> int | None:
    """The first N rows of `split` a run reads, None for all: `asked` (0: all), or where it is NONE, by source:
    the tutorial's subset of WikiHow (`tutorial_data`), every row of any other source."""
    if asked is None:
        return TUTORIAL_ROWS[split] if tutorial_data else None
    return asked or None
