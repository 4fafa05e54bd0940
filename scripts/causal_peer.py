"""The decoder-only job of `scripts/benchmark.py --suite gpu_causal` without this package: HF's Trainer on the
same rows, for the suite's peers.

    python scripts/causal_peer.py --model_name DIR --data DIR --max_seq_len 2048 --blocks_per_step 8 \
        --steps 12 --warmup 4 --precision bf16 [--torch_compile] [--liger] --out result.json

transformers' `Trainer` at world size 1 (one process, no FSDP, no DDP), the model loaded in fp32 with
`attn_implementation="sdpa"` and trained under bf16 autocast (`bf16=True`: HF's mixed precision, fp32 weights
and AdamW state, as the package keeps them), fused AdamW, no gradient clipping and no weight decay (the
package's defaults), no gradient checkpointing unless `--gradient_checkpointing` (the fast choice where the
memory allows), `torch_compile=True` with `--torch_compile`, `use_liger_kernel=True` with `--liger` (it needs
the `liger_kernel` package).

The rows are the package's: the whole texts of `--data` (its `text` field) tokenised by the model folder's
tokenizer into the cache the package reads, packed by best-fit decreasing into blocks of `--max_seq_len` tokens
(causal_lm_dataset.py: PackedCausalDataset, --packing_strategy bfd), and taken in the order the package's
sampler deals them at its default seed (utils/data/samplers.py), `--blocks_per_step` blocks a step: each step
trains on the rows of the same blocks as the package's step, the same real tokens. Each block's rows are one
micro-batch, flattened by `DataCollatorWithFlattening` into one padding-free sequence whose position ids
restart at every row (transformers keeps each row to itself from them), and a step accumulates
`--blocks_per_step` of them (`gradient_accumulation_steps`; the blocks handed over as an iterable dataset, which
the Trainer reads in order): flattening a whole step into one sequence would
make SDPA's mask the square of the step's tokens, `--blocks_per_step` times the attention of block-sized ones.

Writes to `--out`: each step's seconds (a callback at its end, after a device sync), real tokens and model
FLOPs (utils/observe/flops.py's count of the micro-batches it read: per document, causal, as the package
counts its own steps), the sums over the steps after `--warmup`, the peak memory (CUDA peak allocated, else
peak RSS) and the graphs torch.compile made (dynamo's count, as the package's epoch record gives it).
"""

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from causal_lm_dataset import CausalLMDataset, PackedCausalDataset  # noqa: E402
from configs.data import DataConfig  # noqa: E402
from configs.training import TrainConfig  # noqa: E402
from policies.private_api import compiled_graphs  # noqa: E402
from scripts.peers import peak_memory_bytes  # noqa: E402
from utils.data.samplers import train_sampler_for  # noqa: E402
from utils.model.loading import load_tokenizer  # noqa: E402
from utils.observe.flops import CausalFlops  # noqa: E402

TEXT_FIELD = "text"  # the field scripts/benchmark.py writes the rows' texts in


def packed_rows(tokenizer, data_folder: str, max_seq_len: int) -> PackedCausalDataset:
    """The package's blocks of `data_folder`'s train split, as --packing true --packing_strategy bfd reads them."""
    data = DataConfig(dataset_name=data_folder, dataset_text_field=TEXT_FIELD, max_seq_len=max_seq_len,
                      packing=True, packing_strategy="bfd")  # fmt: skip
    return PackedCausalDataset(tokenizer, "train", None, *CausalLMDataset.lengths(data), data)


def blocks_in_package_order(packed: PackedCausalDataset, count: int) -> list[dict]:
    """The first `count` blocks the package trains on in its first epoch at world size 1 (its sampler, its default
    seed), each as the list of its rows ({input_ids, labels}, the labels as the package trains on them)."""
    sampler = train_sampler_for(packed, rank=0, world_size=1, seed=TrainConfig().seed)
    sampler.set_epoch(1)  # the package numbers its epochs from 1
    order = list(sampler)[:count]
    if len(order) < count:
        raise SystemExit(f"{len(packed)} blocks, fewer than the {count} that the steps need: give more rows")
    blocks = []
    for block in order:
        rows = []
        for row in packed.rows_of(block).tolist():
            input_ids, labels, _ = packed.sequence(row)
            rows.append({"input_ids": input_ids.tolist(), "labels": labels.tolist()})
        blocks.append({"rows": rows})
    return blocks


class InOrder(torch.utils.data.IterableDataset):
    """The blocks in the order given: the Trainer reads an iterable dataset as it comes, with no sampler to shuffle
    it (in every transformers 5 version, where train_sampling_strategy came late)."""

    def __init__(self, blocks: list[dict]):
        self.blocks = blocks

    def __iter__(self):
        return iter(self.blocks)


class FlattenedBlocks:
    """The collator: a micro-batch of blocks (one here) flattened by DataCollatorWithFlattening into one sequence,
    each micro-batch's real tokens and model FLOPs noted in the order they are read (the Trainer reads them in
    the order it trains on them)."""

    def __init__(self, flops: CausalFlops):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening(return_tensors="pt")
        self.flops = flops
        self.read: list[tuple[int, float]] = []

    def __call__(self, items: list[dict]) -> dict:
        batch = self.flatten([row for item in items for row in item["rows"]])
        counted = {"attention_mask": torch.ones_like(batch["input_ids"]), "position_ids": batch["position_ids"]}
        self.read.append((batch["input_ids"].numel(), self.flops.training(counted, recompute=False)[0].item()))
        return batch


def train(args, device: torch.device) -> dict:
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    class StepEnds(TrainerCallback):
        def __init__(self):
            self.times = [time.perf_counter()]

        def on_step_end(self, *_args, **_kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.times.append(time.perf_counter())

    tokenizer = load_tokenizer(args.model_name)
    packed = packed_rows(tokenizer, args.data, args.max_seq_len)
    blocks = blocks_in_package_order(packed, args.steps * args.blocks_per_step)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name, dtype=torch.float32, attn_implementation="sdpa", use_cache=False
    )
    collator = FlattenedBlocks(CausalFlops.from_config(model.config))
    timer = StepEnds()
    defaults = TrainConfig()
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=1,  # one block's rows, flattened
            gradient_accumulation_steps=args.blocks_per_step,
            max_steps=args.steps,
            learning_rate=defaults.lr,
            weight_decay=defaults.weight_decay,
            lr_scheduler_type="constant",
            optim="adamw_torch_fused",
            max_grad_norm=0.0,
            bf16=args.precision == "bf16",
            tf32=device.type == "cuda" or None,
            gradient_checkpointing=args.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            torch_compile=args.torch_compile,
            use_liger_kernel=args.liger,
            save_strategy="no",
            report_to=[],
            logging_strategy="no",
            remove_unused_columns=False,  # the items are blocks of rows, which the collator reads
            dataloader_num_workers=0,
            use_cpu=device.type == "cpu",
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=InOrder(blocks), data_collator=collator,
                          callbacks=[timer])  # fmt: skip
        trainer.train()
    seconds = [b - a for a, b in zip(timer.times, timer.times[1:], strict=False)]
    per_step = [collator.read[i : i + args.blocks_per_step] for i in range(0, len(seconds) * args.blocks_per_step,
                                                                       args.blocks_per_step)]  # fmt: skip
    tokens = [sum(n for n, _ in step) for step in per_step]
    flops = [sum(f for _, f in step) for step in per_step]
    rows = [len(block["rows"]) for block in blocks]
    return {
        "step_seconds": seconds,
        "step_tokens": tokens,
        "step_model_flops": flops,
        "timed": {
            "steps": len(seconds[args.warmup :]),
            "seconds": sum(seconds[args.warmup :]),
            "tokens": sum(tokens[args.warmup :]),
            "model_flops": sum(flops[args.warmup :]),
        },  # fmt: skip
        "rows": sum(rows),
        "row_tokens_mean": sum(tokens) / max(sum(rows), 1),
        "packing": packed.packing_note(),
        "peak_memory_bytes": [peak_memory_bytes(device)],
        "compiled_graphs": compiled_graphs(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_name", required=True, help="a decoder-only model folder with its tokenizer")
    parser.add_argument("--data", required=True, help="a folder of train.jsonl and validation.jsonl ('text')")
    parser.add_argument("--max_seq_len", type=int, default=2048, help="the blocks' tokens")
    parser.add_argument("--blocks_per_step", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the timed sums")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--torch_compile", action="store_true")
    parser.add_argument("--liger", action="store_true", help="use_liger_kernel=True (needs liger_kernel)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error("--warmup must leave steps to time: fewer than --steps")
    if args.liger and importlib.util.find_spec("liger_kernel") is None:
        parser.error("--liger needs the liger_kernel package (pip install liger-kernel)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = train(args, device)
    Path(args.out).write_text(json.dumps({"settings": vars(args), **result}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
