"""A tiny randomly initialised model of one family, with a tokenizer made from the embedded sample, offline:
what the tests train to show that every supported family works (docs/models.md).

    python scripts/make_tiny_family.py --family bart --out /tmp/tiny-bart

T5 v1.1 (flan-t5's architecture: gated GELU, an lm_head of its own), mT5 and UMT5 take the embedded tiny
T5's sentencepiece tokenizer, PEGASUS the same sentencepiece model through its own tokenizer class (which
puts its special tokens first), BART a byte-level BPE trained here by `tokenizers` on the embedded sample's
texts. T5 v1.0 itself is the embedded data/tiny-t5. Each model has two encoder and two decoder layers of
width 64, and is saved by its own class, as a hub checkpoint is.

The decoder-only families (CAUSAL_FAMILIES): Llama (grouped-query attention, RoPE, RMSNorm; an lm_head of its
own, or tied to the embedding in `llama-tied`) with a BPE tokenizer that starts every text with <s> and has no
padding token, as Llama 2's; GPT-2 (Conv1D layers, learned positions, a tied head) with GPT-2's tokenizer
class over the same BPE, whose one special token <|endoftext|> is its start, end and unknown token. Each has
two layers of width 64.
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
CAUSAL_FAMILIES = ("llama", "llama-tied", "gpt2")
LLAMA_SHAPE = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512,
}  # fmt: skip
GPT2_SHAPE = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512}
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


def trained_bpe(special_tokens: list[str]):
    """A byte-level BPE of BPE_VOCAB tokens trained on the sample's texts, `special_tokens` first."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        sample_texts(), vocab_size=BPE_VOCAB, min_frequency=2, show_progress=False, special_tokens=special_tokens
    )
    return bpe


def bpe_tokenizer(out: Path, tokenizer_class=None, special_tokens=("<s>", "<pad>", "</s>", "<unk>", "<mask>")):
    """`tokenizer_class` (BART's by default, GPT-2's) over a BPE trained here."""
    from transformers import BartTokenizer

    bpe = trained_bpe(list(special_tokens))
    with tempfile.TemporaryDirectory() as scratch:
        bpe.save_model(scratch)
        tokenizer = (tokenizer_class or BartTokenizer)(f"{scratch}/vocab.json", f"{scratch}/merges.txt")
    tokenizer.save_pretrained(str(out))
    return tokenizer


def llama_tokenizer(out: Path):
    """A BPE trained here as Llama 2's tokenizer presents itself: <s> before every text, </s> its end, no
    padding token."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    bpe = trained_bpe(["<unk>", "<s>", "</s>"])
    bos = bpe.token_to_id("<s>")
    bpe.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
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
    elif family in ("llama", "llama-tied"):
        tokenizer = llama_tokenizer(folder)
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=family == "llama-tied", **LLAMA_SHAPE,
        )  # fmt: skip
    elif family == "gpt2":
        tokenizer = bpe_tokenizer(folder, transformers.GPT2TokenizerFast, special_tokens=("<|endoftext|>",))
        config = transformers.GPT2Config(
            vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            **GPT2_SHAPE,
        )  # fmt: skip
    else:
        raise SystemExit(f"--family must be one of {', '.join(FAMILIES + CAUSAL_FAMILIES)}, not {family!r}")
    torch.manual_seed(SEED)
    causal = family in CAUSAL_FAMILIES
    auto_class = transformers.AutoModelForCausalLM if causal else transformers.AutoModelForSeq2SeqLM
    model = auto_class.from_config(config)
    if family in ("t5-v1_1", "mt5", "umt5"):
        untie_head(model)  # the published T5 v1.1, flan-t5, mT5 and UMT5 checkpoints have an lm_head of their own
    if family == "bart":  # a trained BART's final_logits_bias is not zero: show that the export keeps it
        model.final_logits_bias.normal_(0, 0.1)
    model.save_pretrained(str(folder))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=FAMILIES + CAUSAL_FAMILIES)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    parameters = make(args.family, args.out)
    print(json.dumps({"family": args.family, "out": args.out, "parameters": parameters}))


if __name__ == "__main__":
    main()
