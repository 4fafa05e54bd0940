"""The layout of an output_dir: every file and folder name is spelled here, and only here.

    output_dir/
      run.lock                            held by the run writing here (utils/checkpoint/run_lock.py)
      config.json                         the run record (utils/observe/run_record.py)
      metrics.jsonl                       one JSON record per line (utils/observe/metrics.py)
      checkpoints/step_00000123/          a resumable checkpoint (utils/checkpoint/manager.py):
        train_state.json                    progress, scheduler, scaler, format, the fingerprints of what the
                                              run read (utils/checkpoint/inputs.py), and every other file of
                                              the checkpoint with its size and CRC-32; written last
        optimizer_param_groups.json         the optimizer's hyper-parameters
        rng/rank_<r>.pt                     each rank's RNG state
        tokenizer/, config.json             what an HF export needs besides the weights
        model.pt, optimizer.pt              FULL_STATE_DICT: full state dicts gathered on rank 0
        .metadata, __<r>_0.distcp           SHARDED_STATE_DICT: torch.distributed.checkpoint shards
      checkpoints/.tmp_step_.../          a save in progress (ignored; removed when the next run starts)
        written/rank_<r>.json               what rank r's shard writer wrote (merged into train_state.json)
      checkpoints/damaged/step_..-<time>/ a checkpoint that failed its check on resume, set aside
      checkpoints/abandoned/after_step_..-<time>/step_.../
                                          the newer checkpoints of a branch a rollback abandoned, set aside
      hf_model/                           the best epoch's model (--metric_for_best): config, tokenizer, and
                                            model.safetensors, or model-00001-of-0000N.safetensors files and
                                            model.safetensors.index.json (--export_max_file_gb), as
                                            save_pretrained names them
      hf_model_last/                      the final model, when it is not the best
      predictions/<split>_step_<N>.jsonl  the summaries of each ROUGE evaluation (utils/eval/evaluator.py)
      tensorboard/                        --tensorboard true: the metrics as TensorBoard scalars
      profile/steps_<A>-<B>/              --profile_start_step: global steps A to B profiled (utils/observe/
                                            profiler.py), a TensorBoard run folder:
        rank_<r>.pt.trace.json.gz           each rank's torch.profiler trace
        rank_<r>.memory_snapshot.pickle     CUDA: each rank's allocations during those steps
      profile/out_of_memory_after_step_<N>/rank_<r>.memory_snapshot.pickle
                                          CUDA: the allocator's state when rank r ran out of memory
      trackers.json                       --wandb / --mlflow: the tracker runs a resume continues
      wandb/                              --wandb true: W&B's own files (its offline runs among them)
      T5-model-<run>-epoch<E>-val<L>.pt   --save_model: the tutorial's full state dict per best epoch
      evaluate_only/                      --evaluate_only: its eval records (metrics.jsonl) and predictions
                                            (<split>_step_<N>_<time>.jsonl), apart from training's
      hang_reports/                       a collective outlived --dist_timeout_s (utils/distributed/
                                            hang_report.py):
        rank_<r>_<time>.txt                 where rank r was: the error, step, phase, last collectives, stacks
        flight_recorder_rank_<r>            NCCL: torch's flight recorder dump on the timeout (torchfrtrace)

Also here: finding complete checkpoints. Nothing here deletes a set-aside checkpoint: they are the user's.
"""

import os
import re
from datetime import datetime

RUN_LOCK_FILE = "run.lock"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
HF_DIR = "hf_model"
HF_LAST_DIR = "hf_model_last"  # the final model, when an earlier epoch was the best
HF_ADAPTER_DIR = "hf_adapter"  # --peft lora: the adapter (hf_adapter, hf_adapter_last)
HF_ADAPTER_LAST_DIR = HF_ADAPTER_DIR + "_last"  # the final adapter, when an earlier epoch was the best
EXPORT_DIRS = (HF_DIR, HF_LAST_DIR, HF_ADAPTER_DIR, HF_ADAPTER_LAST_DIR)  # what a run's exports are named
ADAPTER_CONFIG_FILE = "adapter_config.json"  # PEFT's: what makes a folder an adapter, naming its base
# In an adapter folder: the run's summarization settings (a whole model keeps them in config.json)
ADAPTER_SUMMARIZATION_FILE = "summarization.json"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"  # which file holds which tensor, when there are several
STATE_FILE = "train_state.json"
PARAM_GROUPS_FILE = "optimizer_param_groups.json"
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
# SHARDED_STATE_DICT: the sections of the DCP payload (its tensors are named "model.<parameter>", ...)
MODEL_SECTION = "model"
OPTIMIZER_SECTION = "optim"
RNG_DIR = "rng"
WRITTEN_DIR = "written"  # inside a save in progress: each rank's record of the shards it wrote
TOKENIZER_DIR = "tokenizer"
PREDICTIONS_DIR = "predictions"
TENSORBOARD_DIR = "tensorboard"
PROFILE_DIR = "profile"
TRACKERS_FILE = "trackers.json"
EVALUATE_ONLY_DIR = "evaluate_only"
HANG_REPORTS_DIR = "hang_reports"
DAMAGED_DIR = "damaged"
ABANDONED_DIR = "abandoned"
BEST_MODEL_PREFIX = "T5-model"
TMP_PREFIX = ".tmp_"
STEP_DIR = re.compile(r"^step_(\d{8})$")

FULL = "FULL_STATE_DICT"
SHARDED = "SHARDED_STATE_DICT"
FORMAT_VERSION = 2  # 2: train_state.json lists every file with its size and CRC-32 (1: no list; still read)
READABLE_VERSIONS = (1, 2)


def time_stamp() -> str:
    """The local time as names here spell it (a --save_model file's run, a set-aside folder): 20261125-101500."""
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS_DIR)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rng_file(checkpoint: str, rank: int) -> str:
    return os.path.join(checkpoint, RNG_DIR, f"rank_{rank}.pt")


def hf_weights_file(index: int, count: int) -> str:
    """The name of an HF folder's weights file `index` (from 1) of `count`, as save_pretrained spells it."""
    return "model.safetensors" if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"


def tmp_checkpoint_dir(output_dir: str, step: int) -> str:
    """Where a checkpoint is assembled before its rename."""
    return os.path.join(checkpoint_root(output_dir), TMP_PREFIX + step_dir_name(step))


def purged_dir(checkpoint: str, number: int) -> str:
    """Where a checkpoint being deleted goes first (a temporary name: no longer a checkpoint); `number` keeps
    two deletions of one step's folder apart."""
    return os.path.join(os.path.dirname(checkpoint), f"{TMP_PREFIX}purge_{number}_{os.path.basename(checkpoint)}")


def written_file(checkpoint: str, rank: int) -> str:
    return os.path.join(checkpoint, WRITTEN_DIR, f"rank_{rank}.json")


def step_of(checkpoint: str) -> int | None:
    """The step of a checkpoint folder's name (None if it is not named step_<N>)."""
    match = STEP_DIR.match(os.path.basename(os.path.normpath(checkpoint)))
    return int(match.group(1)) if match else None


def damaged_dir(output_dir: str, checkpoint: str, stamp: str) -> str:
    """Where a checkpoint that failed its check is set aside."""
    name = f"{os.path.basename(os.path.normpath(checkpoint))}-{stamp}"
    return os.path.join(checkpoint_root(output_dir), DAMAGED_DIR, name)


def abandoned_dir(output_dir: str, branch_point: int, stamp: str) -> str:
    """Where the newer checkpoints of the branch a rollback to step `branch_point` left are set aside."""
    return os.path.join(checkpoint_root(output_dir), ABANDONED_DIR, f"after_{step_dir_name(branch_point)}-{stamp}")


def predictions_file(output_dir: str, split: str, step: int) -> str:
    return os.path.join(output_dir, PREDICTIONS_DIR, f"{split}_step_{step:08d}.jsonl")


def evaluate_only_predictions_file(output_dir: str, split: str, step: int, stamp: str) -> str:
    """--evaluate_only's predictions: named apart from training's, and per evaluation."""
    return os.path.join(output_dir, EVALUATE_ONLY_DIR, f"{split}_step_{step:08d}_{stamp}.jsonl")


def profile_dir(output_dir: str, first_step: int, last_step: int) -> str:
    """Where the profile of global steps first_step to last_step goes: a run folder for TensorBoard's profiler
    plugin (`tensorboard --logdir output_dir/profile`), which names each trace's worker by its file name."""
    return os.path.join(output_dir, PROFILE_DIR, f"steps_{first_step}-{last_step}")


def trace_file(folder: str, rank: int) -> str:
    """A rank's torch.profiler trace: Chrome trace JSON, gzipped (TensorBoard and Perfetto read it as is)."""
    return os.path.join(folder, f"rank_{rank}.pt.trace.json.gz")


def memory_snapshot_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank_{rank}.memory_snapshot.pickle")


def out_of_memory_dir(output_dir: str, steps_done: int) -> str:
    """Where the ranks that ran out of memory after `steps_done` optimizer steps write the allocator's state."""
    return os.path.join(output_dir, PROFILE_DIR, f"out_of_memory_after_step_{steps_done}")


def hang_report_file(output_dir: str, rank: int, stamp: str) -> str:
    """Where rank `rank` says where it was when a collective timed out (`stamp`: when; each hang its own)."""
    return os.path.join(output_dir, HANG_REPORTS_DIR, f"rank_{rank}_{stamp}.txt")


def flight_recorder_prefix(output_dir: str) -> str:
    """The file name prefix of NCCL's flight recorder dumps (torch appends the rank), absolute: torch's own C++
    code writes them, from whatever the working directory is then."""
    return os.path.join(os.path.abspath(output_dir), HANG_REPORTS_DIR, "flight_recorder_rank_")


def best_model_filename(run_id: str, epoch: int, val_loss: float | None) -> str:
    """Unique per run and epoch, so saves never overwrite each other or an earlier run's."""
    loss_part = f"-val{val_loss:.4f}" if val_loss is not None else ""
    return f"{BEST_MODEL_PREFIX}-{run_id}-epoch{epoch}{loss_part}.pt"


def complete_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints under output_dir, oldest first (temporary folders of unfinished saves, and set-aside
    checkpoints, ignored)."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(root, name, STATE_FILE)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return [path for _, path in sorted(found)]


def stale_temporaries(output_dir: str) -> list[str]:
    """The temporary folders of saves that never completed (a crash, a kill)."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, name) for name in os.listdir(root) if name.startswith(TMP_PREFIX))
