"""What to train on and for how long. Every field is a `--field value` flag (see configs/cli.py).

The defaults are the offline demo: the embedded tiny T5 and WikiHow-format sample in data/, which train on
a laptop CPU. For the tutorial's real setting use `--model_name t5-base --data_dir data` (README).
"""

from dataclasses import dataclass
from typing import Literal

from configs.options import option
from utils.paths import EMBEDDED_DATA_DIR, EMBEDDED_MODEL_DIR


@dataclass
class TrainConfig:
    model_name: str = option(
        default=str(EMBEDDED_MODEL_DIR),
        help=(
            "Hub name (t5-small, t5-base, t5-large, t5-3b, t5-11b) or local folder for "
            "T5ForConditionalGeneration/T5Tokenizer.from_pretrained. Default: the embedded tiny T5."
        ),
    )
    data_dir: str = option(
        default=str(EMBEDDED_DATA_DIR),
        help=(
            "Folder with wikihowAll.csv and all_train.txt/all_val.txt/all_test.txt. "
            "Default: the embedded sample; the real data goes in data/ (scripts/download_wikihow.py)."
        ),
    )
    output_dir: str = option(
        default="outputs",
        help=(
            "Where config.json, metrics.jsonl, checkpoints/, hf_model/ and the --save_model .pt files are "
            "written (README: What a run leaves)."
        ),
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
            "before failing (torch's default is 30 minutes)."
        ),
        minimum=1,
    )
    epochs: int = option(default=2, help="Number of passes over the training samples.", minimum=1)
    batch_size_training: int = option(default=4, help="Training batch size per rank.", minimum=1)
    val_batch_size: int = option(default=4, help="Validation batch size per rank.", minimum=1)
    gradient_accumulation_steps: int = option(
        default=1,
        help=(
            "Micro-batches per optimizer step. The loss optimised and reported is the token mean over all of "
            "them on all ranks; the effective batch is batch_size_training x K x ranks."
        ),
        minimum=1,
    )
    accumulate_grad_sync: bool = option(
        default=True,
        help=(
            "With gradient_accumulation_steps > 1: reduce gradients after every micro-batch (true: "
            "memory stays one gradient shard) or only after the last (false: FSDP1 no_sync / FSDP2 "
            "set_requires_gradient_sync(False); less communication, but every rank keeps unsharded "
            "gradients of the whole model between micro-batches)."
        ),
    )
    max_grad_norm: float = option(
        default=0.0,
        help=(
            "Clip the global gradient norm (over all shards) to this value before each optimizer step; 0 = "
            "no clipping. The pre-clip norm is recorded in every step record either way."
        ),
        minimum=0,
    )
    on_nonfinite: Literal["stop", "skip"] = option(
        default="stop",
        help=(
            "A step whose loss or gradient norm is NaN or infinite on any rank. stop: the run ends with an "
            "error at the next step-log flush (at most log_every_n_steps steps later, before any checkpoint "
            "or export), keeping what was saved. skip: every rank skips each optimizer step whose global "
            "gradient norm is NaN/Inf (a NaN loss makes it NaN; fused AdamW with a found-inf flag: no host "
            "sync), and the step record says skipped. fp16's gradient scaler skips such steps itself."
        ),
    )
    lr_scheduler: Literal["step", "constant", "linear", "cosine"] = option(
        default="step",
        help=(
            "step: the tutorial's StepLR, lr x gamma after each epoch. constant, linear (to 0) and cosine "
            "(to 0): stepped after every optimizer step over the run's optimizer steps, after warmup."
        ),
    )
    warmup_steps: int = option(
        default=0,
        help="Optimizer steps of linear warmup from 0 to lr (constant/linear/cosine schedules).",
        minimum=0,
    )
    warmup_ratio: float = option(
        default=0.0,
        help="Warmup as a fraction of the run's optimizer steps, when warmup_steps is 0.",
        minimum=0,
        maximum=1,
    )
    max_steps: int = option(
        default=0,
        help=(
            "Stop after this many optimizer steps, whatever epochs says, validating, evaluating, saving and "
            "exporting as at a normal end; 0 = run all epochs."
        ),
        minimum=0,
    )
    attn_implementation: Literal["sdpa", "eager", "flex_attention"] = option(
        default="sdpa",
        help=(
            "T5's attention kernel (transformers' attn_implementation): sdpa (torch's "
            "scaled_dot_product_attention with the position bias as an additive mask; what transformers 5.15+ "
            "picks by default), eager (matmul, softmax, matmul: the reference), flex_attention (torch "
            "FlexAttention). T5's learned position bias rules out flash attention."
        ),
    )
    dropout_rate: float | None = option(
        default=None,
        help=(
            "Override the model config's dropout rate (0 turns dropout off, for exact comparisons); NONE keeps "
            "the model's (0.1 for T5)."
        ),
        minimum=0,
        maximum=1,
    )
    early_stopping_patience: int = option(
        default=0,
        help=(
            "Stop after this many epochs without a new best --metric_for_best (the run then ends as usual: "
            "checkpoint and export); 0 = never. Counted from the best epoch, so it survives --resume."
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
            "AdamW decoupled weight decay of the matrices; the layer norms never decay (0 = none, as in the "
            "tutorial). With FSDP1 it needs --use_orig_params true (per-parameter optimizer groups)."
        ),
        minimum=0,
    )
    gamma: float = option(
        default=0.85,
        help="StepLR factor: the learning rate is multiplied by gamma after each epoch.",
        above=0,
    )
    seed: int = option(default=1, help="Seed for weights of a fresh model, dropout and shuffling.")
    num_train_samples: int = option(
        default=1500,
        help="Use the first N training articles (tutorial: 1500); 0 = all.",
        minimum=0,
    )
    num_val_samples: int = option(
        default=300,
        help="Use the first N validation articles (tutorial: 300); 0 = all.",
        minimum=0,
    )
    max_source_length: int = option(default=512, help="Article tokens kept (truncation).", minimum=2)
    max_target_length: int = option(default=150, help="Summary tokens kept (truncation).", minimum=2)
    source_prefix: str = option(
        default="",
        help=(
            "Text put before every article. The tutorial uses none; pretrained T5 checkpoints were "
            "trained with 'summarize: '."
        ),
    )
    pad_to_max_length: bool = option(
        default=False,
        help=(
            "true: pad every sample to the max lengths, as the tutorial does (fixed shapes, predictable "
            "memory). false: pad each batch to its longest sample (much faster on short texts)."
        ),
    )
    group_by_length: bool = option(
        default=False,
        help=(
            "Order each epoch so that a step's batches hold articles of similar length (shuffled, then sorted "
            "by length within groups of 256 x batch_size_training samples): less padding with "
            "pad_to_max_length false. The order stays a function of seed and epoch, the same on every rank "
            "and exactly resumable, also on another number of ranks."
        ),
    )
    num_workers_dataloader: int = option(
        default=0,
        help=(
            "DataLoader worker processes per rank (tutorial: 2 on GPU). 0 tokenizes in the training "
            "process, which is best on a CPU with few cores."
        ),
        minimum=0,
    )
    peft: Literal["none", "lora"] = option(
        default="none",
        help=(
            "lora: train LoRA adapters (PEFT's get_peft_model) on the frozen model; only the adapters get "
            "gradients and AdamW state. Under FSDP1 each adapter is a unit of its own. Needs: pip install peft."
        ),
    )
    lora_r: int = option(default=8, help="With --peft lora: the adapters' rank.", minimum=1)
    lora_alpha: int = option(
        default=32, help="With --peft lora: the scale numerator (the update is alpha/r x BA).", minimum=1
    )
    lora_dropout: float = option(
        default=0.1, help="With --peft lora: dropout on the adapters' input.", minimum=0, maximum=1
    )
    lora_target_modules: str = option(
        default="q,v",
        help="With --peft lora: comma-separated names of the linear layers that get adapters (T5: q,k,v,o,wi,wo).",
    )
    merge_lora: bool = option(
        default=False,
        help=(
            "With --peft lora: besides the adapter (hf_adapter/), export hf_model/ with the adapters merged "
            "into the weights, loadable without PEFT."
        ),
    )
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
    run_validation: bool = option(default=True, help="Compute the validation loss after each epoch.")
    eval_rouge: bool = option(
        default=True,
        help=(
            "After each epoch (and every eval_every_n_steps), generate summaries of the first "
            "eval_num_samples validation articles on every rank and score them with rouge-score: an eval "
            "record in metrics.jsonl and output_dir/predictions/validation_step_<N>.jsonl."
        ),
    )
    eval_num_samples: int = option(
        default=300,
        help="Validation articles (the first N, each scored once) that ROUGE evaluates; 0 = the whole split.",
        minimum=0,
    )
    eval_every_n_steps: int = option(
        default=0,
        help=(
            "Also evaluate every N optimizer steps inside an epoch: the validation loss (with run_validation; "
            "a validation record) and ROUGE (with eval_rouge; an eval record). 0: at epoch ends only."
        ),
        minimum=0,
    )
    num_beams: int = option(
        default=1,
        help="Beams of the summaries' beam search; 1 = greedy decoding (fastest, deterministic).",
        minimum=1,
    )
    max_new_tokens: int = option(
        default=0,
        help="Longest summary generated, in tokens; 0 = max_target_length (what the model was trained on).",
        minimum=0,
    )
    length_penalty: float = option(
        default=1.0,
        help=(
            "Beam search only: exponent on the length in the beam score; > 1 favours longer summaries, "
            "< 1 shorter (transformers' default 1.0)."
        ),
    )
    no_repeat_ngram_size: int = option(
        default=0,
        help="Forbid repeating any n-gram of this size in a summary (0 = off; 3 curbs loops of small models).",
        minimum=0,
    )
    metric_for_best: Literal["val_loss", "rouge1", "rouge2", "rougeL", "rougeLsum"] = option(
        default="val_loss",
        help=(
            "Which epoch is the best: lowest val_loss, or highest ROUGE score. The best epoch's model is "
            "hf_model/ (and the --save_model .pt); kept across --resume."
        ),
    )
    evaluate_only: bool = option(
        default=False,
        help=(
            "Score a saved model without training: --model_name (a hub name or a folder such as "
            "OUTPUT_DIR/hf_model), or the checkpoint or .pt of --resume, on --eval_split, under FSDP on every "
            "rank. Writes the eval record and the predictions file into output_dir."
        ),
    )
    eval_split: Literal["validation", "test"] = option(
        default="validation",
        help="The split --evaluate_only scores (training runs always evaluate the validation split).",
    )
    save_model: bool = option(
        default=False,
        help=(
            "Save the full model state dict (.pt, gathered on rank 0) at each new best validation loss, "
            "or every epoch when run_validation is false."
        ),
    )
    save_every_n_steps: int = option(
        default=0,
        help=(
            "Also write a resumable checkpoint every N optimizer steps (0: only at the end of each epoch). "
            "Format: --checkpoint_type. Needs --keep_last_n >= 1."
        ),
        minimum=0,
    )
    keep_last_n: int = option(
        default=2,
        help=(
            "Resumable checkpoints kept in output_dir/checkpoints; older ones are deleted once a newer one "
            "is complete. 0 writes none."
        ),
        minimum=0,
    )
    resume: str = option(
        default="false",
        help=(
            "true: continue from the newest complete checkpoint in output_dir (start afresh if there is "
            "none); a checkpoint folder: continue from it; a full-model .pt: start from its weights; "
            "false: a new run (refused if output_dir already holds one)."
        ),
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
    track_memory: bool = option(
        default=True,
        help=("Record each rank's peak memory per epoch: CUDA allocated/reserved on GPU, peak RSS on CPU."),
    )
    print_text: bool = option(default=False, help="Log every source text as it is tokenized (debug).")
