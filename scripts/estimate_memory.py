"""Per-rank memory of an FSDP fine-tune, predicted from the model config alone (no weights needed).

    python scripts/estimate_memory.py --model t5-3b --nproc 8 --sharding_strategy FULL_SHARD \\
        --mixed_precision bf16 --activation_checkpointing true --batch_size 4 \\
        --max_source_length 512 --max_target_length 150
    python scripts/estimate_memory.py --model llama-2-70b --nproc 16 --batch_size 1 --max_seq_len 2048

--model is a published shape (t5-small, t5-base, t5-large, t5-3b, t5-11b; t5-v1_1-* and flan-t5-* small to
xxl, gated GELU with an untied head; llama-2-7b, llama-2-13b, llama-2-70b) or a local folder with a
config.json: of the T5 family, or of a decoder-only model (Llama, Mistral, Qwen, GPT-2, ...).

What is predicted, per rank:
- parameters: the fp32 shard FSDP keeps at rest: 4 bytes x P / S (S = ranks a parameter is sharded over;
  1 for NO_SHARD, the shard group for hybrid), padding to a multiple of S per unit included;
- gradients: the fp32 gradient shard after reduce-scatter, the same size;
- optimizer state: AdamW's two fp32 moments, 2 x the parameter shard;
- largest unsharded unit: the full parameters of the biggest FSDP unit in the compute dtype, all-gathered
  while it runs (SHARD_GRAD_OP keeps every unit's full parameters from forward to backward: the whole
  model in the compute dtype);
- activations: the bytes autograd keeps for backward after one micro-batch's forward, counted tensor by
  tensor from what T5's operations save (norms, attention, feed-forward, dropout masks, the fp32
  log-softmax of the loss; with activation checkpointing each block's input): equal to the memory
  account's measured saved_activation_bytes for eager attention and for sdpa's math kernel, which CPU
  runs use (tests/test_estimate_memory.py). CUDA's fused sdpa kernels keep no attention probabilities,
  so for them the figure is an upper bound;
- recompute: with activation checkpointing, the activations of the one block backward recomputes at a
  time, held on top of the kept ones while it runs.
A decoder-only model's units and activations are not counted by hand: its forward runs on fake tensors
(shapes and dtypes, no memory), rows of --max_seq_len tokens with no padding, and what autograd keeps is
counted as the memory account counts it, at any size in a second. That is exact for a CPU run, whatever
--device says; with dropout (GPT-2's default 0.1; Llama-style models have none) a GPU keeps its masks as bools
where a CPU keeps them in the compute dtype, so there the figure is an upper bound. A packed batch adds its
block mask (batch x sequence^2 bools).
It plans full fine-tuning: with --peft lora the gradients and AdamW state are the adapters' alone (about 2%
of these figures at r 8 on q,v) and the adapters' own activations are not counted.
The state figures (parameters, gradients, optimizer) are exact up to padding; they are checked against the
memory account that training writes to metrics.jsonl (tests/test_end_to_end.py).
"""

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

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

    def activation_bytes(self, w: "Workload") -> int:
        return activation_bytes(self, w)

    def recompute_bytes(self, w: "Workload") -> int:
        return recompute_bytes(self, w)


# Published decoder-only shapes (their config.json fields), for planning without the folder.
CAUSAL_SHAPES = {
    "llama-2-7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32},
    "llama-2-13b": {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                    "num_attention_heads": 40, "num_key_value_heads": 40},
    "llama-2-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8},
}  # fmt: skip


class CausalShape:
    """A decoder-only model's FSDP units and what its forward keeps, from its config: the model is built and
    run on fake tensors, so the figures are the model's own, whatever its family."""

    def __init__(self, config) -> None:
        self.config = config

    def _model(self, dtype, layers: int | None = None, dropout_rate: float | None = None):
        from transformers import AutoModelForCausalLM

        from utils.model.loading import family_overrides

        config = self.config.__class__.from_dict(self.config.to_dict())
        config.use_cache = False
        overrides = {} if dropout_rate is None else {"dropout_rate": dropout_rate}
        for name, value in family_overrides(config, overrides).items():  # --dropout_rate, as a run sets it
            setattr(config, name, value)
        if layers is not None:
            config.num_hidden_layers = layers
        return AutoModelForCausalLM.from_config(config, dtype=dtype)

    def unit_params(self) -> list[int]:
        """The root's parameters (embeddings, final norm, an untied head), then each decoder layer's."""
        import torch

        from policies.private_api import FakeTensorMode
        from policies.wrapping import layer_classes

        with FakeTensorMode():
            model = self._model(torch.float32)
            layer_types = tuple(layer_classes(model))
            layers = [
                sum(p.numel() for p in m.parameters()) for m in model.modules() if isinstance(m, layer_types)
            ]
            return [sum(p.numel() for p in model.parameters()) - sum(layers), *layers]

    def saved_bytes(self, w: "Workload", layers: int | None = None, checkpointing: bool | None = None) -> int:
        """What autograd keeps after one training forward of `w` (the model's layers, or `layers` of them)."""
        import torch
        from transformers import masking_utils

        from policies.activation_checkpointing_functions import apply_fsdp_checkpointing
        from policies.private_api import FakeTensorMode
        from policies.wrapping import layer_classes
        from utils.observe.memory import SavedTensorCounter
        from utils.spec import CAUSAL

        dtype = {4: torch.float32, 2: torch.bfloat16}[w.compute_bytes]  # fp16 keeps what bf16 does
        # transformers takes fake position ids for packed rows (it cannot read them) and builds a block mask:
        # these rows are whole, so there is none
        whole_rows = mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
        with FakeTensorMode(), whole_rows:
            model = self._model(dtype, layers, w.dropout_rate).train()
            model.config._attn_implementation = "sdpa" if w.sdpa else "eager"
            if w.checkpointing if checkpointing is None else checkpointing:
                apply_fsdp_checkpointing(model, layer_classes(model))
            ids = torch.zeros(w.batch, w.src, dtype=torch.long)
            with SavedTensorCounter() as counter:
                CAUSAL.token_losses(model, {"input_ids": ids, "attention_mask": None, "labels": ids})
        return counter.bytes

    def activation_bytes(self, w: "Workload") -> int:
        return self.saved_bytes(w)

    def recompute_bytes(self, w: "Workload") -> int:
        """One layer's activations (what backward recomputes at a time under checkpointing): what a second
        layer adds to a one-layer model's."""
        if not w.checkpointing:
            return 0
        return self.saved_bytes(w, layers=2, checkpointing=False) - self.saved_bytes(
            w, layers=1, checkpointing=False
        )


PLANNED_FAMILIES = ("t5", "mt5", "umt5")  # one block structure (UMT5 adds a small bias table per layer)


def load_shape(model: str) -> "T5Shape | CausalShape":
    if model in SHAPES:
        return T5Shape.from_config({"vocab_size": 32128, **SHAPES[model]})
    if model in CAUSAL_SHAPES:
        from transformers import LlamaConfig

        return CausalShape(LlamaConfig(vocab_size=32000, max_position_embeddings=4096, **CAUSAL_SHAPES[model]))
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        known = ", ".join([*SHAPES, *CAUSAL_SHAPES])
        raise SystemExit(f"error: {model!r} is neither a known shape ({known}) nor a folder with config.json")
    config = json.loads(config_file.read_text())
    if config.get("model_type", "t5") in PLANNED_FAMILIES:
        return T5Shape.from_config(config)
    from transformers import AutoConfig

    from configs.errors import ConfigError
    from utils.spec import CAUSAL, spec_for

    loaded = AutoConfig.from_pretrained(model)
    try:
        spec = spec_for(loaded, model)
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    if spec is not CAUSAL:
        raise SystemExit(
            f"error: {model!r} is a {config['model_type']} model; this planner knows the T5 family's layers "
            f"({', '.join(PLANNED_FAMILIES)}) and decoder-only models. Measure it instead: a short run (--epochs "
            "1 --num_train_samples 64) records each rank's peak memory in the epoch record of its metrics.jsonl."
        )
    return CausalShape(loaded)


def shard_degree(strategy: str, nproc: int, shard_group_size: int) -> int:
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return nproc
    if strategy == "NO_SHARD":
        return 1
    return shard_group_size or nproc


@dataclass(frozen=True)
class Workload:
    """What one micro-batch of training puts through the model, and the bytes of what it keeps."""

    batch: int
    src: int  # T5's source tokens; a decoder-only model's tokens per row
    tgt: int  # T5's target tokens; 0 for a decoder-only model
    compute_bytes: int  # the activations' dtype: 4 for fp32, 2 for bf16/fp16
    mask_bytes: int  # one dropout-mask element: the compute dtype on CPU, a bool on CUDA; 0 without dropout
    checkpointing: bool
    sdpa: bool = False  # torch's scaled_dot_product_attention (math kernel): boolean extended masks
    attention_bytes: int = 0  # q/k/v copies, scores, probabilities: the math kernel upcasts bf16 to fp32 on CPU
    dropout_rate: float | None = None  # --dropout_rate as given (None: the model's own; T5's masks: mask_bytes)

    @property
    def attention(self) -> int:
        return self.attention_bytes or self.compute_bytes

    @property
    def attention_mask(self) -> int:
        """The attention dropout's mask: in the attention dtype when the math kernel upcasts it."""
        return self.attention if self.mask_bytes and self.attention_bytes else self.mask_bytes


def _feed_forward_bytes(shape: T5Shape, w: Workload, tokens: int) -> int:
    """The d_ff-wide activations a feed-forward keeps. ReLU keeps its output, which is also the second
    matrix's input unless dropout sits between them (then the mask and the dropped copy are kept too). Gated
    tanh-GELU keeps 7 (both halves, the GELU's intermediates, the product); dropout adds only its mask,
    since the second matrix then keeps the dropped copy instead of the product."""
    if shape.gated:
        return tokens * shape.d_ff * (7 * w.compute_bytes + w.mask_bytes)
    dropped = w.compute_bytes + w.mask_bytes if w.mask_bytes else 0
    return tokens * shape.d_ff * (w.compute_bytes + dropped)


def encoder_layer_bytes(shape: T5Shape, w: Workload) -> int:
    """What one encoder block keeps for backward (counted from the tensors autograd saves, eager attention)."""
    c, tokens, scores = w.compute_bytes, w.batch * w.src, w.batch * shape.num_heads * w.src * w.src
    inner, norm_copy = shape.num_heads * shape.d_kv, 4 if w.compute_bytes != 4 else 0
    kept = c * tokens * 7 * shape.d_model + w.attention * (3 * tokens * inner + scores)
    kept += _feed_forward_bytes(shape, w, tokens)
    kept += 4 * 2 * tokens + norm_copy * 2 * tokens * shape.d_model  # 2 RMS norms: rsqrt, fp32 input copy
    if w.mask_bytes:  # each dropout keeps its mask, and its output where a matmul consumes it
        kept += w.mask_bytes * 2 * tokens * shape.d_model + (w.attention_mask + w.attention) * scores
    return kept


def decoder_layer_bytes(shape: T5Shape, w: Workload) -> int:
    """What one decoder block keeps: self- and cross-attention (whose k/v project the source) and the FF."""
    c, tokens, source = w.compute_bytes, w.batch * w.tgt, w.batch * w.src
    scores = w.batch * shape.num_heads * (w.tgt * w.tgt + w.tgt * w.src)
    inner, norm_copy = shape.num_heads * shape.d_kv, 4 if w.compute_bytes != 4 else 0
    kept = c * tokens * 11 * shape.d_model + w.attention * (4 * tokens * inner + 2 * source * inner + scores)
    kept += _feed_forward_bytes(shape, w, tokens)
    kept += 4 * 3 * tokens + norm_copy * 3 * tokens * shape.d_model  # 3 RMS norms
    if w.mask_bytes:
        kept += w.mask_bytes * 3 * tokens * shape.d_model + (w.attention_mask + w.attention) * scores
    return kept


def _outside_blocks_bytes(shape: T5Shape, w: Workload) -> int:
    """Embedding dropout and final norm of each stack, token ids and labels, and the fp32 log-softmax."""
    tokens = w.batch * (w.src + w.tgt)
    norm_copy = 4 if w.compute_bytes != 4 else 0
    kept = (3 * w.compute_bytes + norm_copy + 2 * w.mask_bytes) * tokens * shape.d_model + 4 * tokens
    kept += 8 * w.batch * (w.src + 2 * w.tgt)  # int64 source ids, decoder input ids, labels
    return kept + 4 * w.batch * w.tgt * shape.vocab_size


def _checkpointed_blocks_bytes(shape: T5Shape, w: Workload) -> int:
    """What checkpointed blocks keep: each block's input, one copy of the position bias the first block hands
    to the later ones, and the extended attention masks (one per stack)."""
    c, heads = w.compute_bytes, shape.num_heads
    encoder = shape.num_layers * w.batch * w.src * shape.d_model + min(shape.num_layers - 1, 1) * heads * w.src**2
    decoder_scores = w.tgt * w.tgt + w.tgt * w.src
    decoder = shape.num_decoder_layers * w.batch * w.tgt * shape.d_model
    decoder += min(shape.num_decoder_layers - 1, 1) * heads * decoder_scores
    if w.sdpa:  # boolean padding masks of the source and of the cross-attention; the causal one is implied
        return c * (encoder + decoder) + w.batch * (w.src * w.src + w.tgt * w.src)
    return c * (encoder + decoder + w.batch * (w.src * w.src + decoder_scores))


def activation_bytes(shape: T5Shape, w: Workload) -> int:
    """Bytes autograd keeps for backward after one micro-batch's forward: what the memory account's
    saved_activation_bytes measures: exact for eager attention and for sdpa's math kernel, which CPU runs
    use (tested); CUDA's fused sdpa kernels keep no probabilities, so there it is an upper bound."""
    if w.checkpointing:
        blocks = _checkpointed_blocks_bytes(shape, w)
    else:
        blocks = 8 * (w.src * w.src + w.tgt * w.tgt)  # int64 relative-position buckets, one set per stack
        if w.sdpa:  # boolean masks: the source padding mask and the decoder's causal mask
            blocks += w.batch * w.src * w.src + w.tgt * w.tgt
        blocks += shape.num_layers * encoder_layer_bytes(shape, w)
        blocks += shape.num_decoder_layers * decoder_layer_bytes(shape, w)
    return blocks + _outside_blocks_bytes(shape, w)


def recompute_bytes(shape: T5Shape, w: Workload) -> int:
    """With activation checkpointing, backward recomputes one block at a time and holds its activations
    while it runs: the largest block's, on top of what is kept. Without checkpointing nothing."""
    return max(encoder_layer_bytes(shape, w), decoder_layer_bytes(shape, w)) if w.checkpointing else 0


@dataclass
class Estimate:
    param_numel_total: int
    param_numel_local: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    largest_unsharded_unit_bytes: int
    activations_bytes: int
    recompute_bytes: int
    total_bytes: int


def estimate(
    shape: "T5Shape | CausalShape",
    *,
    nproc: int,
    sharding_strategy: str,
    mixed_precision: str,
    activation_checkpointing: bool,
    batch_size: int,
    max_source_length: int | None = None,
    max_target_length: int | None = None,
    max_seq_len: int | None = None,
    shard_group_size: int = 0,
    device: str = "cuda",
    attn_implementation: str = "sdpa",
    dropout_rate: float | None = None,
) -> Estimate:
    """The per-rank figures of `shape` (load_shape). A T5 model reads --max_source_length and writes
    --max_target_length tokens, with dropout_rate (None: T5's 0.1); a decoder-only model reads rows of
    max_seq_len tokens, with its config's dropout unless dropout_rate is given."""
    compute = COMPUTE_BYTES[mixed_precision]
    causal = isinstance(shape, CausalShape)
    lengths = {"max_seq_len": max_seq_len} if causal else {"max_source_length": max_source_length,
                                                           "max_target_length": max_target_length}  # fmt: skip
    missing = [name for name, value in lengths.items() if value is None]
    if missing:
        raise ValueError(f"{'a decoder-only' if causal else 'a T5'} model's plan needs {', '.join(missing)}")
    t5_dropout = 0.1 if dropout_rate is None else dropout_rate  # T5's own default
    work = Workload(
        batch=batch_size,
        src=max_seq_len if causal else max_source_length,
        tgt=0 if causal else max_target_length,
        compute_bytes=compute,
        mask_bytes=(compute if device == "cpu" else 1) if t5_dropout > 0 else 0,
        checkpointing=activation_checkpointing,
        sdpa=attn_implementation == "sdpa",
        # CPU's sdpa math kernel computes bf16/fp16 attention in fp32 (and keeps it so).
        attention_bytes=4 if device == "cpu" and attn_implementation == "sdpa" else 0,
        dropout_rate=dropout_rate,
    )
    units = shape.unit_params()
    degree = shard_degree(sharding_strategy, nproc, shard_group_size)
    local = sum(math.ceil(n / degree) for n in units)  # each unit's flat parameter padded to the degree
    keep_all = sharding_strategy in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2") and degree > 1
    unsharded = (sum(units) if keep_all else max(units)) * compute if degree > 1 else 0
    parts = {
        "parameters_bytes": 4 * local,
        "gradients_bytes": 4 * local,
        "optimizer_bytes": 8 * local,
        "largest_unsharded_unit_bytes": unsharded,
        "activations_bytes": shape.activation_bytes(work),
        "recompute_bytes": shape.recompute_bytes(work),
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
    parser.add_argument("--max_source_length", type=int, default=512, help="T5: the source's tokens")
    parser.add_argument("--max_target_length", type=int, default=150, help="T5: the target's tokens")
    parser.add_argument("--max_seq_len", type=int, default=1024, help="a decoder-only model: a row's tokens")
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="T5: CUDA keeps bool dropout masks (a decoder-only "
        "model's figure is a CPU's, an upper bound on CUDA)",
    )
    parser.add_argument("--attn_implementation", choices=["sdpa", "eager"], default="sdpa")
    parser.add_argument(
        "--dropout_rate",
        type=float,
        default=None,
        help="the run's (0: no dropout masks kept); default: T5's 0.1, a decoder-only model's own",
    )
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
        max_seq_len=args.max_seq_len,
        shard_group_size=args.hybrid_shard_group_size,
        device=args.device,
        attn_implementation=args.attn_implementation,
        dropout_rate=args.dropout_rate,
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
