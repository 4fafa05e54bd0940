"""The same training job without this package, for `scripts/benchmark.py --suite peers`.

    torchrun --nproc_per_node 2 scripts/peers.py --framework fsdp --model_name DIR --out result.json

Frameworks: `fsdp`, a bare torch FSDP1 loop with this package's wrap (each T5Block a unit, non-reentrant
activation checkpointing of the blocks); `ddp`, bare DistributedDataParallel with the same checkpointing;
`plain`, the unwrapped model with the same checkpointing (FSDP's overhead at world size 1); `hf_trainer`,
transformers' Seq2SeqTrainer (DDP under torchrun; it needs `accelerate`) with gradient checkpointing.
Every one trains with AdamW (lr 1e-3) on random token batches of a fixed shape (no padding: every position
is a real token), in fp32 or (`--precision bf16`, bare loops only) under bf16 autocast, and writes the
median step time after `--warmup` steps and each rank's peak memory (RSS on CPU, CUDA peak allocated on
GPU) to `--out` (rank 0).
"""

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import BackwardPrefetch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import T5ForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policies.activation_checkpointing_functions import apply_fsdp_checkpointing  # noqa: E402
from policies.wrapping import get_transformer_wrap_policy, layer_classes  # noqa: E402


def random_batches(args, count: int, rank: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1000 + rank)
    shape_src, shape_tgt = (args.batch_size, args.source_length), (args.batch_size, args.target_length)
    return [
        {
            "input_ids": torch.randint(2, 1000, shape_src, generator=gen),
            "attention_mask": torch.ones(shape_src, dtype=torch.long),
            "labels": torch.randint(2, 1000, shape_tgt, generator=gen),
        }
        for _ in range(count)
    ]


def device_for_rank() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dropout_override(args) -> dict:
    """The model-config override of --dropout_rate, as the package's own flag sets it (none: the model's)."""
    return {} if args.dropout_rate is None else {"dropout_rate": args.dropout_rate}


def bare_loop(args, device: torch.device) -> list[float]:
    """Step seconds of a plain loop over the wrapped model."""
    model = T5ForConditionalGeneration.from_pretrained(
        args.model_name, use_cache=False, **dropout_override(args)
    ).to(device)
    model.train()  # from_pretrained returns eval mode: without this, dropout (most of a CPU step) would be off
    layers = layer_classes(model)
    if args.framework == "fsdp":
        model = FSDP(
            model,
            auto_wrap_policy=get_transformer_wrap_policy(model),
            device_id=device,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            limit_all_gathers=True,
        )
        apply_fsdp_checkpointing(model, layers)
    else:
        apply_fsdp_checkpointing(model, layers)
        if args.framework == "ddp":
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    seconds = []
    for batch in random_batches(args, args.steps, dist.get_rank()):
        start = time.perf_counter()
        with autocast:
            loss = model(**{key: value.to(device) for key, value in batch.items()}).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds


def hf_trainer(args, device: torch.device) -> list[float]:
    """Step seconds of Seq2SeqTrainer, timed by a callback at each step's end."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times = [time.perf_counter()]

        def on_step_end(self, *_args, **_kwargs):
            synchronize(device)
            self.times.append(time.perf_counter())

    model = T5ForConditionalGeneration.from_pretrained(args.model_name, use_cache=False, **dropout_override(args))
    timer = StepTimes()
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = Seq2SeqTrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=args.batch_size,
            max_steps=args.steps,
            learning_rate=1e-3,
            optim="adamw_torch",
            lr_scheduler_type="constant",
            save_strategy="no",
            report_to=[],
            logging_strategy="no",
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            dataloader_num_workers=0,
            use_cpu=device.type == "cpu",
            disable_tqdm=True,
        )
        data = random_batches(args, args.steps, dist.get_rank())
        rows = [{key: value[i] for key, value in batch.items()} for batch in data for i in range(args.batch_size)]
        trainer = Seq2SeqTrainer(model=model, args=training_args, train_dataset=rows, callbacks=[timer])
        trainer.train()
    return [b - a for a, b in zip(timer.times, timer.times[1:], strict=False)]


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=["fsdp", "ddp", "plain", "hf_trainer"], required=True)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--model_name", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--source_length", type=int, default=256)
    parser.add_argument("--target_length", type=int, default=64)
    parser.add_argument("--dropout_rate", type=float, default=None, help="the model's dropout (default: its own)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = device_for_rank()
    if args.framework != "hf_trainer":  # the Trainer sets its process group up itself
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)
    seconds = hf_trainer(args, device) if args.framework == "hf_trainer" else bare_loop(args, device)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_memory_bytes(device))
    if dist.get_rank() == 0:
        result = {"step_seconds": statistics.median(seconds[args.warmup :]), "peak_memory_bytes": peaks}
        Path(args.out).write_text(json.dumps({"settings": vars(args), **result}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
