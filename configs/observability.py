"""What the run records besides the console: the step log, TensorBoard, MFU's peak, and profiles
(utils/observe/)."""

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
    wandb: bool = option(
        default=False,
        help=(
            "Also log every metrics.jsonl record to Weights & Biases, and the run's settings (config.json) as its "
            "config; a resume continues the same W&B run (its id is kept in output_dir/trackers.json). W&B's "
            "own variables choose where: WANDB_MODE=offline keeps it in output_dir/wandb, WANDB_ENTITY, "
            "WANDB_API_KEY or `wandb login` (needs: pip install wandb)."
        ),
    )
    mlflow: bool = option(
        default=False,
        help=(
            "Also log every metrics.jsonl record to MLflow, and the run's settings (config.json) as its "
            "parameters; a resume continues the same MLflow run (its id is kept in output_dir/trackers.json). "
            "MLFLOW_TRACKING_URI chooses the store (a server, or sqlite:///mlflow.db; MLflow's default) "
            "(needs: pip install mlflow)."
        ),
    )
    tracker_project: str = option(
        default="t5-fsdp",
        help="--wandb's project and --mlflow's experiment: where the run's tracker run is filed.",
    )
    tracker_run_name: str = option(
        default="",
        help="The name of the tracker run (--wandb, --mlflow). Empty: output_dir's folder name.",
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
    profile_start_step: int = option(
        default=0,
        help=(
            "Profile --profile_num_steps optimizer steps from this global step on: each rank writes a "
            "torch.profiler trace, one ProfilerStep#<step> span per step, to output_dir/profile/"
            "steps_<first>-<last>/ (for TensorBoard or Perfetto: docs/observability.md), and on CUDA a memory "
            "snapshot of the steps' allocations. The step before is the profiler's warmup (dropped); profiled "
            "steps run slower. 0: no profile. Either way, an out-of-memory error during training on CUDA "
            "writes the allocator's state to output_dir/profile/."
        ),
        minimum=0,
    )
    profile_num_steps: int = option(
        default=3,
        help=(
            "How many optimizer steps --profile_start_step profiles. Each adds its operators to every rank's "
            "trace: 0.25 MB gzipped (4 MB of JSON) per step for the embedded tiny T5, more with more layers "
            "and, on CUDA, with the kernels."
        ),
        minimum=1,
    )
