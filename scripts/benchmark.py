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
"""

import argparse
import csv
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
from utils.data.cache import load_wikihow  # noqa: E402
from utils.data.wikihow import clean_text  # noqa: E402

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
    },
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


# Run on a GPU only: refused on a CPU group (fp16, offload), or minutes of C++ compilation there (compile).
GPU_ONLY = {"--use_fp16", "--fsdp_cpu_offload", "--compile"}
BARE_FSDP1 = "bare torch FSDP1 loop, same wrap"  # the peers suite's baseline, per model
PEERS_OF_SUITE = {
    "peers": {
        BARE_FSDP1: ["--framework", "fsdp"],
        "bare DDP": ["--framework", "ddp"],
        "HF Seq2SeqTrainer (DDP)": ["--framework", "hf_trainer"],
    },
    "gpu": {"unwrapped model, bf16 autocast": ["--framework", "plain", "--precision", "bf16"]},
}


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
    steps: int,
    batch: int,
    common: list[str],
    work: Path,
    deadline: float | None = None,
) -> dict:
    out = work / f"run{len(list(work.iterdir()))}"
    accumulation = int(case_args[case_args.index("--gradient_accumulation_steps") + 1]) if (
        "--gradient_accumulation_steps" in case_args) else 1  # fmt: skip
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
        "--num_train_samples",
        str(steps * batch * nproc * accumulation),
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
    windows = [r["seconds"] for r in records if r["type"] == "step"][2:]  # first window: warm-up
    epoch = next(r for r in records if r["type"] == "epoch")
    memory = [r for r in records if r["type"] == "memory"]
    total = memory[0]["param_numel_total"]
    return {
        "step_times": {r["step"]: r["seconds"] for r in records if r["type"] == "step"},
        "saves": checkpoint_saves(done.stdout),
        "step_seconds": statistics.median(windows),
        "samples_per_s": epoch["samples_per_s"],
        "tokens_per_s": epoch["tokens_per_s"],  # real (non-padding) source + target tokens, all ranks
        "mfu": epoch.get("mfu"),
        "train_loss": epoch["train_loss"],
        "peak_tflops": json.loads((out / "config.json").read_text())["mfu_peak_tflops"],
        "peak_memory_bytes": epoch["peak_memory_bytes"],
        "param_share": max(r["param_numel_local"] for r in memory) / total,
        "optim_share": max(r["optim_state_numel_local"] for r in memory) / (2 * total),  # AdamW: 2 moments
        "param_numel_total": total,
        "load_rss_delta_bytes": [r["load_rss_delta_bytes"] for r in memory],  # by rank
    }


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


def model_folder(name: str, work: Path) -> str:
    if name == "embedded":
        return str(EMBEDDED_MODEL_DIR)
    folder = work / f"{name}-random"
    if not folder.exists():
        make(name, str(folder))
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
    parser.add_argument("--models", nargs="+", default=["embedded"], choices=["embedded", *sorted(SHAPES)])
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: 1 for the gpu suite, else 2)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8], help="data suite: the numbers of ranks")
    parser.add_argument("--rows", type=int, default=FULL_SIZE_ROWS, help="data suite: rows of the generated file")
    parser.add_argument(
        "--wikihow_dir",
        help="data suite: where the full-size file is generated, or reused (default <out>/wikihow_full)",
    )
    parser.add_argument("--repo", help="data suite: run this checkout's T5_training.py instead (the control)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per case")
    parser.add_argument(
        "--batch_size", type=int, default=4, help="training batch per rank of every case and peer (default 4)"
    )
    parser.add_argument("--max_source_length", type=int, default=128)
    parser.add_argument("--max_target_length", type=int, default=32)
    parser.add_argument(
        "--data",
        choices=["embedded", "wikihow_lengths", "full_lengths"],
        default=None,
        help=(
            "embedded: the embedded sample; wikihow_lengths: a sample with WikiHow's article and summary "
            "lengths; full_lengths: every article and summary longer than the max lengths (fixed shapes, as "
            "the peers suite's random batches). Default: full_lengths for the peers and gpu suites (their rates "
            "count every position as a token), else embedded"
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
    known = set(SUITES[args.suite]) | (set(EXPORT_CASE_NAMES) if args.suite == "checkpoint" else set())
    unknown = sorted(set(args.cases or []) - known)
    if unknown:
        parser.error(f"--suite {args.suite} has no case {unknown}; its cases: {sorted(known)}")
    first_case = next(iter(SUITES[args.suite]))
    if args.cases and args.suite in PEERS_OF_SUITE and first_case not in args.cases:
        parser.error(f"--suite {args.suite} rates its peers against its first case: add {first_case!r} to --cases")
    args.nproc = args.nproc or (1 if args.suite == "gpu" else 2)
    args.data = args.data or ("full_lengths" if args.suite in PEERS_OF_SUITE else "embedded")
    if args.suite in PEERS_OF_SUITE and args.data != "full_lengths":
        parser.error(f"--suite {args.suite} rates fixed shapes: it needs --data full_lengths")
    if args.suite == "gpu" and args.nproc != 1:
        parser.error("--suite gpu measures one device: --nproc 1")
    wanted = args.steps * args.batch_size * args.nproc
    if args.data == "embedded" and args.suite != "data" and wanted > len(load_wikihow(EMBEDDED_DATA_DIR, "train")):
        parser.error(
            f"--steps x --batch_size x --nproc = {wanted} samples, more than the embedded sample's train split: "
            "use --data wikihow_lengths or full_lengths (generated with as many rows as needed)"
        )
    if args.suite == "data":
        with tempfile.TemporaryDirectory() as tmp:
            results = run_data_suite(args, Path(tmp))
        return write_results(args, results, data_markdown(results))
    common = [
        "--max_source_length",
        str(args.max_source_length),
        "--max_target_length",
        str(args.max_target_length),
        "--mixed_precision",
        args.mixed_precision,
    ]
    if args.dropout_rate is not None:
        common += ["--dropout_rate", str(args.dropout_rate)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "runs").mkdir()
        if args.data != "embedded":
            # full_lengths: about 400 and 100 tokens, past the max lengths the fixed-shape suites use
            # (short enough that tokenizing them costs the same as tokenizing WikiHow's articles).
            means, sigma = ((500, 46), 0.6) if args.data == "wikihow_lengths" else ((300, 80), 0.0)
            # Rows for every case's samples (up to 4 micro-batches a step), about 9 in 10 of them in train.
            rows = max(1600, 2 * args.steps * args.batch_size * args.nproc * 4)
            common += ["--data_dir", wikihow_length_sample(work / "data", means, sigma, rows)]
        results = []
        for model in args.models:
            results += run_suite(model, args, common, work)
            if model != args.models[-1]:  # what a later model's kill would otherwise take with it
                write_results(args, results, SUITE_TABLES.get(args.suite, markdown)(results))
        if args.suite == "checkpoint":
            for model in args.models:
                exported = measure_exports(model_folder(model, work), args.nproc, work, args.cases)
                results += [{"model": model, "export": True, **result} for result in exported]
    return write_results(args, results, SUITE_TABLES.get(args.suite, markdown)(results))


def write_results(args, results: list[dict], table: str) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {name: value for name, value in vars(args).items() if name not in ("failures", "deadline")}
    summary = {"settings": settings, "results": results, "failed": args.failures}
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    if args.failures:
        listed = "".join(f"- {f['model']}, {f['case']}: {f['error']}\n" for f in args.failures)
        table += "\nFailed cases:\n" + listed
    (out / "results.md").write_text(table)
    print(f"\n{table}\nwritten: {out / 'results.json'}, {out / 'results.md'}")
    return 1 if args.failures else 0


def run_suite(model: str, args, common: list[str], work: Path) -> list[dict]:
    """Every case of the suite for one model (GPU-only ones only on a GPU), then its peers, all rated alike."""
    folder = model_folder(model, work)
    results = []
    for case, case_args in SUITES[args.suite].items():
        if args.cases and case not in args.cases:
            continue
        if GPU_ONLY & set(case_args) and not torch.cuda.is_available():
            print(f"{model} | {case} | skipped: needs a GPU", flush=True)
            continue
        if over_budget(args, model, case):
            continue
        try:
            result = run_case(folder, case_args, args.nproc, args.steps, args.batch_size, common, work / "runs",
                              deadline=args.deadline)  # fmt: skip
        except CaseFailed as failure:
            report_failure(model, case, failure, args)
            continue
        results.append({"model": model, "case": case, **result, **planner_bytes(folder, case_args, args)})
        peak = max(result["peak_memory_bytes"]) / 2**20
        # the whole row as it comes: a suite cut off by a time limit keeps what it measured in its log
        print(f"{model} | {case} | {result['step_seconds']:.3f} s/step | peak {peak:.0f} MiB", flush=True)
    for case, peer_args in PEERS_OF_SUITE.get(args.suite, {}).items():
        if over_budget(args, model, case):
            continue
        try:
            results.append({"model": model, "case": case, **run_peer(folder, peer_args, args, work / "runs")})
        except CaseFailed as failure:
            report_failure(model, case, failure, args)
            continue
        print(f"{model} | {case} | {results[-1]['step_seconds']:.3f} s/step", flush=True)
    if args.suite in PEERS_OF_SUITE:
        # Each of this package's rows against the peak of its own compute dtype (its config.json); the peers
        # against the first row's (fp32 for the peers suite, bf16 for the gpu suite's bf16 unwrapped model);
        # no MFU for them if every case of the package failed.
        reference_peak = next((r["peak_tflops"] for r in results if "peak_tflops" in r), None)
        for result in results:
            result.update(fixed_shape_rates(result, folder, args, result.get("peak_tflops") or reference_peak))
    return results


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


# Each suite's table (markdown for the others).
SUITE_TABLES = {
    "peers": peers_markdown,
    "gpu": gpu_markdown,
    "loading": loading_markdown,
    "checkpoint": checkpoint_markdown,
}

if __name__ == "__main__":
    sys.exit(main())
