"""Rank 0's host memory while a run exports hf_model/ (written from the shards, against the gather it
replaced), and each checkpoint type's bytes and resume load time.

    python scripts/export_memory.py --model t5-base --nproc 2

`scripts/benchmark.py --suite checkpoint` runs these measurements and tabulates them beside the saves'.

Every measurement is a fresh group of --nproc gloo ranks that loads a random-weight model of the published
shape (scripts/make_random_t5.py) in fp32 and shards it with FSDP1 or FSDP2.

- Export memory: each rank resets its RSS high-water mark (Linux: `/proc/self/clear_refs`), runs the export
  and reports the high-water mark over the RSS just before it. The control is the export this package did
  before it wrote from the shards: gather the full state dict onto rank 0 (`Parallelism.full_state_dict`, which
  --save_model still uses), then `save_pretrained` from it on rank 0; for LoRA (adapter and merged model),
  it also rebuilt the PEFT model from the gathered dict to save and merge it.
- Checkpoints: AdamW state for every parameter (one step on zero gradients), one save of each type, its
  bytes on disk, then the time to load it as a resume does (FULL_STATE_DICT: model.pt into the unwrapped
  model, which resume does before sharding, then the optimizer; SHARDED_STATE_DICT: both through DCP).
"""

import argparse
import copy
import dataclasses
import gc
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import T5ForConditionalGeneration, T5Tokenizer  # noqa: E402

from configs.checkpointing import CheckpointConfig  # noqa: E402
from configs.fsdp import FSDPConfig  # noqa: E402
from configs.lora import LoraConfig  # noqa: E402
from policies.mixed_precision import Precision  # noqa: E402
from scripts.make_random_t5 import make  # noqa: E402
from tests.dist_harness import run_ranks  # noqa: E402
from utils.base import layout  # noqa: E402
from utils.base.files import disk_bytes  # noqa: E402
from utils.checkpoint.final_models import FinalModels  # noqa: E402
from utils.checkpoint.manager import CheckpointManager  # noqa: E402
from utils.checkpoint.progress import TrainProgress  # noqa: E402
from utils.checkpoint.start import StartPoint  # noqa: E402
from utils.distributed.process_group import DistInfo  # noqa: E402
from utils.fsdp.parallelism import parallelism_for  # noqa: E402
from utils.model.loading import load_full_model_weights  # noqa: E402
from utils.model.lora import apply_lora  # noqa: E402
from utils.spec import SEQ2SEQ  # noqa: E402

CPU = torch.device("cpu")
FP32 = Precision("fp32_policy")
MERGED_LORA = LoraConfig(peft="lora", merge_lora=True)
# (case name, FSDP version, how the export is written, LoRA)
EXPORT_CASES = [
    (f"FSDP{version}{', LoRA merged' if lora else ''}, {how}", version, how, lora)
    for lora in (False, True)
    for version in (1, 2)
    for how in ("gather (the previous export)", "from the shards")
]

RESUME_CASES = {f"FSDP{version}, resume": version for version in (1, 2)}
EXPORT_CASE_NAMES = [name for name, *_ in EXPORT_CASES] + list(RESUME_CASES)


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (VmRSS) or its high-water mark since the last reset (VmHWM)."""
    with open("/proc/self/status", encoding="utf-8") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)[1]) * 1024


def reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
        f.write("5")  # Linux: VmHWM := VmRSS


def sharded_setup(rank: int, world_size: int, model_dir: str, version: int, lora: bool):
    """The sharded model, its optimizer, its fp32 size, and a function making a CheckpointManager for it (for
    a checkpoint type and an output folder), as T5_training.fsdp_main builds them."""
    info = DistInfo(rank, rank, world_size, CPU, "gloo")
    tokenizer = T5Tokenizer.from_pretrained(model_dir)
    model = T5ForConditionalGeneration.from_pretrained(model_dir)
    model_config = model.config
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    lora_config = MERGED_LORA if lora else LoraConfig()
    if lora:
        torch.manual_seed(0)  # the same adapters on every rank
        model = apply_lora(model, lora_config, model_dir, SEQ2SEQ)
    fsdp = FSDPConfig(fsdp_version=version, mixed_precision=False, fsdp_activation_checkpointing=False)
    parallelism = parallelism_for(fsdp, dist.get_world_size())
    model = parallelism.wrap(model, precision=FP32, device=CPU)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)

    def manager(checkpoint_type: str, out: str) -> CheckpointManager:
        typed = dataclasses.replace(fsdp, checkpoint_type=checkpoint_type)
        checkpointing = CheckpointConfig(keep_last_n=1)
        return CheckpointManager(
            checkpointing=checkpointing,
            fsdp=typed,
            output_dir=out,
            model=model,
            parallelism=parallelism,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=None,
            model_config=model_config,
            tokenizer=tokenizer,
            info=info,
        )

    return model, optimizer, model_bytes, manager


def previous_export(model, manager: CheckpointManager, lora: bool, model_dir: str) -> None:
    """The export before it was written from the shards (this package until the change that added it): the
    full state dict gathered on rank 0, then save_pretrained there; with LoRA, a PEFT model built from it
    to write the adapter and merge."""
    state = manager.parallelism.full_state_dict(model, CPU)
    if not manager.info.is_main:
        return
    config = copy.deepcopy(manager.model_config)
    if lora:
        with torch.device("meta"):
            peft_model = apply_lora(T5ForConditionalGeneration(config), MERGED_LORA, model_dir, SEQ2SEQ)
        peft_model.to_empty(device="cpu")
        peft_model.load_state_dict(state, strict=True)
        peft_model.save_pretrained(os.path.join(manager.output_dir, layout.HF_ADAPTER_DIR))
        state = peft_model.merge_and_unload().state_dict()
    with torch.device("meta"):
        skeleton = T5ForConditionalGeneration(config)
    skeleton.save_pretrained(os.path.join(manager.output_dir, layout.HF_DIR), state_dict=state)
    manager.tokenizer.save_pretrained(os.path.join(manager.output_dir, layout.HF_DIR))


def export_worker(rank: int, world_size: int, model_dir: str, version: int, how: str, lora: bool, out: str):
    model, _, model_bytes, make_manager = sharded_setup(rank, world_size, model_dir, version, lora)
    manager = make_manager(layout.FULL, out)
    gc.collect()
    dist.barrier()
    before = rss_bytes()
    reset_high_water_mark()
    started = time.perf_counter()
    if how.startswith("gather"):
        previous_export(model, manager, lora, model_dir)
    else:
        lora_config = MERGED_LORA if lora else LoraConfig()
        FinalModels(manager, spec=SEQ2SEQ, lora=lora_config, base_model=model_dir).export_hf()
    dist.barrier()
    seconds = time.perf_counter() - started
    peak = rss_bytes("VmHWM") - before
    files = len(list(Path(out, layout.HF_DIR).glob("*.safetensors"))) if rank == 0 else 0
    return {"peak_above_bytes": peak, "seconds": seconds, "model_bytes": model_bytes, "files": files}


def checkpoint_worker(rank: int, world_size: int, model_dir: str, version: int, out: str) -> dict:
    model, optimizer, _, make_manager = sharded_setup(rank, world_size, model_dir, version, False)
    for parameter in model.parameters():  # AdamW's state for every parameter, as after a training step
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    results = {}
    for checkpoint_type in (layout.FULL, layout.SHARDED):
        manager = make_manager(checkpoint_type, f"{out}/{checkpoint_type}")
        started = time.perf_counter()
        folder = manager.save(TrainProgress(), blocking=True)
        save_seconds = time.perf_counter() - started
        full = checkpoint_type == layout.FULL
        unwrapped = T5ForConditionalGeneration.from_pretrained(model_dir) if full else None
        dist.barrier()
        started = time.perf_counter()
        if unwrapped is not None:  # resume loads model.pt before sharding, then the optimizer
            load_full_model_weights(unwrapped, os.path.join(folder, layout.MODEL_FILE))
        manager.load(StartPoint(folder, checkpoint_type))
        dist.barrier()
        results[checkpoint_type] = {
            "bytes": disk_bytes(folder),
            "save_s": save_seconds,
            "load_s": time.perf_counter() - started,
        }
    return results


def measure(model_dir: str, nproc: int, work: Path, cases: list[str] | None = None) -> list[dict]:
    """Every export case (or `cases`), then the checkpoint bytes and load times of each backend: rank 0's
    figures, the highest rank's peak, the slowest rank's seconds."""
    results = []
    for name, version, how, lora in EXPORT_CASES:
        if cases and name not in cases:
            continue
        out = tempfile.mkdtemp(dir=work)
        ranks = run_ranks(export_worker, model_dir, version, how, lora, out, world_size=nproc, timeout_s=1800)
        highest = max(rank["peak_above_bytes"] for rank in ranks)
        seconds = max(rank["seconds"] for rank in ranks)
        results.append({"case": name, **ranks[0], "seconds": seconds, "highest_peak_above_bytes": highest})
        shutil.rmtree(out)  # a model's size on disk per case
        print(f"{name} | rank 0 export peak {ranks[0]['peak_above_bytes'] / 2**20:.0f} MiB above", flush=True)
    for name, version in RESUME_CASES.items():
        if cases and name not in cases:
            continue
        out = tempfile.mkdtemp(dir=work)
        ranks = run_ranks(checkpoint_worker, model_dir, version, out, world_size=nproc, timeout_s=1800)
        for checkpoint_type, figures in ranks[0].items():
            slowest = {key: max(rank[checkpoint_type][key] for rank in ranks) for key in ("save_s", "load_s")}
            results.append({"case": f"FSDP{version}, {checkpoint_type}", **figures, **slowest})
            print(f"FSDP{version} {checkpoint_type} | loaded in {slowest['load_s']:.1f} s", flush=True)
        shutil.rmtree(out)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="t5-base", help="a published shape (scripts/make_random_t5.py)")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        folder = str(Path(work) / args.model)
        make(args.model, folder)
        print(json.dumps(measure(folder, args.nproc, Path(work)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
