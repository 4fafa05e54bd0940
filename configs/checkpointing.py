"""Resumable checkpoints (utils/checkpoint/): how often, how many are kept, and where a run starts from.

The tutorial's checkpoint_type and save_optimizer stay in fsdp_config (configs/fsdp.py), save_model in
train_config (configs/training.py).
"""

from dataclasses import dataclass

from configs.options import option


@dataclass
class CheckpointConfig:
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
            "is complete (set-aside ones, damaged or of an abandoned branch, never). 0 writes none."
        ),
        minimum=0,
    )
    async_checkpoint: bool = option(
        default=False,
        help=(
            "true: training continues while a SHARDED_STATE_DICT checkpoint is written; it stops only while "
            "the state is copied to host memory, and a writer writes it in the background (with FSDP2 a "
            "process per rank, started before the first step; with FSDP1 a thread). The checkpoint counts as "
            "complete once every rank's part is on disk; the next save, the export and the end of the run "
            "(a failed one too) wait for it; a stop's save (SIGTERM, Ctrl-C) is written at once. The write needs "
            "CPU of its own: where the ranks' threads take every core (CPU runs) it costs training more than a "
            "synchronous save, and the run says so. Needs --checkpoint_type SHARDED_STATE_DICT."
        ),
    )
    export_max_file_gb: float = option(
        default=5.0,
        help=(
            "hf_model/ (hf_model_last/, the merged LoRA model) is written from the shards, each rank its own "
            "part, in safetensors files of at most this many GB (a larger tensor gets a file of its own), with "
            "model.safetensors.index.json when there are several, as save_pretrained's max_shard_size does "
            "(also the default of convert_checkpoint_to_hf.py's --max_file_gb)."
        ),
        above=0,
    )
    resume: str = option(
        default="false",
        help=(
            "true: continue from the newest intact checkpoint in output_dir (a damaged one is set aside; start "
            "afresh if there is none); a checkpoint folder: continue from it (newer checkpoints of output_dir "
            "are set aside as an abandoned branch); either way the run's recorded settings are the defaults. "
            "A full-model .pt: a new run from its weights; false: a new run (both refused if output_dir "
            "already holds one)."
        ),
        on_resume="launch",
    )
    accept_changed_inputs: bool = option(
        default=False,
        help=(
            "A resume compares what it reads with what its checkpoint recorded the run trained on: the content "
            "of each data file, and the model folder's config and tokenizer files (with LoRA also its weights' "
            "sizes and safetensors headers); a changed one is refused, naming the file and what changed. true: "
            "continue on them deliberately, with one line saying what changed; the position (epoch, samples "
            "consumed, step) then counts in the new data's order, and later checkpoints record the new inputs."
        ),
        on_resume="launch",
    )
