"""The tutorial's train_config: what model to train, for how long, how, and where the run goes.

Every field of every section is a `--field value` flag (configs/cli.py). The defaults are the offline demo:
the embedded tiny T5 and WikiHow-format sample in data/, which train on a laptop CPU. For the tutorial's
real setting use `--model_name t5-base --data_dir data` (README). What this package adds beyond the
tutorial lives in sections of its own: data.py, recipe.py, evaluation.py, checkpointing.py, lora.py and
observability.py, side by side in run.py.
"""

from dataclasses import dataclass
from typing import Literal

from configs.options import option
from configs.paths import EMBEDDED_MODEL_DIR


@dataclass
class TrainConfig:
    model_name: str = option(
        default=str(EMBEDDED_MODEL_DIR),
        help=(
            "Hub name (t5-small ... t5-11b, google/flan-t5-base, google/mt5-base, facebook/bart-large-cnn, "
            "meta-llama/Llama-2-7b-hf) or local folder of an encoder-decoder (AutoModelForSeq2SeqLM) or a "
            "decoder-only model (AutoModelForCausalLM; docs/causal.md), with its AutoTokenizer. Default: the "
            "embedded tiny T5."
        ),
        on_resume="fixed",
        path="path_or_name",
    )
    output_dir: str = option(
        default="outputs",
        help=(
            "Where config.json, metrics.jsonl, checkpoints/, hf_model/ and the --save_model .pt files are "
            "written (docs/checkpoints.md: the output_dir layout)."
        ),
        on_resume="launch",
    )
    device: Literal["auto", "cuda", "cpu"] = option(
        default="auto",
        help=(
            "auto: one GPU per LOCAL_RANK with NCCL when CUDA is available, else CPU with gloo; "
            "cuda or cpu force the choice."
        ),
    )
    dist_timeout_s: int = option(
        default=600,
        help=(
            "Process-group timeout in seconds: how long a rank waits in a collective for a stuck peer "
            "before failing (torch's defaults: 10 minutes with NCCL, 30 with gloo); each rank that can then "
            "writes where it was into output_dir/hang_reports (docs/observability.md). Long work on some ranks "
            "(rank 0 writing a FULL checkpoint or reading the model alone, a resume's checkpoint check) is "
            "waited for as long as it progresses: a rank idle this long in it is named as stuck."
        ),
        minimum=1,
    )
    epochs: int = option(default=2, help="Number of passes over the training samples.", minimum=1)
    batch_size_training: int = option(default=4, help="Training batch size per rank.", minimum=1)
    val_batch_size: int = option(default=4, help="Validation batch size per rank.", minimum=1)
    num_workers_dataloader: int = option(
        default=0,
        help=(
            "DataLoader worker processes per rank (tutorial: 2 on GPU). 0 pads and batches the cached "
            "token ids in the training process, which is best on a CPU with few cores."
        ),
        minimum=0,
    )
    lr: float = option(
        default=0.002,
        help="Initial AdamW learning rate (tutorial: 0.002); StepLR multiplies it by gamma after each epoch.",
        above=0,
    )
    weight_decay: float = option(
        default=0.0,
        help=(
            "AdamW decoupled weight decay of the matrices; norms and biases never decay (0 = none, as in the "
            "tutorial). With FSDP1 it needs --use_orig_params true (per-parameter optimizer groups), which it "
            "turns on, as accelerate's default has it, unless given false."
        ),
        minimum=0,
        on_resume="fixed",
    )
    gamma: float = option(
        default=0.85,
        help="StepLR factor: the learning rate is multiplied by gamma after each epoch.",
        above=0,
    )
    seed: int = option(
        default=1, help="Seed for weights of a fresh model, dropout and shuffling.", on_resume="fixed"
    )
    run_validation: bool = option(
        default=True,
        help=(
            "The switch of all evaluation: the validation loss after each epoch, and the ROUGE evaluation "
            "inside it (--eval_rouge). false: nothing is evaluated (no validation loss, no ROUGE)."
        ),
    )
    save_model: bool = option(
        default=False,
        help=(
            "Save the full model state dict (.pt, gathered on rank 0) at each new best --metric_for_best "
            "(the validation loss by default), or every epoch when there is no metric (--run_validation false)."
        ),
    )
    track_memory: bool = option(
        default=True,
        help=("Record each rank's peak memory per epoch: CUDA allocated/reserved on GPU, peak RSS on CPU."),
    )
