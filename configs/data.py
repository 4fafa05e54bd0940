"""Which WikiHow articles are read, and how they become token ids (summarization_dataset.py)."""

from dataclasses import dataclass

from configs.options import option
from configs.paths import EMBEDDED_DATA_DIR


@dataclass
class DataConfig:
    data_dir: str = option(
        default=str(EMBEDDED_DATA_DIR),
        help=(
            "Folder with wikihowAll.csv and all_train.txt/all_val.txt/all_test.txt. "
            "Default: the embedded sample; the real data goes in data/ (scripts/download_wikihow.py)."
        ),
        on_resume="fixed",
    )
    cache_dir: str = option(
        default="",
        help=(
            "Folder for the memory-mapped Arrow cache of the cleaned splits and their token ids, built once "
            "per machine and shared by every rank and later run. A changed file, split list, tokenizer, "
            "length or prefix gets a new cache folder beside the old ones, which are never removed: delete "
            "them when no run is starting. Default: <data_dir>/cache."
        ),
    )
    num_train_samples: int = option(
        default=1500,
        help="Use the first N training articles (tutorial: 1500); 0 = all.",
        minimum=0,
        on_resume="fixed",
    )
    num_val_samples: int = option(
        default=300,
        help="Use the first N validation articles (tutorial: 300); 0 = all.",
        minimum=0,
        on_resume="fixed",
    )
    max_source_length: int = option(
        default=512, help="Article tokens kept (truncation).", minimum=2, on_resume="fixed"
    )
    max_target_length: int = option(
        default=150, help="Summary tokens kept (truncation).", minimum=2, on_resume="fixed"
    )
    source_prefix: str = option(
        default="",
        help=(
            "Text put before every article. The tutorial uses none; pretrained T5 checkpoints were "
            "trained with 'summarize: '."
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
            "Order each epoch so that a step's batches hold articles of similar length (shuffled, then sorted "
            "by length within groups of 256 x batch_size_training samples): less padding with "
            "pad_to_max_length false. The order stays a function of seed and epoch, the same on every rank "
            "and exactly resumable, also on another number of ranks."
        ),
        on_resume="fixed",
    )
    print_text: bool = option(default=False, help="Log every source text when its item is read (debug).")
