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
from transformers.utils import logging as hf_logging  # noqa: E402

from configs.paths import EMBEDDED_MODEL_DIR  # noqa: E402

# The published shapes, vocabulary 32,128. T5 v1.0: tied embeddings, ReLU feed-forward (the t5-11b the
# tutorial names included). T5 v1.1 and FLAN-T5 (the same shapes): gated-GELU feed-forward (two input
# matrices) and an lm_head of its own.
V1_0 = {"feed_forward_proj": "relu", "tie_word_embeddings": True}
V1_1 = {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}
V1_1_SIZES = {
    "small": dict(d_model=512, d_ff=1024, d_kv=64, num_heads=6, num_layers=8),
    "base": dict(d_model=768, d_ff=2048, d_kv=64, num_heads=12, num_layers=12),
    "large": dict(d_model=1024, d_ff=2816, d_kv=64, num_heads=16, num_layers=24),
    "xl": dict(d_model=2048, d_ff=5120, d_kv=64, num_heads=32, num_layers=24),
    "xxl": dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24),
}
SHAPES = {
    "t5-small": dict(d_model=512, d_ff=2048, d_kv=64, num_heads=8, num_layers=6, **V1_0),
    "t5-base": dict(d_model=768, d_ff=3072, d_kv=64, num_heads=12, num_layers=12, **V1_0),
    "t5-large": dict(d_model=1024, d_ff=4096, d_kv=64, num_heads=16, num_layers=24, **V1_0),
    "t5-3b": dict(d_model=1024, d_ff=16384, d_kv=128, num_heads=32, num_layers=24, **V1_0),
    "t5-11b": dict(d_model=1024, d_ff=65536, d_kv=128, num_heads=128, num_layers=24, **V1_0),
    **{f"t5-v1_1-{size}": {**dims, **V1_1} for size, dims in V1_1_SIZES.items()},
    **{f"flan-t5-{size}": {**dims, **V1_1} for size, dims in V1_1_SIZES.items()},
}


def untie_head(model: T5ForConditionalGeneration) -> None:
    """Give the model an lm_head of its own, as v1.1 / FLAN-T5 checkpoints have. transformers 5.23 ties
    every T5 at construction (docs/pitfalls.md #32); a checkpoint holding both weights loads untied."""
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight) * model.config.d_model**-0.5)


def make(shape: str, out: str, seed: int = 0) -> int:
    """Write the folder; returns the parameter count."""
    hf_logging.disable_progress_bar()  # the benchmarks call this: a bar is noise in their logs (for the process)
    config = T5Config(
        vocab_size=32128,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        **SHAPES[shape],
    )
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config)
    if not SHAPES[shape]["tie_word_embeddings"]:
        untie_head(model)
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
