"""How the model is sharded. Every field is a `--field value` flag (see configs/cli.py).

The sharding strategy and backward prefetch are spelled as the names of torch's `ShardingStrategy` and
`BackwardPrefetch` members (utils/fsdp/shard.py turns them into those): the settings are read and checked
without importing torch, so that a refused setting answers in about a second.
"""

import os
from dataclasses import dataclass
from typing import Literal

from configs.errors import ConfigError
from configs.options import option

ShardingStrategyName = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
BackwardPrefetchName = Literal["BACKWARD_PRE", "BACKWARD_POST"]
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
# The stack layers of the encoder-decoder families tested here (docs/models.md), each an FSDP unit with the
# transformer policy. The units come from the model itself (policies/wrapping.py: layer_classes); this list
# is what accelerate's fsdp_transformer_layer_cls_to_wrap may name.
TESTED_LAYER_CLASSES = (
    "T5Block", "MT5Block", "UMT5Block", "BartEncoderLayer", "BartDecoderLayer", "PegasusEncoderLayer",
    "PegasusDecoderLayer", "LlamaDecoderLayer", "GPT2Block",
)  # fmt: skip


def hybrid_group_size(world_size: int, requested: int = 0) -> int:
    """Ranks per shard group for the hybrid strategies: `requested`, or (0) the ranks of one node."""
    size = requested or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % size:
        raise ConfigError(
            f"--hybrid_shard_group_size {size} does not divide the world size {world_size}; choose a divisor"
        )
    return size


def wraps_in_fsdp(fsdp: "FSDPConfig", world_size: int) -> bool:
    """Whether the model is wrapped in FSDP: on several ranks always, on one unless --single_rank_fsdp false."""
    return fsdp.single_rank_fsdp or world_size > 1


@dataclass
class FSDPConfig:
    fsdp_version: int = option(
        default=1,
        help=(
            "1: FullyShardedDataParallel, the tutorial's API (deprecated upstream). 2: fully_shard (FSDP2) on "
            "a DeviceMesh, the same settings mapped (docs/throughput.md: FSDP2); what has no FSDP2 meaning is "
            "refused."
        ),
        minimum=1,
        maximum=2,
    )
    single_rank_fsdp: bool = option(
        default=True,
        help=(
            "At world size 1 (one process): true wraps the model in FSDP as on many ranks (FSDP1 then runs "
            "NO_SHARD). false trains the model itself, without FSDP's per-unit hooks, casts and one-rank "
            "collectives, in mixed precision by torch.autocast (fp32 weights and optimizer): torchtitan's "
            "choice where nothing is sharded. Checkpoints, exports and LoRA are the same either way. No effect "
            "on several ranks. true by default until the GPU suite measures false (docs/throughput.md)."
        ),
    )
    mixed_precision: bool = option(
        default=True,
        help=(
            "true: bf16 (or fp16 with use_fp16) FSDP mixed precision where every rank's device has bf16 "
            "kernels (GPUs from Ampere on; CPUs for which oneDNN has them: AVX512 or AMX, ARM with bf16); "
            "elsewhere fp32, with one line saying why (see allow_emulated_bf16). false: fp32 everywhere "
            "(fp32_policy)."
        ),
    )
    allow_emulated_bf16: bool = option(
        default=False,
        help=(
            "With mixed_precision: bf16 also where the device only emulates it (a V100 or T4; an AVX2 CPU), "
            "which is slower than fp32 there (the demo took about 1.5 times fp32's time in bf16 on this "
            "project's AVX2 CPU). For checking bf16 numerics on such a machine."
        ),
    )
    use_fp16: bool = option(
        default=False,
        help=(
            "With mixed_precision: fp16 (fpSixteen) with a ShardedGradScaler instead of bf16. GPU only; "
            "T5 is known to overflow in fp16, bf16 is its precision."
        ),
    )
    tf32: bool = option(
        default=True,
        help=(
            "On CUDA: fp32 matrix multiplications on TF32 tensor cores (torch.set_float32_matmul_precision "
            "'high'): fp32's range with a 10-bit mantissa, about 8x IEEE fp32's peak on A100/H100 by NVIDIA's "
            "data sheets; it matters where the model computes in fp32 (mixed_precision false, "
            "bfSixteen_working). MFU is then rated against the TF32 peak. false: IEEE fp32 matmuls (torch's "
            "default). No effect on CPU. HF's --tf32 is this flag."
        ),
    )
    bf16_policy: Literal["bfSixteen", "bfSixteen_working"] = option(
        default="bfSixteen",
        help=(
            "bfSixteen: parameters and buffers in bf16, gradient reduction as --reduce_dtype says. "
            "bfSixteen_working: compute in fp32, reduce gradients and keep buffers in bf16 (halves gradient "
            "traffic only)."
        ),
    )
    reduce_dtype: Literal["auto", "bf16", "fp32"] = option(
        default="auto",
        help=(
            "Dtype of the gradient reduce-scatter under bf16. auto: fp32 with bfSixteen (policy "
            "bfSixteen_fp32_reduce, torchtitan's default: bf16 sums round away 8 bits per reduction; twice "
            "the gradient traffic of bf16), bf16 with bfSixteen_working (its purpose). bf16: the tutorial's "
            "all-bf16 bfSixteen. fp32 with bfSixteen_working is refused (that is fp32 training)."
        ),
    )
    sharding_strategy: ShardingStrategyName = option(
        default="FULL_SHARD",
        help=(
            "FULL_SHARD (ZeRO-3: params, grads, optimizer state sharded), SHARD_GRAD_OP (ZeRO-2: params "
            "kept whole between forward and backward), NO_SHARD (DDP-like), HYBRID_SHARD / "
            "_HYBRID_SHARD_ZERO2 (FULL_SHARD / SHARD_GRAD_OP within groups of hybrid_shard_group_size "
            "ranks, replicated across the groups)."
        ),
    )
    backward_prefetch: BackwardPrefetchName | None = option(
        default="BACKWARD_PRE",
        help=(
            "When the next unit's parameters are all-gathered in backward: BACKWARD_PRE (before the current "
            "unit's gradient computation: fastest, more memory), BACKWARD_POST (after it; FSDP1 only), NONE."
        ),
    )
    fsdp_activation_checkpointing: bool = option(
        default=True,
        help=(
            "Recompute each stack layer's activations (T5Block for T5) in backward instead of storing them "
            "(non-reentrant): much less activation memory for about 30% more compute."
        ),
    )
    activation_checkpointing_scope: Literal["blocks", "ops"] = option(
        default="blocks",
        help=(
            "What --fsdp_activation_checkpointing recomputes. blocks: each stack layer whole, keeping only its "
            "inputs. ops: each stack layer per op (torch's selective checkpointing): the outputs of its matmuls "
            "and attention kernels kept, the cheap ops between them recomputed (norms, activations, softmax, "
            "dropout from the forward's random state): less recompute, more memory than blocks (less than none "
            "when every layer trains: docs/memory.md). Needs --fsdp_activation_checkpointing true; not with "
            "--compile true, nor with FSDP1's units inside the layers (LoRA, size_based)."
        ),
    )
    compile: bool = option(
        default=False,
        help=(
            "torch.compile each stack layer (T5Block) before sharding (inductor: a C++ compiler on CPU, Triton "
            "on GPU). "
            "The first steps compile (seconds to minutes); dropout masks then come from inductor's own "
            "generator. FSDP1 needs --use_orig_params true. Off by default: slower on CPU (docs/throughput.md: "
            "Throughput)."
        ),
    )
    float8: bool = option(
        default=False,
        help=(
            "torchao's float8 training (pip install torchao): the Linear layers but the output head (and those "
            "whose dimensions are not multiples of 16) compute their matmuls in float8, scaled per tensor; "
            "weights, gradients and optimizer as before. Needs GPUs of compute capability 8.9 or newer (Ada, "
            "Hopper, Blackwell); FSDP2 then all-gathers the weights in float8. Faster only where the matmuls are "
            "large, and with --compile true, which fuses the casts (docs/throughput.md)."
        ),
    )
    limit_all_gathers: bool = option(
        default=True,
        help=(
            "Rate-limit all-gathers so at most two units' full parameters are in flight: bounds memory "
            "(GPU); turning it off can be faster when memory is plentiful. FSDP1 only: FSDP2 manages this "
            "itself and refuses false."
        ),
    )
    wrap_policy: Literal["transformer", "size_based"] = option(
        default="transformer",
        help=(
            "transformer: each layer of the encoder and decoder stacks (T5Block for T5, read from the model) is "
            "one FSDP unit, the shared embedding in the root unit (the tutorial's policy). size_based: a unit "
            "whenever min_num_params parameters accumulate (FSDP1 only; modules holding tied weights are never "
            "units of their own)."
        ),
    )
    min_num_params: int = option(
        default=1_000_000,
        help="Parameter threshold of the size_based wrap policy.",
        minimum=1,
    )
    checkpoint_type: Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT"] = option(
        default="FULL_STATE_DICT",
        help=(
            "Format of the resumable checkpoints in output_dir/checkpoints. FULL_STATE_DICT: the tutorial's "
            "full state dicts gathered on rank 0 (model.pt, optimizer.pt). SHARDED_STATE_DICT: "
            "torch.distributed.checkpoint, every rank writes its own shard in parallel (fast for 3B+, no "
            "rank-0 memory peak, loads on any number of ranks)."
        ),
    )
    save_optimizer: bool = option(
        default=True,
        help="Put the optimizer state in the checkpoints (needed to resume exactly; doubles their size or more).",
    )

    cpu_ram_efficient_loading: bool = option(
        default=False,
        help=(
            "Only rank 0 reads the pretrained weights (host memory: one model, not one per rank). FSDP2: "
            "the other ranks build the model on the meta device and receive rank 0's weights by broadcast "
            "after sharding. FSDP1: every rank builds on meta and each unit is filled from rank 0's reads "
            "as it is wrapped (safetensors or a full .pt). CPU and GPU."
        ),
    )
    hybrid_shard_group_size: int = option(
        default=0,
        help=(
            "HYBRID_SHARD/_HYBRID_SHARD_ZERO2: ranks per shard group (a replicate x shard device mesh); "
            "0 = the ranks of one node (LOCAL_WORLD_SIZE). Must divide the world size; 1 is refused with FSDP1 "
            "(use NO_SHARD, or FSDP2)."
        ),
        minimum=0,
    )
    fsdp_cpu_offload: bool = option(
        default=False,
        help=(
            "Keep parameters (and the optimizer step) in host memory, copying each unit to the GPU when it "
            "runs: fits bigger models on few GPUs at a large speed cost. GPU only (FSDP1 CPUOffload, FSDP2 "
            "CPUOffloadPolicy)."
        ),
    )
    forward_prefetch: bool = option(
        default=False,
        help=(
            "Issue the next unit's all-gather before the current unit's forward: overlaps communication in "
            "forward, for CPU-bound (small-batch) steps; costs one more unit's memory."
        ),
    )
    use_orig_params: bool = option(
        default=False,
        help=(
            "FSDP1: expose the original parameters instead of flat ones (needed for per-parameter optimizer "
            "groups, torch.compile, frozen parameters); FSDP2 always does. Not given, --weight_decay above 0 "
            "turns it on (accelerate's default fsdp_use_orig_params: true)."
        ),
    )
    sync_module_states: bool = option(
        default=False,
        help=(
            "FSDP1 on GPU: broadcast rank 0's parameters and buffers at wrap time, so ranks that built "
            "the model differently start equal. Refused on CPU (FSDP1 requires GPU tensors) and with FSDP2 "
            "(use --cpu_ram_efficient_loading)."
        ),
    )
