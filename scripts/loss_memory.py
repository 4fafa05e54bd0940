"""What --loss_chunk_tokens saves: the memory of one training forward and backward of the loss, with the plain
loss (chunk 0, the control) and with each chunk size, on the same model, batch and seed.

    python scripts/loss_memory.py                       # a tiny Llama, 32,000 tokens of vocabulary, 2,048 tokens
    python scripts/loss_memory.py --family t5 --chunks 0 1024 --device cuda

The model is make_tiny_family's shape (width 64: the head's logits dominate, as they do at a large
vocabulary) with a 32k vocabulary: a Llama reading one row of --tokens tokens, or a T5 (the embedded one's
shape, tied head) writing 16 rows of --tokens / 16 target tokens from sources as long. Two measures, both a
function of the computation alone (no timing, no allocator caching):

- saved_for_backward: the bytes autograd keeps between the forward and backward (SavedTensorCounter);
- peak_allocated: the highest bytes allocated above the start during the forward and backward: on CPU the
  running sum of the allocations torch's profiler records, on CUDA torch.cuda.max_memory_allocated.

docs/throughput.md#chunked-cross-entropy records the figures.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration  # noqa: E402

from configs.paths import EMBEDDED_MODEL_DIR  # noqa: E402
from policies.private_api import profiled_allocations  # noqa: E402
from scripts.make_tiny_family import LLAMA_SHAPE  # noqa: E402
from utils.loss import chunk_the_loss  # noqa: E402
from utils.observe.memory import SavedTensorCounter  # noqa: E402
from utils.spec import CAUSAL, SEQ2SEQ  # noqa: E402

T5_ROWS = 16


def model_and_batch(family: str, vocab: int, tokens: int, device: torch.device):
    """The seeded model of `family` with `vocab` tokens, its spec, and a batch of `tokens` target tokens."""
    torch.manual_seed(0)
    ids = torch.randint(3, vocab, (1, tokens) if family == "llama" else (T5_ROWS, tokens // T5_ROWS))
    if family == "llama":
        config = LlamaConfig(**{**LLAMA_SHAPE, "max_position_embeddings": tokens}, vocab_size=vocab)
        model, spec = LlamaForCausalLM(config), CAUSAL
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    else:
        config = T5Config.from_pretrained(EMBEDDED_MODEL_DIR, vocab_size=vocab, dropout_rate=0.0)
        model, spec = T5ForConditionalGeneration(config), SEQ2SEQ
        mask = torch.ones_like(ids)
        batch = {"source_ids": ids, "source_mask": mask, "target_ids": ids.flip(1), "target_mask": mask}
    return model.to(device), spec, {key: value.to(device) for key, value in batch.items()}


def allocated_peak(prof: profile) -> int:
    """The highest running sum of the allocations (and frees) the profiler recorded, in bytes."""
    running = peak = 0
    for _, size in profiled_allocations(prof):
        running += size
        peak = max(peak, running)
    return peak


def measure(family: str, vocab: int, tokens: int, chunk: int, device: torch.device) -> dict:
    """One forward and backward of the loss of `chunk` (0: the plain loss): its memory and loss."""
    model, spec, batch = model_and_batch(family, vocab, tokens, device)
    if chunk:
        chunk_the_loss(model, chunk)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with SavedTensorCounter() as counter:
            losses, _ = spec.token_losses(model, batch)
        losses.sum().backward()
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with SavedTensorCounter() as counter:
                losses, _ = spec.token_losses(model, batch)
            losses.sum().backward()
        peak = allocated_peak(prof)
    return {
        "chunk": chunk, "saved_for_backward": counter.bytes, "peak_allocated": peak,
        "loss_sum": losses.sum().item(),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=["llama", "t5"], default="llama")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=2048, help="target tokens of the batch")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 1024], help="0: the plain loss")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = [measure(args.family, args.vocab, args.tokens, chunk, device) for chunk in args.chunks]
    logits = args.tokens * args.vocab * 4
    print(f"{args.family}, vocabulary {args.vocab}, {args.tokens} target tokens, {device.type}, torch "
          f"{torch.__version__}: the float32 logits are {logits / 2**20:.1f} MiB")  # fmt: skip
    print("| --loss_chunk_tokens | saved for backward (MiB) | peak allocated (MiB) | loss sum |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['chunk']} | {row['saved_for_backward'] / 2**20:.1f} | {row['peak_allocated'] / 2**20:.1f} "
              f"| {row['loss_sum']:.4f} |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
