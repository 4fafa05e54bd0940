"""What the run records besides the console: the step log, TensorBoard, and MFU's peak (utils/observe/)."""

from dataclasses import dataclass

from configs.options import option


@dataclass
class ObserveConfig:
    tensorboard: bool = option(
        default=False,
        help=(
            "Also write every metrics.jsonl record (losses, LR, grad norm, tokens/s, MFU, ROUGE, memory) as "
            "TensorBoard scalars into output_dir/tensorboard (needs: pip install tensorboard)."
        ),
    )
    log_every_n_steps: int = option(
        default=10,
        help=(
            "Per-step losses are kept on the device and written to metrics.jsonl every N steps: "
            "one all-reduce and one host sync per N steps instead of per step."
        ),
        minimum=1,
    )
    peak_tflops: float = option(
        default=0.0,
        help=(
            "Dense peak TFLOP/s of one device in the compute dtype, the denominator of MFU. 0: from the table "
            "of known GPUs (H100/H200 SXM bf16 989.4, A100 312, ...; unknown GPUs: no MFU), and on CPU a "
            "GEMM measured at start in the same dtype and thread count (a stand-in: CPUs have no usable "
            "data-sheet peak)."
        ),
        minimum=0.0,
    )
