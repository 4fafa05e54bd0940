"""output_dir/config.json: what ran, on what, with which versions; enough to reproduce the run."""

import platform
import sys
from datetime import datetime, timezone

import torch
import transformers

from configs.cli import config_to_dict
from configs.fsdp import wraps_in_fsdp
from configs.run import RunConfig
from policies.mixed_precision import Precision
from utils.base.files import write_json
from utils.distributed.process_group import DistInfo
from utils.observe.flops import Throughput


def run_record(
    *,
    config: RunConfig,
    from_accelerate: dict,
    info: DistInfo,
    precision: Precision,
    throughput: Throughput,
    torchrun_job: str | None = None,
    unknown_tokens: dict | None = None,
) -> dict:
    """The resolved configs (CLI spelling: feeding them back as flags reproduces the run), the fields taken
    from `accelerate launch`'s environment ({field: variables}; {} without it), and the setting, with the peak
    FLOP/s per device that MFU divides by (null: none known), and per split how many tokens of the data are
    the tokenizer's unknown token (utils/data/cache.py: unknown_token_counts)."""
    return {
        **config_to_dict(config),  # one key per section: train_config, fsdp_config, data_config, ...
        "from_accelerate": from_accelerate,
        "world_size": info.world_size,
        "torchrun_job": torchrun_job,  # a torchrun restart of this job continues this run (checkpoint/start.py)
        "backend": info.backend,
        "device": str(info.device),
        # FSDP's policy, or autocast's dtype where FSDP does not wrap the model
        "mixed_precision_policy": (
            precision.name if wraps_in_fsdp(config.fsdp, info.world_size) else precision.unwrapped_name
        ),
        "tf32_matmuls": precision.tf32,  # --tf32 as it applied: on CUDA only
        "mfu_peak_tflops": throughput.peak_flops / 1e12 if throughput.peak_flops else None,
        "mfu_peak_source": throughput.peak_source,
        "unknown_tokens": unknown_tokens or {},
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "command": sys.argv,
    }


def write_run_record(path: str, record: dict, resumed_from: str | None) -> None:
    """Write config.json atomically, noting the checkpoint or .pt the run started from."""
    write_json(path, {**record, "resumed_from": resumed_from})
