"""A randomly initialised T5 folder with the shape of a published checkpoint, for offline benchmarks.

    python scripts/make_random_t5.py --shape t5-small --out /tmp/t5-small-random

The architecture (layers, widths, heads, vocabulary size) is the published model's, the weights are random,
and the tokenizer is the embedded tiny one (its 1,100 ids fit any T5 vocabulary). Good for measuring memory,
step and checkpoint times without network access; not for training anything useful.
"""

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer  # noqa: E402

from utils.paths import EMBEDDED_MODEL_DIR  # noqa: E402

# The published T5 v1.0 shapes (tied embeddings, ReLU feed-forward, vocabulary 32,128).
SHAPES = {
    "t5-small": dict(d_model=512, d_ff=2048, d_kv=64, num_heads=8, num_layers=6),
    "t5-base": dict(d_model=768, d_ff=3072, d_kv=64, num_heads=12, num_layers=12),
    "t5-large": dict(d_model=1024, d_ff=4096, d_kv=64, num_heads=16, num_layers=24),
    "t5-3b": dict(d_model=1024, d_ff=16384, d_kv=128, num_heads=32, num_layers=24),
}


def make(shape: str, out: str, seed: int = 0) -> int:
    """Write the folder; returns the parameter count."""
    config = T5Config(
        vocab_size=32128,
        feed_forward_proj="relu",
        tie_word_embeddings=True,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        **SHAPES[shape],
    )
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config)
    model.save_pretrained(out, safe_serialization=True)
    T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR).save_pretrained(out)
    shutil.copy(EMBEDDED_MODEL_DIR / "spiece.model", Path(out) / "spiece.model")
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", required=True, help="folder to write")
    args = parser.parse_args()
    print(f"{args.out}: {args.shape}-shaped, {make(args.shape, args.out) / 1e6:.1f}M parameters, random weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
