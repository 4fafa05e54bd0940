"""A tiny randomly initialised encoder-decoder of one family, with a tokenizer made from the embedded sample,
offline: what the tests train to show that every supported family works (docs/models.md).

    python scripts/make_tiny_family.py --family bart --out /tmp/tiny-bart

T5 v1.1 (flan-t5's architecture: gated GELU, an lm_head of its own), mT5 and UMT5 take the embedded tiny
T5's sentencepiece tokenizer, PEGASUS the same sentencepiece model through its own tokenizer class (which
puts its special tokens first), BART a byte-level BPE trained here by `tokenizers` on the embedded sample's
texts. T5 v1.0 itself is the embedded data/tiny-t5. Each model has two encoder and two decoder layers of
width 64, and is saved by its own class, as a hub checkpoint is.
"""

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.paths import EMBEDDED_DATA_DIR, EMBEDDED_MODEL_DIR  # noqa: E402
from scripts.make_random_t5 import untie_head  # noqa: E402

SEED = 0
T5_SHAPE = {"d_model": 64, "d_kv": 16, "num_heads": 4, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2}
BART_SHAPE = {
    "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 96, "max_position_embeddings": 512,
    "attention_dropout": 0.1, "activation_dropout": 0.1,  # as the published PEGASUS configs
}  # fmt: skip
FAMILIES = ("t5-v1_1", "mt5", "umt5", "bart", "pegasus")  # T5 v1.0 itself: the embedded data/tiny-t5
BPE_VOCAB = 1000


def sample_texts() -> list[str]:
    """Every headline, title and text of the embedded sample."""
    with open(Path(EMBEDDED_DATA_DIR) / "wikihowAll.csv", encoding="utf-8", newline="") as f:
        return [text for row in csv.reader(f) for text in row if text]


def sentencepiece_tokenizer(tokenizer_class, out: Path):
    """`tokenizer_class` (T5Tokenizer, PegasusTokenizer) over the embedded tiny T5's sentencepiece model."""
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "spiece.model").write_bytes((Path(EMBEDDED_MODEL_DIR) / "spiece.model").read_bytes())
        tokenizer = tokenizer_class.from_pretrained(scratch)
    tokenizer.save_pretrained(str(out))
    return tokenizer


def bpe_tokenizer(out: Path):
    """A byte-level BPE of BPE_VOCAB tokens trained on the sample's texts, as BART's tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import BartTokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        sample_texts(), vocab_size=BPE_VOCAB, min_frequency=2, show_progress=False,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        bpe.save_model(scratch)
        tokenizer = BartTokenizer(f"{scratch}/vocab.json", f"{scratch}/merges.txt")
    tokenizer.save_pretrained(str(out))
    return tokenizer


def make(family: str, out: str) -> int:
    """Write the tiny `family` model and its tokenizer into `out`; returns its parameter count."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    if family in ("t5-v1_1", "mt5", "umt5"):
        tokenizer = sentencepiece_tokenizer(transformers.T5Tokenizer, folder)
        config_class = {"t5-v1_1": transformers.T5Config, "mt5": transformers.MT5Config}.get(
            family, transformers.UMT5Config
        )
        config = config_class(
            vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
            feed_forward_proj="gated-gelu", **T5_SHAPE,
        )  # fmt: skip
    elif family == "pegasus":
        tokenizer = sentencepiece_tokenizer(transformers.PegasusTokenizer, folder)
        config = transformers.PegasusConfig(
            vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id, **BART_SHAPE,
        )  # fmt: skip
    elif family == "bart":
        tokenizer = bpe_tokenizer(folder)
        config = transformers.BartConfig(
            vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.eos_token_id,
            forced_bos_token_id=None, forced_eos_token_id=tokenizer.eos_token_id, **BART_SHAPE,
        )  # fmt: skip
    else:
        raise SystemExit(f"--family must be one of {', '.join(FAMILIES)}, not {family!r}")
    torch.manual_seed(SEED)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    if family in ("t5-v1_1", "mt5", "umt5"):
        untie_head(model)  # the published T5 v1.1, flan-t5, mT5 and UMT5 checkpoints have an lm_head of their own
    if family == "bart":  # a trained BART's final_logits_bias is not zero: show that the export keeps it
        model.final_logits_bias.normal_(0, 0.1)
    model.save_pretrained(str(folder))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=FAMILIES)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    parameters = make(args.family, args.out)
    print(json.dumps({"family": args.family, "out": args.out, "parameters": parameters}))


if __name__ == "__main__":
    main()
