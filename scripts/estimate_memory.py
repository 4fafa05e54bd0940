"""Per-rank memory of an FSDP T5 fine-tune, predicted from the model config alone (no weights needed).

    python scripts/estimate_memory.py --model t5-3b --nproc 8 --sharding_strategy FULL_SHARD \\
        --mixed_precision bf16 --activation_checkpointing true --batch_size 4 \\
        --max_source_length 512 --max_target_length 150

--model is a published shape (t5-small, t5-base, t5-large, t5-3b, t5-11b; t5-v1_1-* and flan-t5-* small to
xxl, gated GELU with an untied head) or a local folder with a config.json.

What is predicted, per rank:
- parameters: the fp32 shard FSDP keeps at rest: 4 bytes x P / S (S = ranks a parameter is sharded over;
  1 for NO_SHARD, the shard group for hybrid), padding to a multiple of S per unit included;
- gradients: the fp32 gradient shard after reduce-scatter, the same size;
- optimizer state: AdamW's two fp32 moments, 2 x the parameter shard;
- largest unsharded unit: the full parameters of the biggest FSDP unit in the compute dtype, all-gathered
  while it runs (SHARD_GRAD_OP keeps every unit's full parameters from forward to backward: the whole
  model in the compute dtype);
- activations: a rough estimate (+-50%) of what backward needs, with or without activation checkpointing,
  plus the fp32 logits of the loss.
The state figures (parameters, gradients, optimizer) are exact up to padding; they are checked against the
memory account that training writes to metrics.jsonl (tests/test_end_to_end.py).
"""

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.make_random_t5 import SHAPES  # noqa: E402

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class T5Shape:
    vocab_size: int
    d_model: int
    d_ff: int
    d_kv: int
    num_heads: int
    num_layers: int
    num_decoder_layers: int
    tie_word_embeddings: bool = True
    gated: bool = False  # T5 v1.1 / flan: gated-GELU feed-forward has two input matrices

    @classmethod
    def from_config(cls, config: dict) -> "T5Shape":
        return cls(
            vocab_size=config["vocab_size"],
            d_model=config["d_model"],
            d_ff=config["d_ff"],
            d_kv=config["d_kv"],
            num_heads=config["num_heads"],
            num_layers=config["num_layers"],
            num_decoder_layers=config.get("num_decoder_layers") or config["num_layers"],
            tie_word_embeddings=config.get("tie_word_embeddings", True),
            gated=config.get("feed_forward_proj", "relu").startswith("gated"),
        )

    def block_params(self, decoder: bool, first: bool) -> int:
        inner = self.num_heads * self.d_kv
        attention = 4 * self.d_model * inner
        feed_forward = (3 if self.gated else 2) * self.d_model * self.d_ff
        norms = (3 if decoder else 2) * self.d_model
        bias = 32 * self.num_heads if first else 0  # relative-position buckets, first block of each stack
        return attention * (2 if decoder else 1) + feed_forward + norms + bias

    def root_params(self) -> int:
        """What stays in the root unit: the shared embedding, final norms, and an untied lm_head."""
        embedding = self.vocab_size * self.d_model
        return embedding * (1 if self.tie_word_embeddings else 2) + 2 * self.d_model

    def unit_params(self) -> list[int]:
        encoder = [self.block_params(False, i == 0) for i in range(self.num_layers)]
        decoder = [self.block_params(True, i == 0) for i in range(self.num_decoder_layers)]
        return [self.root_params(), *encoder, *decoder]


def load_shape(model: str) -> T5Shape:
    if model in SHAPES:
        return T5Shape.from_config({"vocab_size": 32128, **SHAPES[model]})
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        raise SystemExit(
            f"error: {model!r} is neither a known shape ({', '.join(SHAPES)}) nor a folder with config.json"
        )
    return T5Shape.from_config(json.loads(config_file.read_text()))


def shard_degree(strategy: str, nproc: int, shard_group_size: int) -> int:
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return nproc
    if strategy == "NO_SHARD":
        return 1
    return shard_group_size or nproc


def activation_bytes(shape: T5Shape, batch: int, src: int, tgt: int, compute: int, checkpointing: bool) -> int:
    """Rough bytes of activations kept for backward (the Megatron-style per-layer count, adapted to T5)."""
    inner = shape.num_heads * shape.d_kv

    def layer(tokens: int, keys: int, cross_keys: int = 0) -> int:
        per_token = 10 * shape.d_model + 4 * inner + 2 * shape.d_ff  # inputs, norms, q/k/v/o, FF in/out
        scores = 2 * shape.num_heads * (keys + cross_keys)  # attention probabilities and dropout masks
        if cross_keys:
            per_token += 6 * shape.d_model + 4 * inner  # the cross-attention sub-layer
        return batch * tokens * (per_token + scores) * compute

    encoder_layer, decoder_layer = layer(src, src), layer(tgt, tgt, src)
    if checkpointing:  # each block keeps its input; one block's activations exist during recomputation
        kept = batch * (src * shape.num_layers + tgt * shape.num_decoder_layers) * shape.d_model * compute
        kept += max(encoder_layer, decoder_layer)
    else:
        kept = encoder_layer * shape.num_layers + decoder_layer * shape.num_decoder_layers
    logits = 2 * batch * tgt * shape.vocab_size * 4  # fp32 logits of the loss and their gradient
    return kept + logits


@dataclass
class Estimate:
    param_numel_total: int
    param_numel_local: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    largest_unsharded_unit_bytes: int
    activations_bytes: int
    total_bytes: int


def estimate(
    shape: T5Shape,
    *,
    nproc: int,
    sharding_strategy: str,
    mixed_precision: str,
    activation_checkpointing: bool,
    batch_size: int,
    max_source_length: int,
    max_target_length: int,
    shard_group_size: int = 0,
) -> Estimate:
    units = shape.unit_params()
    degree = shard_degree(sharding_strategy, nproc, shard_group_size)
    local = sum(math.ceil(n / degree) for n in units)  # each unit's flat parameter padded to the degree
    compute = COMPUTE_BYTES[mixed_precision]
    keep_all = sharding_strategy in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2") and degree > 1
    unsharded = (sum(units) if keep_all else max(units)) * compute if degree > 1 else 0
    parts = {
        "parameters_bytes": 4 * local,
        "gradients_bytes": 4 * local,
        "optimizer_bytes": 8 * local,
        "largest_unsharded_unit_bytes": unsharded,
        "activations_bytes": activation_bytes(
            shape, batch_size, max_source_length, max_target_length, compute, activation_checkpointing
        ),
    }
    return Estimate(
        param_numel_total=sum(units), param_numel_local=local, total_bytes=sum(parts.values()), **parts
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:9.3f} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help=f"{', '.join(SHAPES)} or a folder with config.json")
    parser.add_argument("--nproc", type=int, required=True, help="total number of ranks")
    parser.add_argument("--sharding_strategy", choices=STRATEGIES, default="FULL_SHARD")
    parser.add_argument("--hybrid_shard_group_size", type=int, default=0, help="hybrid: ranks per shard group")
    parser.add_argument("--mixed_precision", choices=sorted(COMPUTE_BYTES), default="bf16")
    parser.add_argument("--activation_checkpointing", choices=["true", "false"], default="true")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--max_source_length", type=int, default=512)
    parser.add_argument("--max_target_length", type=int, default=150)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    result = estimate(
        load_shape(args.model),
        nproc=args.nproc,
        sharding_strategy=args.sharding_strategy,
        mixed_precision=args.mixed_precision,
        activation_checkpointing=args.activation_checkpointing == "true",
        batch_size=args.batch_size,
        max_source_length=args.max_source_length,
        max_target_length=args.max_target_length,
        shard_group_size=args.hybrid_shard_group_size,
    )
    if args.json:
        print(json.dumps(asdict(result), indent=1))
        return 0
    print(
        f"{args.model}: {result.param_numel_total / 1e6:.1f}M parameters, {args.nproc} ranks, "
        f"{args.sharding_strategy}, {args.mixed_precision}, checkpointing {args.activation_checkpointing}"
    )
    for name, value in asdict(result).items():
        if name.endswith("_bytes"):
            print(f"  {name.removesuffix('_bytes').replace('_', ' '):<28}{_gib(value)} per rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
