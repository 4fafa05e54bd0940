"""Packed blocks through each attention kernel: are the documents kept apart, and how fast.

    python scripts/packing_kernels.py --shape tinyllama-1.1b --max_seq_len 2048 --batch_size 4 --steps 10

A randomly initialised Llama of --shape (no weights needed) reads the embedded chat sample (data/code_chat,
the Llama 2 guide's format) packed as `--packing true` packs it: whole documents into blocks of --max_seq_len
tokens, position ids restarting at each (causal_lm_dataset.py), with the tiny Llama tokenizer of
scripts/make_tiny_family.py. For each kernel of --kernels:
- exactness (fp32): the per-token losses of the batch of packed blocks against each document read alone by
  eager attention, as the maximum relative difference (a kernel that lets documents see each other is off by
  whole units);
- speed (--steps > 0): training steps (forward, backward, AdamW) on the same blocks, bf16 autocast on a GPU,
  as tokens per second (real tokens, not padding) and the peak memory. The control, `sdpa unpacked`: the
  documents one per row, padded to the longest of the batch, as a run without --packing reads them.
On a GPU, SDPA cannot use its flash kernel with the block mask packing needs; FlexAttention takes the
documents' boundaries from the position ids (docs/causal.md). On a CPU FlexAttention has no backward: its
exactness is measured with no gradients, its speed not at all. Prints a table; --out writes the JSON.

    python scripts/packing_kernels.py --strategies documents bfd --data wikihow --max_seq_len 512

--strategies compares packing strategies instead (--packing_strategy), on the rows of --data (the chat
sample's whole texts, or the embedded WikiHow sample's articles as prompts and headlines as completions): for
each, the blocks its packing makes of the same rows, their share of padding, the seconds the packing takes,
and the training tokens per second (real tokens, SDPA) of one epoch over every block in order, in batches of
--batch_size, each batch padded to its longest block as a run pads it (the fastest of --repeats epochs, the
strategies taking turns), with the tokens the model computed (padding included: the work, whatever the
machine's load) beside the real ones.
"""

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.make_tiny_family import LLAMA_SHAPE  # noqa: E402

# Published Llama shapes (their config.json fields) to time at a realistic width: TinyLlama-1.1B's (its
# positions, norm epsilon and rotary base are LlamaConfig's defaults).
SHAPES = {
    "tiny": LLAMA_SHAPE,
    "tinyllama-1.1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                       "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
                       "max_position_embeddings": 2048},
}  # fmt: skip
KERNELS = ("sdpa", "eager", "flex_attention")
LOOSE = 1e-4  # fp32 kernels agree to about 1e-6; a document seeing another is off by far more


STRATEGIES = ("documents", "bfd", "wrapped")
DATA = ("code_chat", "wikihow")  # the embedded chat sample's whole texts; the WikiHow sample's prompt/completion


def data_config(max_seq_len: int, cache_dir: str, strategy: str = "documents", data: str = "code_chat"):
    """The settings that read --data's train split packed by `strategy` into blocks of `max_seq_len`."""
    from configs.data import DataConfig
    from configs.paths import REPO_ROOT

    source = {"dataset_name": str(REPO_ROOT / "data" / "code_chat"), "dataset_text_field": "content"}
    return DataConfig(**(source if data == "code_chat" else {}), max_seq_len=max_seq_len, packing=True,
                      packing_strategy=strategy, cache_dir=cache_dir)  # fmt: skip


def packed_data(tokenizer, max_seq_len: int, cache_dir: str):
    """(the sample's documents packed into blocks, the same documents one per row) of the train split."""
    from causal_lm_dataset import CausalLMDataset, PackedCausalDataset

    data = data_config(max_seq_len, cache_dir)
    lengths = CausalLMDataset.lengths(data)
    return (PackedCausalDataset(tokenizer, "train", None, *lengths, data),
            CausalLMDataset(tokenizer, "train", None, *lengths, data))  # fmt: skip


def documents_alone(model, packed, plain, blocks: list[int], pad_id: int, device) -> list:
    """Per block, the per-token losses of its documents each read alone by `model` under eager attention, in
    the block's order (a document's first token is no target: 0 there)."""
    import torch

    from causal_lm_dataset import causal_collate
    from utils.data.loaders import move_batch
    from utils.spec import CAUSAL

    reference = copy.deepcopy(model).to(device)
    reference.config._attn_implementation = "eager"
    expected = []
    with torch.no_grad():
        for block in blocks:
            alone = []
            for document in packed.rows_of(block).tolist():
                single = move_batch(causal_collate([plain[document]], pad_id), device)
                losses, _ = CAUSAL.token_losses(reference, single)
                alone += [torch.zeros(1, device=device), losses[0]]
            expected.append(torch.cat(alone)[1:])
    return expected


def exactness(model, packed, blocks: list[int], expected: list, pad_id: int, device) -> float:
    """The largest relative difference between the packed batch's per-token losses under `model` and each
    document's alone (documents_alone)."""
    import torch

    from causal_lm_dataset import causal_collate
    from utils.data.loaders import move_batch
    from utils.spec import CAUSAL

    batch = move_batch(causal_collate([packed[b] for b in blocks], pad_id), device)
    with torch.no_grad():
        packed_losses, _ = CAUSAL.token_losses(model, batch)
    worst = 0.0
    for row, alone in enumerate(expected):
        got = packed_losses[row, : len(alone)]
        worst = max(worst, ((got - alone).abs() / alone.abs().clamp_min(1e-6)).max().item())
    return worst


def speed(model, items: list[dict], pad_id: int, steps: int, device) -> dict:
    """Tokens per second of `steps` training steps on the batch of `items` (after one warm-up step), and the
    peak memory on a GPU."""
    import torch

    from causal_lm_dataset import causal_collate
    from utils.data.loaders import move_batch
    from utils.spec import CAUSAL

    batch = move_batch(causal_collate(items, pad_id), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with autocast:
            losses, labels = CAUSAL.token_losses(model, batch)
        (losses.sum() / (labels != -100).sum()).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = int(batch["attention_mask"].sum()) * steps
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "peak_memory_bytes": peak,
            "batch_shape": list(batch["input_ids"].shape)}  # fmt: skip


def measure(shape: str, kernels: list[str], max_seq_len: int, batch_size: int, steps: int) -> dict:
    import torch

    with tempfile.TemporaryDirectory() as scratch:  # the tokenizer and the sample's token cache
        tokenizer = tiny_tokenizer(scratch)
        packed, plain = packed_data(tokenizer, max_seq_len, f"{scratch}/cache")
        return measure_kernels(tokenizer, packed, plain, shape, kernels, batch_size, steps, torch.device(
            "cuda" if torch.cuda.is_available() else "cpu"))  # fmt: skip


def tiny_tokenizer(scratch: str):
    """The tiny Llama tokenizer of scripts/make_tiny_family.py, made in `scratch`."""
    from scripts.make_tiny_family import make
    from utils.model.loading import load_tokenizer

    make("llama", f"{scratch}/tokenizer")
    return load_tokenizer(f"{scratch}/tokenizer")


def random_llama(tokenizer, shape: str, block_length: int):
    """A randomly initialised Llama of `shape` (seeded) with the tokenizer's vocabulary, fp32, on the host."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    # The shape's own vocabulary (the sample's ids, from the tiny tokenizer, are all below it)
    fields = {"vocab_size": len(tokenizer), **SHAPES[shape], "max_position_embeddings": max(block_length, 512)}
    config = LlamaConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, use_cache=False,
                         **fields)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def random_llama_folder(shape: str, out: str) -> int:
    """A model folder of a randomly initialised Llama of `shape` (seeded; the tiny Llama tokenizer, whose ids are
    below every shape's vocabulary), saved in bf16 (half the bytes to write and read; the package loads it in
    fp32), for scripts/benchmark.py --suite gpu_causal. Initialised on the GPU where there is one (a 1.1B model's
    random init takes seconds there, minutes on a few CPU cores). Returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from scripts.make_tiny_family import llama_tokenizer

    tokenizer = llama_tokenizer(Path(out))
    config = LlamaConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, use_cache=False,
                         **{"vocab_size": len(tokenizer), **SHAPES[shape]})  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def measure_kernels(tokenizer, packed, plain, shape, kernels, batch_size, steps, device) -> dict:
    """Each kernel's exactness and speed on the first `batch_size` packed blocks, and the unpacked control."""
    import torch

    pad_id = tokenizer.pad_token_id
    base = random_llama(tokenizer, shape, packed.block_length)  # kept in host memory: a copy per kernel
    blocks = list(range(min(batch_size, len(packed))))
    expected = documents_alone(base, packed, plain, blocks, pad_id, device)
    documents = packed.block_rows[: packed.block_starts[len(blocks)]].tolist()
    result = {"shape": shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "max_seq_len": packed.block_length, "blocks": len(blocks), "documents": len(documents),
              "packing": packed.packing_note(), "kernels": {}}  # fmt: skip
    for kernel in kernels:
        model = copy.deepcopy(base).to(device)
        model.config._attn_implementation = kernel
        entry = {"max_relative_difference": exactness(model, packed, blocks, expected, pad_id, device)}
        if steps and not (kernel == "flex_attention" and device.type == "cpu"):  # FlexAttention: no CPU backward
            entry.update(speed(model.train(), [packed[b] for b in blocks], pad_id, steps, device))
        result["kernels"][kernel] = entry
        del model  # one model on the device at a time: the peak memory is the kernel's own
    if steps:  # the control: no packing, the same documents one per row
        model = copy.deepcopy(base).to(device).train()
        result["kernels"]["sdpa unpacked"] = speed(model, [plain[d] for d in documents], pad_id, steps, device)
    return result


def measure_strategies(
    shape: str, strategies: list[str], data: str, max_seq_len: int, batch_size: int, rows: int, repeats: int
) -> dict:
    """Each strategy's blocks of the first `rows` rows (0: all) of --data's train split: their number, padding
    share and packing time, and the training tokens/s of an epoch over them, the fastest of `repeats` epochs
    (the strategies taking turns, so that a change in the machine's load falls on each alike)."""
    import torch

    from causal_lm_dataset import CausalLMDataset, PackedCausalDataset

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"shape": shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "data": data, "max_seq_len": max_seq_len, "batch_size": batch_size, "repeats": repeats,
              "strategies": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = tiny_tokenizer(scratch)
        settings = data_config(max_seq_len, f"{scratch}/cache", data=data)
        lengths = CausalLMDataset.lengths(settings)
        result["rows"] = len(CausalLMDataset(tokenizer, "train", rows or None, *lengths, settings))  # cached now
        packed = {}
        for strategy in strategies:
            start = time.perf_counter()
            packed[strategy] = PackedCausalDataset(tokenizer, "train", rows or None, *lengths, data_config(
                max_seq_len, f"{scratch}/cache", strategy, data))  # fmt: skip
            seconds = time.perf_counter() - start
            blocks = len(packed[strategy])
            result["strategies"][strategy] = {
                "blocks": blocks, "packing_seconds": seconds, "note": packed[strategy].packing_note(),
                # as packing_note counts it: the blocks' tokens that are no row's
                "padding_share": 1 - packed[strategy].packed_tokens / (blocks * max_seq_len),
            }  # fmt: skip
        base = random_llama(tokenizer, shape, max_seq_len)
        for _ in range(repeats):
            for strategy in strategies:
                model = copy.deepcopy(base).to(device).train()  # every epoch from the same weights
                speed = epoch_speed(model, packed[strategy], tokenizer.pad_token_id, batch_size, device)
                entry = result["strategies"][strategy]
                if speed["tokens_per_s"] > entry.get("tokens_per_s", 0):
                    entry.update(speed)
                del model
    return result


def epoch_speed(model, packed, pad_id: int, batch_size: int, device) -> dict:
    """Tokens per second (real ones) of training steps over every block of `packed` once, in order, in batches
    of `batch_size` (after one warm-up step on the first batch)."""
    import torch

    from causal_lm_dataset import causal_collate
    from utils.data.loaders import move_batch
    from utils.spec import CAUSAL

    batches = [causal_collate([packed[b] for b in range(start, min(start + batch_size, len(packed)))], pad_id)
               for start in range(0, len(packed), batch_size)]  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(batch: dict) -> None:
        with autocast:
            losses, labels = CAUSAL.token_losses(model, move_batch(batch, device))
        (losses.sum() / (labels != -100).sum()).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(batches[0])
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(int(batch["attention_mask"].sum()) for batch in batches)
    computed = sum(batch["input_ids"].numel() for batch in batches)  # padding included, as the model reads it
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "steps": len(batches),
            "computed_tokens": computed}  # fmt: skip


def strategies_table(result: dict) -> str:
    lines = [f"{result['shape']} on {result['device']}: {result['rows']} rows of {result['data']}, blocks of "
             f"{result['max_seq_len']} tokens, {result['batch_size']} blocks a step; tokens/s: the fastest of "
             f"{result['repeats']} epochs",
             "| strategy | blocks | padding | packing (s) | steps | tokens computed (real) | tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for strategy, entry in result["strategies"].items():
        computed = f"{entry['computed_tokens']:,} ({entry['tokens']:,})"
        cells = [strategy, str(entry["blocks"]), f"{entry['padding_share']:.1%}",
                 f"{entry['packing_seconds']:.3f}", str(entry["steps"]), computed,
                 f"{entry['tokens_per_s']:,.0f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(result: dict) -> str:
    lines = [f"{result['shape']} on {result['device']}: {result['blocks']} blocks of {result['max_seq_len']} "
             f"tokens holding {result['documents']} documents ({result['packing']})",
             "| kernel | max rel. diff vs alone | tokens/s | peak memory (GiB) |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for kernel, entry in result["kernels"].items():
        difference, peak = entry.get("max_relative_difference"), entry.get("peak_memory_bytes")
        cells = [kernel, "" if difference is None else f"{difference:.2e}",
                 f"{entry['tokens_per_s']:,.0f}" if "tokens_per_s" in entry else "(not timed)",
                 "" if peak is None else f"{peak / 2**30:.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=["sdpa", "flex_attention"])
    parser.add_argument("--max_seq_len", type=int, default=512, help="a packed block's tokens")
    parser.add_argument("--batch_size", type=int, default=4, help="packed blocks per step")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per kernel (0: exactness only)")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES,
                        help="compare these packing strategies instead of the kernels")  # fmt: skip
    parser.add_argument("--data", choices=DATA, default="code_chat", help="the rows --strategies packs")
    parser.add_argument("--rows", type=int, default=0, help="--strategies: the first N rows (0: all)")
    parser.add_argument("--repeats", type=int, default=2, help="--strategies: timed epochs of each, in turns")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.max_seq_len < 2 or args.batch_size < 1 or args.steps < 0 or args.rows < 0 or args.repeats < 1:
        parser.error("--max_seq_len needs at least 2 tokens, --batch_size a block, --steps and --rows 0 or more, "
                     "--repeats an epoch")  # fmt: skip
    if args.strategies:
        result = measure_strategies(args.shape, args.strategies, args.data, args.max_seq_len, args.batch_size,
                                    args.rows, args.repeats)  # fmt: skip
        print(strategies_table(result))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")
        return 0
    result = measure(args.shape, args.kernels, args.max_seq_len, args.batch_size, args.steps)
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")
    crossing = [
        k for k, entry in result["kernels"].items() if not entry.get("max_relative_difference", 0) <= LOOSE
    ]
    if crossing:
        print(f"error: {', '.join(crossing)} do not keep the documents apart (over {LOOSE:g} relative)")
    return 1 if crossing else 0


if __name__ == "__main__":
    sys.exit(main())
