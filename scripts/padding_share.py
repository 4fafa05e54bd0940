"""How much of what the model sees is padding under each training order, on your data (no model, no training).

    python scripts/padding_share.py
    python scripts/padding_share.py --batch_sizes 4 64 --nproc 8 -- --train_file my.jsonl --max_source_length 1024

The flags after `--` are T5_training.py's (the data, the tokenizer, the lengths, --num_train_samples, --seed);
the train split is read and tokenised as a run reads it (through the same cache). For each batch size per rank
it deals one epoch (epoch 0) to --nproc ranks as the training sampler does, pads each batch to its longest
sample (--pad_to_max_length false, the default; with true every order pads to the max lengths alike), and
prints the padded share of the source, target and all tokens: for the shuffled order, `--group_by_length true`
(by source) and `--length_key target_then_source`. Padding is computed by the encoder and the decoder like
real tokens, so the share is about the share of the step's work spent on it (attention's cost grows faster
than that with the length).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.cli import parse_args  # noqa: E402
from summarization_dataset import FORMAT  # noqa: E402
from utils.data.loaders import build_dataset  # noqa: E402
from utils.data.samplers import LengthGrouping, length_keys, train_sampler_for  # noqa: E402
from utils.model.loading import load_tokenizer  # noqa: E402

ORDERS = ("shuffled", "source", "target_then_source")


def padded_shares(
    sources: list[int], targets: list[int], batch_size: int, nproc: int, order: str, seed: int = 1
) -> tuple[float, float, float]:
    """The padded share of the source tokens, of the target tokens and of both over one epoch dealt in
    `order`."""
    grouping = None if order == "shuffled" else LengthGrouping(length_keys(sources, targets, order), batch_size)
    padded, real = [0, 0], [0, 0]
    for rank in range(nproc):
        indices = list(train_sampler_for(range(len(sources)), rank, nproc, seed=seed, grouping=grouping))
        for start in range(0, len(indices), batch_size):
            batch = indices[start : start + batch_size]
            for side, lengths in enumerate((sources, targets)):
                longest = max(lengths[i] for i in batch)
                padded[side] += sum(longest - lengths[i] for i in batch)
                real[side] += sum(lengths[i] for i in batch)
    padded.append(sum(padded))
    real.append(sum(real))
    return tuple(pad / (pad + tokens) for pad, tokens in zip(padded, real, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[4, 16, 64], help="per rank")
    parser.add_argument("--nproc", type=int, default=1, help="ranks the epoch is dealt to")
    parser.add_argument("run_flags", nargs="*", help="T5_training.py's flags, after --")
    args = parser.parse_args(argv)
    config = parse_args(args.run_flags)
    tokenizer = load_tokenizer(config.train.model_name)
    dataset = build_dataset(tokenizer, FORMAT, "train", config.data.num_train_samples, config.data, args.nproc)
    sources, targets = dataset.source_lengths(), dataset.target_lengths()
    print(f"{len(sources)} training samples of {dataset.source_description}; padded share of the source, target "
          "and all tokens")  # fmt: skip
    print("| batch per rank | " + " | ".join(ORDERS) + " |")
    print("| --- |" + " --- |" * len(ORDERS))
    for batch_size in args.batch_sizes:
        cells = []
        for order in ORDERS:
            source, target, both = padded_shares(
                sources, targets, batch_size, args.nproc, order, config.train.seed
            )
            cells.append(f"{source:.1%}, {target:.1%} ({both:.1%})")
        print(f"| {batch_size} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
