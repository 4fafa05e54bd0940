"""Step time and peak memory of training configurations, measured through torchrun; JSON + markdown table.

    python scripts/benchmark.py --suite backends --models embedded t5-small --nproc 2 --out bench/
    python scripts/benchmark.py --suite datapath --data wikihow_lengths --max_source_length 512 \
        --max_target_length 150 --out bench/datapath
    python scripts/benchmark.py --suite peers --models t5-small --data full_lengths \
        --max_source_length 256 --max_target_length 64 --out bench/peers
    python scripts/benchmark.py --suite lora --models t5-small --max_source_length 256 \
        --max_target_length 64 --out bench/lora
    python scripts/benchmark.py --suite loading --models t5-base --steps 4 --max_source_length 64 \
        --max_target_length 16 --out bench/loading
    python scripts/benchmark.py --suite data --ranks 2 8 --out bench/data [--repo OTHER_CHECKOUT]
    python scripts/benchmark.py --suite checkpoint --models t5-base --steps 12 --out bench/checkpoint
    python scripts/benchmark.py --suite gpu_causal --models tinyllama-1.1b --max_seq_len 2048 --batch_size 8 \
        --steps 12 --out bench/causal

Each case is one short run of T5_training.py (one epoch, no validation, no checkpoints) on the embedded
sample, or on a generated one (--data). Step time is the median of the logged step windows after the
first (warm-up) window; peak memory is each rank's peak from the epoch record (peak RSS on CPU, CUDA peak
allocated on GPU). Models other than `embedded` are random-weight folders of the published shapes, made by
scripts/make_random_t5.py. The peers suite also runs scripts/peers.py (bare FSDP1, bare DDP, HF
Seq2SeqTrainer) on the same shapes, and rates every row with the same FLOP count and peak.

The data suite measures the data path at the real file's size instead: it generates a WikiHow-format file
of wikihowAll.csv's size (214,544 rows, CRLF line ends inside quoted fields, log-normal lengths around the
published means; kept in --wikihow_dir for later invocations) and, for each --ranks, runs the embedded
model for 3 steps (fixed 512/150 shapes) on the embedded sample, then on the full-size file with a cold
cache and a warm one, then on its train and validation splits written as JSON-lines files of your own
(--train_file/--validation_file) with a cold and a warm cache: time to the first step, peak RSS per rank and
above the embedded sample's, and the CPU seconds of all ranks above the embedded sample's (parsing and
tokenising). --repo runs another checkout's T5_training.py on the same WikiHow file: the control.

The checkpoint suite adds scripts/export_memory.py's measurements for each model: rank 0's host memory while
hf_model/ is exported from the shards against the gather it replaced (plain and LoRA merged, per backend),
and each checkpoint type's bytes, save and resume load seconds.

The gpu_causal suite trains a decoder-only model (random weights of TinyLlama-1.1B's shape, or a tiny Llama) on
generated whole texts of chat-like lengths (chat_length_rows) packed into blocks of --max_seq_len tokens,
--batch_size blocks a step, and scripts/causal_peer.py (HF's Trainer) on the same rows; each row of its table
is the steps after the first CAUSAL_WARMUP_STEPS: real tokens per step and per second, MFU by the package's
per-document causal count, peak memory and the graphs torch.compile made (docs/throughput.md: "Decoder-only, on
one GPU").
"""

import argparse
import csv
import importlib.util
import json
import math
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.paths import EMBEDDED_DATA_DIR, EMBEDDED_MODEL_DIR, REPO_ROOT  # noqa: E402
from scripts.export_memory import EXPORT_CASE_NAMES  # noqa: E402
from scripts.export_memory import measure as measure_exports  # noqa: E402
from scripts.make_random_t5 import SHAPES, make  # noqa: E402
from scripts.packing_kernels import random_llama_folder  # noqa: E402
from utils.data.cache import load_wikihow  # noqa: E402
from utils.data.wikihow import clean_text  # noqa: E402

# The gpu_causal suite's levers, each case adding one to the one before (FSDP1 at world size 1 compiles with the
# original parameters).
FLEX = ["--attn_implementation", "flex_attention"]
COMPILED = [*FLEX, "--compile", "true", "--use_orig_params", "true"]
CHUNKED = [*COMPILED, "--loss_chunk_tokens", "8192"]
NO_CHECKPOINTING = [*CHUNKED, "--fsdp_activation_checkpointing", "false"]
# Every step its own record: the steps right after a save are the ones a background write overlaps.
CHECKPOINT_EVERY_3 = ["--checkpoint_type", "SHARDED_STATE_DICT", "--keep_last_n", "2", "--save_every_n_steps", "3",
                      "--log_every_n_steps", "1"]  # fmt: skip
SUITES = {
    "backends": {
        "FSDP1 FULL_SHARD": ["--fsdp_version", "1"],
        "FSDP2 FULL_SHARD": ["--fsdp_version", "2"],
    },
    # Gradient accumulation (4 micro-batches a step): peak memory with and without the reduction after
    # every micro-batch.
    "accumulation": {
        "sync each micro-batch": ["--gradient_accumulation_steps", "4", "--accumulate_grad_sync", "true"],
        "sync last micro-batch only": ["--gradient_accumulation_steps", "4", "--accumulate_grad_sync", "false"],
    },
    # What clipping adds to a step (the global norm itself is measured in both: it is in every step record).
    "clipping": {
        "no clipping": ["--max_grad_norm", "0"],
        "max_grad_norm 1.0": ["--max_grad_norm", "1.0"],
    },
    # The data path on a sample with WikiHow's lengths (--data wikihow_lengths): the tutorial's fixed
    # 512/150 padding against per-batch padding, and against length-grouped batches.
    "datapath": {
        "tutorial: fixed 512/150 padding": ["--pad_to_max_length", "true"],
        "default: per-batch padding": ["--pad_to_max_length", "false"],
        "per-batch padding + group_by_length": ["--pad_to_max_length", "false", "--group_by_length", "true"],
    },
    # This package against what users would pick instead (PEERS, run by scripts/peers.py): the same model,
    # batch, fixed lengths (--data full_lengths), fp32, steps.
    # --tf32 false: the peers compute fp32 matmuls in IEEE fp32 on a GPU (torch's default), so does the package.
    "peers": {
        "this package, FSDP1, defaults": ["--fsdp_version", "1", "--tf32", "false"],
        "this package, FSDP2, defaults": ["--fsdp_version", "2", "--tf32", "false"],
        "this package, FSDP1, tutorial settings": [
            "--fsdp_version",
            "1",
            "--pad_to_max_length",
            "true",
            "--tf32",
            "false",
        ],
    },
    # One GPU (run with --nproc 1): precision, backends, checkpointing and attention kernels, and the
    # unwrapped model (PEERS_OF_SUITE); CI runs it at tiny scale on CPU, where the GPU_ONLY cases are skipped.
    "gpu": {
        "bf16, FSDP1": ["--mixed_precision", "true"],
        "bf16, FSDP2": ["--mixed_precision", "true", "--fsdp_version", "2"],
        "bf16, no FSDP (one rank)": ["--mixed_precision", "true", "--single_rank_fsdp", "false"],
        "bf16, FSDP1, no activation checkpointing": [
            "--mixed_precision",
            "true",
            "--fsdp_activation_checkpointing",
            "false",
        ],
        "bf16, FSDP1, eager attention": ["--mixed_precision", "true", "--attn_implementation", "eager"],
        "fp32, FSDP1": ["--mixed_precision", "false"],
        "fp16 + scaler, FSDP1": ["--mixed_precision", "true", "--use_fp16", "true"],
        "bf16, FSDP1, CPU offload": ["--mixed_precision", "true", "--fsdp_cpu_offload", "true"],
        "bf16, FSDP2, compiled blocks": ["--mixed_precision", "true", "--fsdp_version", "2", "--compile", "true"],
        "bf16, FSDP1, t5_flex": ["--mixed_precision", "true", "--attn_implementation", "t5_flex"],
        "bf16, FSDP1, t5_flex, no activation checkpointing": [
            "--mixed_precision",
            "true",
            "--attn_implementation",
            "t5_flex",
            "--fsdp_activation_checkpointing",
            "false",
        ],
        "bf16, no FSDP (one rank), t5_flex, no activation checkpointing": [
            "--mixed_precision",
            "true",
            "--single_rank_fsdp",
            "false",
            "--attn_implementation",
            "t5_flex",
            "--fsdp_activation_checkpointing",
            "false",
        ],
        "bf16, FSDP2, compiled blocks, t5_flex": [
            "--mixed_precision",
            "true",
            "--fsdp_version",
            "2",
            "--compile",
            "true",
            "--attn_implementation",
            "t5_flex",
        ],
        # FlexAttention inside the compiled blocks (one graph with the blocks' matmuls), as FSDP1's units at
        # world size 1 and as the model itself (--single_rank_fsdp false).
        **{
            f"bf16, {form}, compiled blocks, t5_flex{checkpointing}": [
                "--mixed_precision",
                "true",
                *form_args,
                "--compile",
                "true",
                "--attn_implementation",
                "t5_flex",
                *checkpointing_args,
            ]
            for form, form_args in {
                "FSDP1": ["--use_orig_params", "true"],
                "no FSDP (one rank)": ["--single_rank_fsdp", "false"],
            }.items()
            for checkpointing, checkpointing_args in {
                "": [],
                ", no activation checkpointing": ["--fsdp_activation_checkpointing", "false"],
            }.items()
        },
    },
    # One GPU, a decoder-only model (--models tinyllama-1.1b; llama-tiny on CPU): packed blocks of whole texts
    # (--packing_strategy bfd, blocks padded to --max_seq_len: one shape to compile), bf16, each case one more
    # lever on the one before: the kernel, compiled blocks, the chunked loss, per-op checkpointing (uncompiled)
    # or none, the model itself without FSDP, float8. The peers (PEERS_OF_SUITE: HF's Trainer) train on the same
    # blocks.
    "gpu_causal": {
        name: ["--mixed_precision", "true", *levers]
        for name, levers in {
            "bf16, SDPA (dense document mask)": ["--attn_implementation", "sdpa"],
            "bf16, flex_attention": FLEX,
            "bf16, flex_attention, compiled": COMPILED,
            "bf16, flex_attention, compiled, chunked loss": CHUNKED,
            # not compiled: torch 2.13 compiles nothing inside a per-op checkpoint (configs/validate.py refuses it)
            "bf16, flex_attention, chunked loss, per-op checkpointing": [
                *FLEX,
                "--loss_chunk_tokens",
                "8192",
                "--activation_checkpointing_scope",
                "ops",
            ],
            "bf16, flex_attention, compiled, chunked loss, no checkpointing": NO_CHECKPOINTING,
            "bf16, flex_attention, compiled, chunked loss, no checkpointing, no FSDP": [
                *NO_CHECKPOINTING,
                "--single_rank_fsdp",
                "false",
            ],
            "bf16, flex_attention, compiled, chunked loss, no checkpointing, no FSDP, float8": [
                *NO_CHECKPOINTING,
                "--single_rank_fsdp",
                "false",
                "--float8",
                "true",
            ],
        }.items()
    },  # fmt: skip
    # Host memory of loading (the memory account's high-water mark from before the model is built until it
    # is sharded), with and without rank-0-only loading, per backend.
    "loading": {
        "FSDP1": ["--fsdp_version", "1", "--cpu_ram_efficient_loading", "false"],
        "FSDP1, rank-0-only loading": ["--fsdp_version", "1", "--cpu_ram_efficient_loading", "true"],
        "FSDP2": ["--fsdp_version", "2", "--cpu_ram_efficient_loading", "false"],
        "FSDP2, rank-0-only loading": ["--fsdp_version", "2", "--cpu_ram_efficient_loading", "true"],
    },
    # LoRA (--peft lora, q and v, r 8) against full fine-tuning: step time, peak memory, optimizer state.
    "lora": {
        "full fine-tuning, FSDP1": ["--fsdp_version", "1"],
        "LoRA, FSDP1 (adapters wrapped apart)": ["--fsdp_version", "1", "--peft", "lora"],
        "LoRA, FSDP1, use_orig_params": ["--fsdp_version", "1", "--peft", "lora", "--use_orig_params", "true"],
        "full fine-tuning, FSDP2": ["--fsdp_version", "2"],
        "LoRA, FSDP2": ["--fsdp_version", "2", "--peft", "lora"],
    },
    # The data path at the real file's size (run_data_suite): the tutorial's subset, and the whole train split.
    "data": {
        "tutorial subset (1,500 train, 16 validation)": ["--num_train_samples", "1500", "--num_val_samples", "16"],
        "whole train split": ["--num_train_samples", "0", "--num_val_samples", "16"],
    },
    # Checkpoints every 3 steps (SHARDED_STATE_DICT, with the optimizer), per backend: synchronous against
    # written in the background, and the same run without checkpoints (a step with no write running).
    "checkpoint": {
        f"FSDP{version}, {case}": ["--fsdp_version", str(version), *case_args]
        for version in (1, 2)
        for case, case_args in {
            "no checkpoints": ["--checkpoint_type", "SHARDED_STATE_DICT", "--log_every_n_steps", "1"],
            "FULL_STATE_DICT (the tutorial's)": [*CHECKPOINT_EVERY_3, "--checkpoint_type", "FULL_STATE_DICT"],
            "synchronous": CHECKPOINT_EVERY_3,
            "async": [*CHECKPOINT_EVERY_3, "--async_checkpoint", "true"],
        }.items()
    },
    "strategies": {
        "FULL_SHARD": ["--sharding_strategy", "FULL_SHARD"],
        "SHARD_GRAD_OP": ["--sharding_strategy", "SHARD_GRAD_OP"],
        "NO_SHARD": ["--sharding_strategy", "NO_SHARD"],
    },
}


# A case or peer with one of these flags (or values) runs on a GPU only: refused on a CPU (fp16, offload,
# FlexAttention's training, float8), minutes of C++ compilation there (compile), Triton kernels (Liger).
GPU_ONLY = {"--use_fp16", "--fsdp_cpu_offload", "--compile", "flex_attention", "--float8", "--torch_compile",
            "--liger"}  # fmt: skip
BARE_FSDP1 = "bare torch FSDP1 loop, same wrap"  # the peers suite's baseline, per model
LIGER = "--liger"  # the peer's flag for use_liger_kernel=True, which needs the liger_kernel package
PEERS_OF_SUITE = {
    "peers": {
        BARE_FSDP1: ["--framework", "fsdp"],
        "bare DDP": ["--framework", "ddp"],
        "HF Seq2SeqTrainer (DDP)": ["--framework", "hf_trainer"],
    },
    "gpu": {"unwrapped model, bf16 autocast": ["--framework", "plain", "--precision", "bf16"]},
    # scripts/causal_peer.py: HF's Trainer, one process, sdpa, each block's rows flattened (padding-free)
    "gpu_causal": {
        "HF Trainer, sdpa, flattened rows": [],
        "HF Trainer, sdpa, flattened rows, Liger kernels": [LIGER],
        "HF Trainer, sdpa, flattened rows, torch_compile": ["--torch_compile"],
    },
}
# The decoder-only models of --suite gpu_causal: random weights of scripts/packing_kernels.py's shapes, the tiny
# Llama tokenizer (scripts/make_tiny_family.py).
CAUSAL_MODELS = {"llama-tiny": "tiny", "tinyllama-1.1b": "tinyllama-1.1b"}
# How every gpu_causal case reads its rows (chat_length_rows): whole texts, packed by best-fit decreasing, each
# block padded to --max_seq_len (one shape for compiled blocks; bfd leaves little to pad).
CAUSAL_DATA = ["--dataset_text_field", "text", "--packing", "true", "--packing_strategy", "bfd",
               "--pad_to_max_length", "true"]  # fmt: skip
CAUSAL_WARMUP_STEPS = 4  # steps left out of the gpu_causal suite's rates: compiling, the allocator's first steps


STOP_GRACE_S = 60  # torchrun's own grace for its ranks after a SIGTERM is 30 s


def run_by_deadline(command: list[str], deadline: float | None) -> subprocess.CompletedProcess:
    """`command` (a torchrun) to its end, or until `deadline` (time.monotonic()): then it is stopped as
    `stop` says, and the case fails as over the time budget. A Ctrl-C stops it the same way."""
    with subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = stop(process)
            raise CaseFailed(stdout, stderr, reason="stopped: over the time budget (--time_budget_s)") from None
        except BaseException:  # Ctrl-C, which reached torchrun too: its ranks are not left holding the GPU
            stop(process)
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def stop(process: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM to torchrun, which closes its ranks (each in a session of its own, out of reach of a signal to
    its group: SIGTERM, then SIGKILL after its grace); SIGKILL to torchrun if it is still there after
    STOP_GRACE_S. Its output until then."""
    process.terminate()
    try:
        return process.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate(timeout=STOP_GRACE_S)


class CaseFailed(Exception):
    """A case's run ended with an error: its stdout (the package's log, with the ERROR line) and stderr, and
    why it was stopped where the benchmark stopped it."""

    def __init__(self, stdout: str, stderr: str, reason: str = ""):
        super().__init__(reason or stdout[-300:])
        self.stdout, self.stderr, self.reason = stdout, stderr, reason


def run_peer(model_dir: str, peer_args: list[str], args, work: Path) -> dict:
    """One scripts/peers.py run: step time and peak memory per rank."""
    out = work / f"peer{len(list(work.iterdir()))}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--standalone",
               str(REPO_ROOT / "scripts" / "peers.py"), *peer_args, "--model_name", model_dir,
               "--steps", str(args.steps), "--batch_size", str(args.batch_size),
               "--source_length", str(args.max_source_length), "--target_length", str(args.max_target_length),
               "--out", str(out)]  # fmt: skip
    if args.dropout_rate is not None:
        command += ["--dropout_rate", str(args.dropout_rate)]
    done = run_by_deadline(command, args.deadline)
    if done.returncode != 0:
        raise CaseFailed(done.stdout, done.stderr)
    result = json.loads(out.read_text())
    return {"step_seconds": result["step_seconds"], "peak_memory_bytes": result["peak_memory_bytes"]}


def run_causal_peer(model_dir: str, peer_args: list[str], args, work: Path) -> dict:
    """One scripts/causal_peer.py run (one process) on the suite's rows: its timed steps, peak memory, compiles."""
    out = work / f"peer{len(list(work.iterdir()))}.json"
    command = [sys.executable, str(REPO_ROOT / "scripts" / "causal_peer.py"), *peer_args,
               "--model_name", model_dir, "--data", args.causal_data, "--max_seq_len", str(args.max_seq_len),
               "--blocks_per_step", str(args.batch_size), "--steps", str(args.steps),
               "--warmup", str(CAUSAL_WARMUP_STEPS), "--precision", args.peer_precision,
               "--out", str(out)]  # fmt: skip
    done = run_by_deadline(command, args.deadline)
    if done.returncode != 0:
        raise CaseFailed(done.stdout, done.stderr)
    result = json.loads(out.read_text())
    return {
        "step_seconds": statistics.median(result["step_seconds"][CAUSAL_WARMUP_STEPS:]),
        "step_tokens": result["step_tokens"],
        **{key: result[key] for key in ("timed", "peak_memory_bytes", "compiled_graphs", "packing")},
    }


def fixed_shape_rates(result: dict, model_dir: str, args, peak_tflops: float | None) -> dict:
    """Tokens/s and MFU of a fixed-shape step (every position a real token), the same count for every row; no
    MFU without a peak."""
    from transformers import AutoConfig

    from utils.spec import spec_for

    batch = {
        "source_mask": torch.ones(args.batch_size, args.max_source_length),
        "target_mask": torch.ones(args.batch_size, args.max_target_length),
    }
    config = AutoConfig.from_pretrained(model_dir)
    counter = spec_for(config).flop_counter(config, frozen_weights=False)
    flops = counter.training(batch, recompute=False)[0].item()
    seconds = result["step_seconds"]
    tokens = args.batch_size * (args.max_source_length + args.max_target_length)
    mfu = flops / seconds / (peak_tflops * 1e12) if peak_tflops else None
    return {"tokens_per_s": args.nproc * tokens / seconds, "mfu": mfu}


def percent(share: float | None) -> str:
    """A table cell: 12.3%, or - where there is no figure."""
    return "-" if share is None else f"{share:.1%}"


def markdown_table(header: str, rows: list[str]) -> str:
    """A markdown table: the `header` line ("| a | b |"), its separator, then `rows`."""
    columns = header.count("|") - 1
    return "\n".join([header, "| --- " * columns + "|", *rows]) + "\n"


def peers_markdown(results: list[dict]) -> str:
    bare = {r["model"]: r["step_seconds"] for r in results if r["case"] == BARE_FSDP1}
    header = (
        "| model | framework | step time (s) | vs bare FSDP1 | tokens/s (all ranks) | MFU "
        "| peak memory per rank (MiB) |"
    )
    rows = []
    for r in results:
        ratio = f"{r['step_seconds'] / bare[r['model']]:.3f}x" if bare.get(r["model"]) else "-"
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in r["peak_memory_bytes"])
        rows.append(
            f"| {r['model']} | {r['case']} | {r['step_seconds']:.3f} | {ratio} | {r['tokens_per_s']:.0f} "
            f"| {percent(r['mfu'])} | {peaks} |"
        )
    return markdown_table(header, rows)


def run_case(
    model_dir: str,
    case_args: list[str],
    nproc: int,
    batch: int,
    common: list[str],
    work: Path,
    run_length: list[str],
    deadline: float | None = None,
    warmup_steps: int = 2,
) -> dict:
    """One run of T5_training.py through torchrun, as long as `run_length` says (--num_train_samples, --max_steps):
    its step records after the first `warmup_steps` timed, its epoch record, config.json and memory records."""
    out = work / f"run{len(list(work.iterdir()))}"
    args = [
        "--model_name",
        model_dir,
        "--output_dir",
        str(out),
        "--epochs",
        "1",
        "--run_validation",
        "false",
        "--keep_last_n",
        "0",
        "--eval_rouge",
        "false",
        *run_length,
        "--batch_size_training",
        str(batch),
        "--log_every_n_steps",
        "2",
        *common,
        *case_args,
    ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--standalone",
        str(REPO_ROOT / "T5_training.py"),
        *args,
    ]
    done = run_by_deadline(command, deadline)
    if done.returncode != 0:
        raise CaseFailed(done.stdout, done.stderr)
    records = [json.loads(line) for line in open(out / "metrics.jsonl", encoding="utf-8")]
    steps = [r for r in records if r["type"] == "step"]
    timed = steps[warmup_steps:]
    epoch = next(r for r in records if r["type"] == "epoch")
    memory = [r for r in records if r["type"] == "memory"]
    total = memory[0]["param_numel_total"]
    config = json.loads((out / "config.json").read_text())
    return {
        "step_times": {r["step"]: r["seconds"] for r in steps},
        "step_tokens": [r["tokens"] for r in steps],
        "saves": checkpoint_saves(done.stdout),
        "step_seconds": statistics.median(r["seconds"] for r in timed),
        # The steps after the warm-up: seconds, real tokens and model FLOPs (the package's count), all ranks.
        "timed": {
            "steps": len(timed),
            "seconds": sum(r["seconds"] for r in timed),
            "tokens": sum(r["tokens"] for r in timed),
            "model_flops": sum(r.get("model_tflops_per_s", 0) * 1e12 * r["seconds"] * nproc for r in timed),
        },
        "samples_per_s": epoch["samples_per_s"],
        "tokens_per_s": epoch["tokens_per_s"],  # real (non-padding) source + target tokens, all ranks
        "mfu": epoch.get("mfu"),
        "train_loss": epoch["train_loss"],
        "compiled_graphs": epoch["compiled_graphs"],
        "precision": config["mixed_precision_policy"],
        "peak_tflops": config["mfu_peak_tflops"],
        "peak_memory_bytes": epoch["peak_memory_bytes"],
        "param_share": max(r["param_numel_local"] for r in memory) / total,
        "optim_share": max(r["optim_state_numel_local"] for r in memory) / (2 * total),  # AdamW: 2 moments
        "param_numel_total": total,
        "load_rss_delta_bytes": [r["load_rss_delta_bytes"] for r in memory],  # by rank
    }


def timed_rates(timed: dict, nproc: int, peak_tflops: float | None) -> dict:
    """Real tokens per step and per second of a run's timed steps, and their MFU (model FLOPs per device second
    over the peak; none without a peak)."""
    device_seconds = timed["seconds"] * nproc
    mfu = timed["model_flops"] / device_seconds / (peak_tflops * 1e12) if peak_tflops else None
    tokens = timed["tokens"]
    return {"tokens_per_step": tokens / timed["steps"], "tokens_per_s": tokens / timed["seconds"], "mfu": mfu}


def checkpoint_saves(log: str) -> list[dict]:
    """Rank 0's checkpoint lines: for each save, its step, the seconds training stopped, the seconds until it
    was complete, and its size."""
    saves = {}
    for match in re.finditer(r"checkpoint \S+step_(\d+): training resumes after ([\d.]+) s", log):
        saves[int(match[1])] = {"step": int(match[1]), "stalled_s": float(match[2])}
    complete = r"checkpoint \S+step_(\d+) \(\w+\): ([\d.]+) MB (?:in the background )?in ([\d.]+) s"
    for match in re.finditer(complete, log):
        save = saves.setdefault(int(match[1]), {"step": int(match[1]), "stalled_s": float(match[3])})
        save.update(megabytes=float(match[2]), complete_s=float(match[3]))
    return sorted(saves.values(), key=lambda save: save["step"])


def wikihow_length_sample(
    folder: Path, means: tuple[int, int], sigma: float = 0.6, rows: int = 1600, seed: int = 0
) -> str:
    """A data folder in WikiHow's format whose article and summary lengths have the given mean word counts
    (WikiHow's published means: articles about 500 words, summaries about 46), made from the embedded
    sample's sentences.

    Lengths are log-normal with those means (`sigma`; 0: every text that long), scaled by 1.3 / 2.0: t5's
    tokenizer makes about 1.3 tokens of a word, the embedded tokenizer about 2, so token counts, which set
    the cost, match WikiHow's under t5. No published lists: the reader splits by title hash.
    """
    frame = load_wikihow(EMBEDDED_DATA_DIR, "train")  # the package's reader: the file has malformed rows
    texts, headlines = list(frame["text"]), list(frame["headline"])
    rng = random.Random(seed)

    def grown(pieces: list[str], words: int, separator: str) -> str:
        out, count = [], 0
        while count < words:
            piece = rng.choice(pieces).strip()
            out.append(piece)
            count += len(piece.split())
        return separator.join(out)

    def words(mean_words: float) -> float:
        # A log-normal's mean is exp(mu + sigma^2 / 2); t5 / embedded tokens per word: 1.3 / 2.0.
        return rng.lognormvariate(math.log(mean_words * 1.3 / 2.0) - sigma**2 / 2, sigma)

    sample = pd.DataFrame(
        {
            "headline": [grown(headlines, words(means[1]), ",\n") for _ in range(rows)],
            "title": [f"How to Do Thing {i}" for i in range(rows)],
            "text": [grown(texts, words(means[0]), ";\n,") for _ in range(rows)],
        }
    )
    folder.mkdir(parents=True, exist_ok=True)
    sample.to_csv(folder / "wikihowAll.csv", index=False)
    return str(folder)


# wikihowAll.csv: 214,544 rows; the published split sizes (the rest of the rows are in no list).
FULL_SIZE_ROWS = 214_544
PUBLISHED_SPLITS = {"all_train.txt": 157_252, "all_val.txt": 5_599, "all_test.txt": 5_577}
# WikiHow's published mean lengths in words (articles, summaries); log-normal spread.
FULL_SIZE_MEANS, FULL_SIZE_SIGMA = (580, 60), 0.7


def full_size_wikihow(folder: Path, rows: int = FULL_SIZE_ROWS, seed: int = 0) -> Path:
    """A data folder with a wikihowAll.csv of the real file's size and format, and split lists of the
    published sizes (scaled to `rows`); made from the embedded sample's paragraphs, and reused when a
    previous invocation made the same one."""
    made = {"rows": rows, "seed": seed, "means": list(FULL_SIZE_MEANS), "sigma": FULL_SIZE_SIGMA, "version": 1}
    marker = folder / "generated.json"
    if marker.exists() and json.loads(marker.read_text()) == made:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    sample = load_wikihow(EMBEDDED_DATA_DIR, "train")
    paragraphs = [p.strip() for text in sample["text"] for p in text.split("\n") if p.strip()]
    bold_lines = [line.strip() for headline in sample["headline"] for line in headline.split("\n") if line.strip()]
    rng = random.Random(seed)

    def grown(pieces: list[str], mean_words: float, separator: str) -> str:
        target = rng.lognormvariate(math.log(mean_words) - FULL_SIZE_SIGMA**2 / 2, FULL_SIZE_SIGMA)
        out, count = [], 0
        while count < target:
            out.append(rng.choice(pieces))
            count += len(out[-1].split())
        return separator.join(out)

    titles = [f"How to Do Thing {i}" for i in range(rows)]
    # The published file's line ends are CRLF, inside quoted fields too; its bold lines are joined by ".,\n"
    # and its paragraphs by "\n,".
    with open(folder / "wikihowAll.csv", "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\r\n")
        writer.writerow(["headline", "title", "text"])
        for title in titles:
            headline = grown(bold_lines, FULL_SIZE_MEANS[1], ",\r\n")
            writer.writerow([headline, title, grown(paragraphs, FULL_SIZE_MEANS[0], "\r\n,")])
    order = rng.sample(range(rows), rows)
    start = 0
    for name, size in PUBLISHED_SPLITS.items():
        size = size * rows // FULL_SIZE_ROWS
        listed = sorted(order[start : start + size])
        (folder / name).write_text("".join(titles[i].replace(" ", "") + "\n" for i in listed), encoding="utf-8")
        start += size
    marker.write_text(json.dumps(made))
    return folder


def full_size_json_lines(data_dir: Path) -> Path:
    """train.jsonl and validation.jsonl in data_dir/jsonl: the full-size file's builder splits as your own data
    (id, document, summary; the texts cleaned as the WikiHow path cleans them), reused when already made."""
    folder = data_dir / "jsonl"
    made = {"from": (data_dir / "generated.json").read_text(), "version": 1}
    marker = folder / "generated.json"
    if marker.exists() and json.loads(marker.read_text()) == made:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for split in ("train", "validation"):
        with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for batch in load_wikihow(data_dir, split).iter(batch_size=2048):
                for title, headline, text in zip(batch["title"], batch["headline"], batch["text"], strict=True):
                    row = {"id": title, "document": clean_text(text), "summary": clean_text(headline)}
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
    marker.write_text(json.dumps(made))
    return folder


def first_step_run(repo: Path, nproc: int, args: list[str], out: Path) -> dict:
    """One torchrun launch of `repo`'s T5_training.py: seconds to its first step record, the wall time, the
    CPU seconds of every process (ranks and agent), and each rank's peak RSS from its epoch record."""
    metrics = out / "metrics.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
               str(repo / "T5_training.py"), "--output_dir", str(out), *args]  # fmt: skip
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    first_step = None
    with open(out.parent / f"{out.name}.log", "w") as log:
        process = subprocess.Popen(command, cwd=repo, stdout=log, stderr=subprocess.STDOUT)
        while process.poll() is None:
            if first_step is None and metrics.exists() and '"type": "step"' in metrics.read_text():
                first_step = time.perf_counter() - started
            time.sleep(0.05)
    wall = time.perf_counter() - started
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if process.returncode != 0:
        raise SystemExit(f"run failed ({command}): see {out.parent / f'{out.name}.log'}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    epoch = next(r for r in records if r["type"] == "epoch")
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    return {"first_step_s": first_step, "wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": epoch["peak_memory_bytes"]}


def run_data_suite(args, work: Path) -> list[dict]:
    """For each --ranks and case: the embedded sample, then the full-size file with a cold and a warm cache, then
    its splits as JSON-lines files of your own (--train_file/--validation_file), cold and warm."""
    data_dir = full_size_wikihow(Path(args.wikihow_dir or Path(args.out) / "wikihow_full"), args.rows)
    csv_path = data_dir / "wikihowAll.csv"
    print(f"full-size file: {csv_path} ({csv_path.stat().st_size / 1e6:.0f} MB)", flush=True)
    json_lines = full_size_json_lines(data_dir)
    sizes = sum(path.stat().st_size for path in json_lines.glob("*.jsonl"))
    print(f"full-size JSON lines: {json_lines} ({sizes / 1e6:.0f} MB)", flush=True)
    sources = {
        "embedded sample": ["--data_dir", str(EMBEDDED_DATA_DIR)],
        "full size, cold cache": ["--data_dir", str(data_dir)],
        "full size, warm cache": ["--data_dir", str(data_dir)],
        "full-size JSON lines, cold cache": ["--train_file", str(json_lines / "train.jsonl"),
                                             "--validation_file", str(json_lines / "validation.jsonl")],
    }  # fmt: skip
    sources["full-size JSON lines, warm cache"] = sources["full-size JSON lines, cold cache"]
    repo = Path(args.repo).resolve() if args.repo else REPO_ROOT
    # Fixed 512/150 shapes (the tutorial's padding): the embedded sample's articles are shorter than the
    # generated ones, and per-batch padding would make the full-size steps' activations larger, which
    # would count as "data" memory. So the runs differ only in the data.
    common = ["--max_steps", "3", "--log_every_n_steps", "1", "--keep_last_n", "0", "--eval_rouge", "false",
              "--pad_to_max_length", "true"]  # fmt: skip
    results = []
    for nproc in args.ranks:
        for case, case_args in SUITES["data"].items():
            if args.cases and case not in args.cases:
                continue
            runs = {}
            for data, data_args in sources.items():
                if args.repo and "JSON lines" in data:
                    continue  # the control checkout reads WikiHow only
                if data == "full size, cold cache":
                    shutil.rmtree(data_dir / "cache", ignore_errors=True)
                if data == "full-size JSON lines, cold cache":
                    shutil.rmtree(json_lines / "cache", ignore_errors=True)
                out = work / f"run{len(list(work.iterdir()))}"
                runs[data] = first_step_run(repo, nproc, [*common, *case_args, *data_args], out)
                embedded = runs["embedded sample"]
                result = {"ranks": nproc, "case": case, "data": data, **runs[data]}
                result["data_rss_bytes"] = max(result["peak_rss_bytes"]) - max(embedded["peak_rss_bytes"])
                result["data_cpu_s"] = result["cpu_s"] - embedded["cpu_s"]
                result["first_step_vs_embedded"] = result["first_step_s"] / embedded["first_step_s"]
                results.append(result)
                print(f"{nproc} ranks | {case} | {data} | first step {result['first_step_s']:.1f} s", flush=True)
    return results


def data_markdown(results: list[dict]) -> str:
    header = (
        "| ranks | case | data | time to first step (s) | vs embedded | peak RSS per rank (MiB) "
        "| data RSS per rank (MiB, max rank) | CPU s, all ranks | data CPU s |"
    )
    rows = []
    for r in results:
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in r["peak_rss_bytes"])
        rows.append(
            f"| {r['ranks']} | {r['case']} | {r['data']} | {r['first_step_s']:.1f} "
            f"| {r['first_step_vs_embedded']:.2f}x "
            f"| {peaks} | {r['data_rss_bytes'] / 2**20:.0f} | {r['cpu_s']:.1f} | {r['data_cpu_s']:.1f} |"
        )
    return markdown_table(header, rows)


def model_folder(name: str, root: Path | str) -> str:
    """The model's folder: the embedded T5, or a random-weight one of a published shape made in `root` (reused
    where an earlier invocation made it there)."""
    if name == "embedded":
        return str(EMBEDDED_MODEL_DIR)
    folder = Path(root) / f"{name}-random"
    made = folder / "made.json"  # written last: a folder without it was cut off while written
    if not made.exists():
        shutil.rmtree(folder, ignore_errors=True)
        if name in CAUSAL_MODELS:
            parameters = random_llama_folder(CAUSAL_MODELS[name], str(folder))
        else:
            parameters = make(name, str(folder))
        made.write_text(json.dumps({"model": name, "parameters": parameters}))
    return str(folder)


# The rows of --suite gpu_causal: whole texts whose token counts spread as instruction and chat rows do, most a
# few hundred tokens and a tail of long ones: log-normal, the median a fifth of the block, sigma 0.9 (the mean
# 0.3 of the block), each within the block. A chosen spread, not one measured on a dataset.
ROW_MEDIAN_SHARE, ROW_SIGMA = 0.2, 0.9


def chat_length_rows(folder: Path, tokenizer, rows: int, block: int, seed: int = 0) -> str:
    """A data folder of whole texts (train.jsonl, validation.jsonl of 8 rows; field "text"), each drawn a token
    count (ROW_MEDIAN_SHARE, ROW_SIGMA; from 8 to `block` tokens, <s> and </s> included) and made of the
    embedded WikiHow sample's sentences until `tokenizer` counts that many tokens in them."""
    sample = load_wikihow(EMBEDDED_DATA_DIR, "train")
    sentences = sorted({s.strip() for text in sample["text"] for s in clean_text(text).split(".") if s.strip()})
    counts = [
        len(ids) for ids in tokenizer([" " + s + "." for s in sentences], add_special_tokens=False).input_ids
    ]
    rng = random.Random(seed)

    def text() -> str:
        wanted = min(max(rng.lognormvariate(math.log(ROW_MEDIAN_SHARE * block), ROW_SIGMA), 8), block) - 2
        chosen, count = [], 0
        while count < wanted:
            index = rng.randrange(len(sentences))
            if chosen and count + counts[index] > wanted:  # past the count: a row keeps within its block
                break
            chosen.append(sentences[index] + ".")
            count += counts[index]
        return " ".join(chosen)

    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", rows), ("validation", 8)):
        lines = [json.dumps({"text": text()}) + "\n" for _ in range(count)]
        (folder / f"{split}.jsonl").write_text("".join(lines), encoding="utf-8")
    return str(folder)


def markdown(results: list[dict]) -> str:
    header = (
        "| model | case | step time (s) | samples/s | real tokens/s | MFU | train loss | peak RSS per rank (MiB) "
        "| params held | AdamW state held |"
    )
    rows = []
    for r in results:
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in r["peak_memory_bytes"])
        mfu = percent(r["mfu"])
        rows.append(
            f"| {r['model']} | {r['case']} | {r['step_seconds']:.3f} | {r['samples_per_s']:.1f} "
            f"| {r['tokens_per_s']:.0f} | {mfu} | {r['train_loss']:.4f} | {peaks} "
            f"| {r['param_share']:.3f} | {r['optim_share']:.3f} |"
        )
    return markdown_table(header, rows)


def checkpoint_markdown(results: list[dict]) -> str:
    """The saves' table (saves_markdown), then the exports' and the resume loads' (scripts/export_memory.py)."""
    saves = [r for r in results if not r.get("export")]
    exports = [r for r in results if r.get("export") and "peak_above_bytes" in r]
    loads = [r for r in results if r.get("export") and "load_s" in r]
    tables = [saves_markdown(saves)] if saves else []
    if exports:
        header = (
            "| model | export | rank 0 peak above its RSS before (MiB) | / fp32 model | any rank's (MiB) "
            "| seconds | files |"
        )
        rows = []
        for r in exports:
            peak, model = r["peak_above_bytes"], r["model_bytes"]
            rows.append(
                f"| {r['model']} | {r['case']} | {peak / 2**20:.0f} | {peak / model:.2f}x "
                f"| {r['highest_peak_above_bytes'] / 2**20:.0f} | {r['seconds']:.1f} | {r['files']} |"
            )
        tables.append(markdown_table(header, rows))
    if loads:
        header = "| model | checkpoint | MB written | save (s) | load for resume (s) |"
        rows = []
        for r in loads:
            rows.append(
                f"| {r['model']} | {r['case']} | {r['bytes'] / 1e6:.0f} | {r['save_s']:.1f} | {r['load_s']:.1f} |"
            )
        tables.append(markdown_table(header, rows))
    return "\n".join(tables)


def saves_markdown(results: list[dict]) -> str:
    """Per save: the seconds training stopped and until the checkpoint was complete; the step after each save
    (a background write running) against the median step of the run without checkpoints."""
    header = (
        "| model | case | saves | MB per save | training stopped per save (s) | complete after (s) "
        "| step after a save (s) | step without checkpoints (s) | ratio |"
    )
    rows = []
    for r in results:
        backend = r["case"].split(",")[0]
        baseline = next(
            x for x in results if x["model"] == r["model"] and x["case"] == f"{backend}, no checkpoints"
        )
        plain = statistics.median(list(baseline["step_times"].values())[1:])  # the first step: warm-up
        saves = [save for save in r["saves"] if save["step"] + 1 in r["step_times"]]  # not the epoch's end
        if not saves:
            rows.append(f"| {r['model']} | {r['case']} | 0 | - | - | - | - | {plain:.3f} | - |")
            continue
        after = statistics.median(r["step_times"][save["step"] + 1] for save in saves)
        megabytes, stalled, complete = (
            statistics.median(s[key] for s in saves) for key in ("megabytes", "stalled_s", "complete_s")
        )
        rows.append(
            f"| {r['model']} | {r['case']} | {len(saves)} | {megabytes:.0f} | {stalled:.3f} | {complete:.3f} "
            f"| {after:.3f} | {plain:.3f} | {after / plain:.2f}x |"
        )
    return markdown_table(header, rows)


def loading_markdown(results: list[dict]) -> str:
    header = "| model | case | loading high-water mark per rank (MiB) | / fp32 model | peak RSS per rank (MiB) |"
    rows = []
    for r in results:
        model_bytes = 4 * r["param_numel_total"]
        rows.append(
            f"| {r['model']} | {r['case']} | {', '.join(f'{b / 2**20:.0f}' for b in r['load_rss_delta_bytes'])} "
            f"| {', '.join(f'{b / model_bytes:.2f}' for b in r['load_rss_delta_bytes'])} "
            f"| {', '.join(f'{b / 2**20:.0f}' for b in r['peak_memory_bytes'])} |"
        )
    return markdown_table(header, rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="backends")
    parser.add_argument(
        "--models",
        nargs="+",
        default=None,
        choices=["embedded", *sorted(SHAPES), *CAUSAL_MODELS],
        help="default: embedded; for --suite gpu_causal llama-tiny (tinyllama-1.1b on a GPU)",
    )
    parser.add_argument(
        "--models_dir",
        help="where the random-weight model folders are made, and reused by a later invocation (default: a "
        "temporary folder per invocation)",
    )
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: 1 for the gpu suites, else 2)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8], help="data suite: the numbers of ranks")
    parser.add_argument("--rows", type=int, default=FULL_SIZE_ROWS, help="data suite: rows of the generated file")
    parser.add_argument(
        "--wikihow_dir",
        help="data suite: where the full-size file is generated, or reused (default <out>/wikihow_full)",
    )
    parser.add_argument("--repo", help="data suite: run this checkout's T5_training.py instead (the control)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per case")
    parser.add_argument(
        "--batch_size",
        type=int,
        default=4,
        help="training batch per rank of every case and peer (default 4; gpu_causal: packed blocks a step)",
    )
    parser.add_argument("--max_source_length", type=int, default=128)
    parser.add_argument("--max_target_length", type=int, default=32)
    parser.add_argument(
        "--max_seq_len", type=int, default=256, help="gpu_causal: the packed blocks' tokens (default 256)"
    )
    parser.add_argument(
        "--data",
        choices=["embedded", "wikihow_lengths", "full_lengths"],
        default=None,
        help=(
            "embedded: the embedded sample; wikihow_lengths: a sample with WikiHow's article and summary "
            "lengths; full_lengths: every article and summary longer than the max lengths (fixed shapes, as "
            "the peers suite's random batches). Default: full_lengths for the peers and gpu suites (their rates "
            "count every position as a token), else embedded. gpu_causal generates rows of its own "
            "(chat_length_rows)"
        ),
    )
    parser.add_argument("--mixed_precision", choices=["true", "false"], default="false")
    parser.add_argument(
        "--dropout_rate",
        type=float,
        default=None,
        help="every case's and peer's model dropout (default: the model's own, 0.1 for T5); t5_flex runs "
        "FlexAttention only without attention dropout, so compare kernels at 0",
    )
    parser.add_argument("--out", default="bench", help="folder for results.json and results.md")
    parser.add_argument(
        "--cases", nargs="+", metavar="CASE", help="only these cases of the suite, by name (default: all)"
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        metavar="PEER",
        help="only these peers of the suite, by name; none given: no peer (default: all)",
    )
    parser.add_argument(
        "--time_budget_s",
        type=float,
        default=None,
        help="stop the training cases and peers after this many seconds (the data suite and the checkpoint "
        "suite's exports are not bounded): the case then running is stopped with its ranks and listed as "
        "failed, the ones left are listed as skipped, and what was measured is written (results are also "
        "written after each model). For a machine lent for a fixed time (default: no budget)",
    )
    args = parser.parse_args()
    args.deadline = None if args.time_budget_s is None else time.monotonic() + args.time_budget_s
    args.failures = []  # cases that ended with an error (report_failure): listed under the table
    args.not_run = []  # cases and peers this machine cannot run (runs_here): listed under the table
    causal = args.suite == "gpu_causal"
    args.models = args.models or (["llama-tiny"] if causal else ["embedded"])
    wrong_kind = [model for model in args.models if (model in CAUSAL_MODELS) != causal]
    if wrong_kind:
        kind = "decoder-only models" if causal else "T5 models"
        parser.error(f"--suite {args.suite} measures {kind}, not {wrong_kind}")
    known = set(SUITES[args.suite]) | (set(EXPORT_CASE_NAMES) if args.suite == "checkpoint" else set())
    unknown = sorted(set(args.cases or []) - known)
    if unknown:
        parser.error(f"--suite {args.suite} has no case {unknown}; its cases: {sorted(known)}")
    peers = PEERS_OF_SUITE.get(args.suite, {})
    unknown = sorted(set(args.peers or []) - set(peers))
    if unknown:
        parser.error(f"--suite {args.suite} has no peer {unknown}; its peers: {sorted(peers)}")
    first_case = next(iter(SUITES[args.suite]))
    with_peers = bool(peers) and (args.peers is None or bool(args.peers))
    if args.cases and with_peers and first_case not in args.cases:
        parser.error(
            f"--suite {args.suite} rates its peers against its first case: add {first_case!r} to --cases (or "
            "run no peer: --peers with no name)"
        )
    one_device = args.suite in ("gpu", "gpu_causal")
    args.nproc = args.nproc or (1 if one_device else 2)
    if one_device and args.nproc != 1:
        parser.error(f"--suite {args.suite} measures one device: --nproc 1")
    if causal:
        if args.steps <= CAUSAL_WARMUP_STEPS:
            parser.error(
                f"--suite gpu_causal times the steps after its first {CAUSAL_WARMUP_STEPS}: give more --steps"
            )
    else:
        args.data = args.data or ("full_lengths" if args.suite in PEERS_OF_SUITE else "embedded")
        if args.suite in PEERS_OF_SUITE and args.data != "full_lengths":
            parser.error(f"--suite {args.suite} rates fixed shapes: it needs --data full_lengths")
        wanted = args.steps * args.batch_size * args.nproc
        if (
            args.data == "embedded"
            and args.suite != "data"
            and wanted > len(load_wikihow(EMBEDDED_DATA_DIR, "train"))
        ):
            parser.error(
                f"--steps x --batch_size x --nproc = {wanted} samples, more than the embedded sample's train "
                "split: use --data wikihow_lengths or full_lengths (generated with as many rows as needed)"
            )
    if args.suite == "data":
        with tempfile.TemporaryDirectory() as tmp:
            results = run_data_suite(args, Path(tmp))
        return write_results(args, results, data_markdown(results))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "runs").mkdir()
        common = (causal_common if causal else seq2seq_common)(args, work)
        results = []
        for model in args.models:
            results += run_suite(model, args, common, work)
            if model != args.models[-1]:  # what a later model's kill would otherwise take with it
                write_results(args, results, SUITE_TABLES.get(args.suite, markdown)(results))
        if args.suite == "checkpoint":
            for model in args.models:
                folder = model_folder(model, args.models_dir or work)
                exported = measure_exports(folder, args.nproc, work, args.cases)
                results += [{"model": model, "export": True, **result} for result in exported]
    return write_results(args, results, SUITE_TABLES.get(args.suite, markdown)(results))


def seq2seq_common(args, work: Path) -> list[str]:
    """Every T5 case's lengths, precision and dropout, and its data: the embedded sample or one generated in
    `work`."""
    common = ["--max_source_length", str(args.max_source_length), "--max_target_length",
              str(args.max_target_length), "--mixed_precision", args.mixed_precision]  # fmt: skip
    if args.dropout_rate is not None:
        common += ["--dropout_rate", str(args.dropout_rate)]
    if args.data != "embedded":
        # full_lengths: about 400 and 100 tokens, past the max lengths the fixed-shape suites use
        # (short enough that tokenizing them costs the same as tokenizing WikiHow's articles).
        means, sigma = ((500, 46), 0.6) if args.data == "wikihow_lengths" else ((300, 80), 0.0)
        # Rows for every case's samples (up to 4 micro-batches a step), about 9 in 10 of them in train.
        rows = max(1600, 2 * args.steps * args.batch_size * args.nproc * 4)
        common += ["--data_dir", wikihow_length_sample(work / "data", means, sigma, rows)]
    return common


def causal_common(args, work: Path) -> list[str]:
    """Every gpu_causal case's data: rows generated in `work` (chat_length_rows; the tiny Llama tokenizer, which
    every model of the suite has), packed by bfd into blocks of --max_seq_len padded to it; and the dropout."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder(args.models[0], args.models_dir or work))
    # About 3 rows a block: 5 rows for each block the steps take leave room for the blocks the package's epoch
    # deals past them (the peer takes the package's first ones).
    args.causal_data = chat_length_rows(work / "data", tokenizer, rows=5 * args.steps * args.batch_size,
                                        block=args.max_seq_len)  # fmt: skip
    common = ["--dataset_name", args.causal_data, "--max_seq_len", str(args.max_seq_len), *CAUSAL_DATA]
    return common + (["--dropout_rate", str(args.dropout_rate)] if args.dropout_rate is not None else [])


def write_results(args, results: list[dict], table: str) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        name: value for name, value in vars(args).items() if name not in ("failures", "not_run", "deadline")
    }
    summary = {"settings": settings, "results": results, "failed": args.failures, "not_run": args.not_run}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    if args.failures:
        listed = "".join(f"- {f['model']}, {f['case']}: {f['error']}\n" for f in args.failures)
        table += "\nFailed cases:\n" + listed
    if args.not_run:
        listed = "".join(f"- {n['model']}, {n['case']}: {n['reason']}\n" for n in args.not_run)
        table += "\nNot run on this machine:\n" + listed
    (out / "results.md").write_text(table)
    print(f"\n{table}\nwritten: {out / 'results.json'}, {out / 'results.md'}")
    return 1 if args.failures else 0


def run_suite(model: str, args, common: list[str], work: Path) -> list[dict]:
    """The suite's cases and peers for one model, all rated alike: its first case, then its peers, then its other
    cases (the comparison most wanted first, where a time budget may end the suite); those this machine cannot
    run are listed apart (runs_here)."""
    folder = model_folder(model, args.models_dir or work)
    cases = [
        (case, case_args) for case, case_args in SUITES[args.suite].items() if not args.cases or case in args.cases
    ]
    peers = [(case, peer_args) for case, peer_args in PEERS_OF_SUITE.get(args.suite, {}).items()
             if args.peers is None or case in args.peers]  # fmt: skip
    causal = args.suite == "gpu_causal"
    results = []
    for case, case_args, is_peer in (
        [(*c, False) for c in cases[:1]] + [(*p, True) for p in peers] + [(*c, False) for c in cases[1:]]
    ):
        if not runs_here(model, case, case_args, args) or over_budget(args, model, case):
            continue
        if is_peer and causal:
            args.peer_precision = peer_precision(results)
        try:
            result = measure(folder, case_args, is_peer, args, common, work / "runs")
        except CaseFailed as failure:
            report_failure(model, case, failure, args)
            continue
        planned = {} if is_peer or causal else planner_bytes(folder, case_args, args)
        results.append({"model": model, "case": case, **result, **planned})
        # the whole row as it comes: a suite cut off by a time limit keeps what it measured in its log
        peak = max(result["peak_memory_bytes"]) / 2**20
        print(f"{model} | {case} | {result['step_seconds']:.3f} s/step | peak {peak:.0f} MiB", flush=True)
    # Each of this package's rows against the peak of its own compute dtype (its config.json); the peers against
    # the first row's (fp32 for the peers suite, bf16 for the gpu suites' bf16 runs); no MFU for them if every
    # case of the package failed.
    reference_peak = next((r["peak_tflops"] for r in results if "peak_tflops" in r), None)
    for result in results:
        peak = result.get("peak_tflops") or reference_peak
        if causal:
            result.update(timed_rates(result["timed"], args.nproc, peak))
        elif args.suite in PEERS_OF_SUITE:
            result.update(fixed_shape_rates(result, folder, args, peak))
    return results


def measure(folder: str, case_args: list[str], is_peer: bool, args, common: list[str], work: Path) -> dict:
    """One peer's run, or one case's run of the package for --steps steps (T5: as many samples; gpu_causal:
    --max_steps, its packed blocks dealt by the package's sampler)."""
    causal = args.suite == "gpu_causal"
    if is_peer:
        return (run_causal_peer if causal else run_peer)(folder, case_args, args, work)
    if causal:
        run_length, warmup = ["--max_steps", str(args.steps)], CAUSAL_WARMUP_STEPS
    else:
        accumulation = int(case_args[case_args.index("--gradient_accumulation_steps") + 1]) if (
            "--gradient_accumulation_steps" in case_args) else 1  # fmt: skip
        run_length = ["--num_train_samples", str(args.steps * args.batch_size * args.nproc * accumulation)]
        warmup = 2  # the first logged window
    return run_case(folder, case_args, args.nproc, args.batch_size, common, work, run_length,
                    deadline=args.deadline, warmup_steps=warmup)  # fmt: skip


def peer_precision(results: list[dict]) -> str:
    """The causal peer's precision: the package's on this device (its first case's policy: bf16 where the device
    has bf16 kernels), or without a case run, bf16 on a GPU."""
    policy = next((r["precision"] for r in results if "precision" in r), None)
    if policy is None:
        return "bf16" if torch.cuda.is_available() else "fp32"
    return "bf16" if "bf" in policy.lower() else "fp32"


def runs_here(model: str, case: str, case_args: list[str], args) -> bool:
    """Whether this machine can run the case or peer: GPU_ONLY's need a GPU, the Liger peer the liger_kernel
    package. One that cannot is said and listed under the table with why (not a failure)."""
    if GPU_ONLY & set(case_args) and not torch.cuda.is_available():
        reason = "needs a GPU"
    elif LIGER in case_args and importlib.util.find_spec("liger_kernel") is None:
        reason = ("liger_kernel does not import here (pip install liger-kernel; a machine without the network "
                  "installs the wheel carried with the checkout: docs/throughput.md)")  # fmt: skip
    else:
        return True
    print(f"{model} | {case} | skipped: {reason}", flush=True)
    args.not_run.append({"model": model, "case": case, "reason": reason})
    return False


def over_budget(args, model: str, case: str) -> bool:
    """Whether --time_budget_s is spent before `case` starts: then it is listed as skipped."""
    if args.deadline is None or time.monotonic() < args.deadline:
        return False
    print(f"{model} | {case} | skipped: the time budget is spent", flush=True)
    args.failures.append({"model": model, "case": case, "error": "skipped: --time_budget_s spent"})
    return True


def report_failure(model: str, case: str, failure: CaseFailed, args) -> None:
    """A failed case is printed with the end of its output and listed under the table with its error line (the
    package's first ERROR line, else stderr's last line); the other cases go on (on a GPU, one case that runs
    out of memory should not lose the suite's other rows)."""
    print(f"{model} | {case} | FAILED\n{failure.stdout[-3000:]}\n{failure.stderr[-3000:]}", flush=True)
    errors = [line for line in failure.stdout.splitlines() if re.match(r"(\[rank \d+\] )?ERROR ", line)]
    last_lines = [line for line in failure.stderr.splitlines() if line.strip()] or [""]
    error = failure.reason or (errors or last_lines[-1:])[0][:300]
    args.failures.append({"model": model, "case": case, "error": error})


def planner_bytes(model_dir: str, case_args: list[str], args) -> dict:
    """scripts/estimate_memory.py's prediction of the case's peak per rank, for the gpu suite's table (none for one
    rank without FSDP: the planner plans FSDP)."""
    from scripts.estimate_memory import estimate, load_shape

    def flag(name: str, default: str) -> str:
        return case_args[case_args.index(name) + 1] if name in case_args else default

    if flag("--single_rank_fsdp", "true") == "false":
        return {}

    precision = "fp32" if flag("--mixed_precision", args.mixed_precision) == "false" else "bf16"
    predicted = estimate(
        load_shape(model_dir),
        nproc=args.nproc,
        sharding_strategy="FULL_SHARD",
        mixed_precision="fp16" if flag("--use_fp16", "false") == "true" else precision,
        activation_checkpointing=flag("--fsdp_activation_checkpointing", "true") == "true",
        batch_size=args.batch_size,
        max_source_length=args.max_source_length,
        max_target_length=args.max_target_length,
        device="cuda" if torch.cuda.is_available() else "cpu",
        # t5_flex keeps less than sdpa's masks (no score or mask tensor): sdpa's count is its upper bound
        attn_implementation={"t5_flex": "sdpa"}.get(kernel := flag("--attn_implementation", "sdpa"), kernel),
    )
    return {"planner_bytes": predicted.total_bytes}


def gpu_markdown(results: list[dict]) -> str:
    header = "| model | case | step time (s) | tokens/s | MFU | peak memory (MiB) | planner (MiB) |"
    rows = []
    for r in results:
        planner = f"{r['planner_bytes'] / 2**20:.0f}" if "planner_bytes" in r else "-"
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in r["peak_memory_bytes"])
        rows.append(
            f"| {r['model']} | {r['case']} | {r['step_seconds']:.3f} | {r['tokens_per_s']:.0f} "
            f"| {percent(r['mfu'])} | {peaks} | {planner} |"
        )
    return markdown_table(header, rows)


def gpu_causal_markdown(results: list[dict]) -> str:
    """The timed steps of each case and peer (after CAUSAL_WARMUP_STEPS): real tokens, their rate and MFU by the
    package's count, the peak memory and the graphs torch.compile made."""
    header = ("| model | case | step time (s) | real tokens/step | real tokens/s | MFU | peak memory (MiB) "
              "| graphs compiled |")  # fmt: skip
    rows = []
    for r in results:
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in r["peak_memory_bytes"])
        rows.append(
            f"| {r['model']} | {r['case']} | {r['step_seconds']:.3f} | {r['tokens_per_step']:.0f} "
            f"| {r['tokens_per_s']:.0f} | {percent(r['mfu'])} | {peaks} | {r['compiled_graphs']} |"
        )
    return markdown_table(header, rows)


# Each suite's table (markdown for the others).
SUITE_TABLES = {
    "peers": peers_markdown,
    "gpu": gpu_markdown,
    "gpu_causal": gpu_causal_markdown,
    "loading": loading_markdown,
    "checkpoint": checkpoint_markdown,
}

if __name__ == "__main__":
    sys.exit(main())
