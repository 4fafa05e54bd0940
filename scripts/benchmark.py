"""Step time and peak memory of training configurations, measured through torchrun; JSON + markdown table.

    python scripts/benchmark.py --suite backends --models embedded t5-small --nproc 2 --out bench/
    python scripts/benchmark.py --suite datapath --data wikihow_lengths --max_source_length 512 \
        --max_target_length 150 --out bench/datapath
    python scripts/benchmark.py --suite peers --models t5-small --data full_lengths \
        --max_source_length 256 --max_target_length 64 --out bench/peers

Each case is one short run of T5_training.py (one epoch, no validation, no checkpoints) on the embedded
sample, or on a generated one (--data). Step time is the median of the logged step windows after the
first (warm-up) window; peak memory is each rank's peak from the epoch record (peak RSS on CPU, CUDA peak
allocated on GPU). Models other than `embedded` are random-weight folders of the published shapes, made by
scripts/make_random_t5.py. The peers suite also runs scripts/peers.py (bare FSDP1, bare DDP, HF
Seq2SeqTrainer) on the same shapes, and rates every row with the same FLOP count and peak.
"""

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.make_random_t5 import SHAPES, make  # noqa: E402
from utils.paths import EMBEDDED_DATA_DIR, EMBEDDED_MODEL_DIR, REPO_ROOT  # noqa: E402

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
    "peers": {
        "this package, FSDP1, defaults": ["--fsdp_version", "1"],
        "this package, FSDP2, defaults": ["--fsdp_version", "2"],
        "this package, FSDP1, tutorial settings": ["--fsdp_version", "1", "--pad_to_max_length", "true"],
    },
    "strategies": {
        "FULL_SHARD": ["--sharding_strategy", "FULL_SHARD"],
        "SHARD_GRAD_OP": ["--sharding_strategy", "SHARD_GRAD_OP"],
        "NO_SHARD": ["--sharding_strategy", "NO_SHARD"],
    },
}


PEERS = {
    "bare torch FSDP1 loop, same wrap": "fsdp",
    "bare DDP": "ddp",
    "HF Seq2SeqTrainer (DDP)": "hf_trainer",
}


def run_peer(model_dir: str, framework: str, args, work: Path) -> dict:
    """One scripts/peers.py run: step time and peak memory per rank."""
    out = work / f"peer{len(list(work.iterdir()))}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--standalone",
               str(REPO_ROOT / "scripts" / "peers.py"), "--framework", framework, "--model_name", model_dir,
               "--steps", str(args.steps), "--source_length", str(args.max_source_length),
               "--target_length", str(args.max_target_length), "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"peer failed: {framework}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    return {"step_seconds": result["step_seconds"], "peak_memory_bytes": result["peak_memory_bytes"]}


def fixed_shape_rates(result: dict, model_dir: str, args, peak_tflops: float) -> dict:
    """Tokens/s and MFU of a fixed-shape step (every position a real token), the same count for every row."""
    from transformers import T5Config

    from utils.observe.flops import T5Flops

    batch = {
        "source_mask": torch.ones(4, args.max_source_length),
        "target_mask": torch.ones(4, args.max_target_length),
    }
    flops = T5Flops.from_config(T5Config.from_pretrained(model_dir)).training(batch, recompute=False)[0].item()
    seconds = result["step_seconds"]
    tokens = 4 * (args.max_source_length + args.max_target_length)
    return {"tokens_per_s": args.nproc * tokens / seconds, "mfu": flops / seconds / (peak_tflops * 1e12)}


def peers_markdown(results: list[dict]) -> str:
    bare = next((r["step_seconds"] for r in results if r["case"] == "bare torch FSDP1 loop, same wrap"), None)
    lines = [
        "| model | framework | step time (s) | vs bare FSDP1 | tokens/s (all ranks) | MFU "
        "| peak memory per rank (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        ratio = f"{r['step_seconds'] / bare:.3f}x" if bare else "-"
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in r["peak_memory_bytes"])
        lines.append(
            f"| {r['model']} | {r['case']} | {r['step_seconds']:.3f} | {ratio} | {r['tokens_per_s']:.0f} "
            f"| {r['mfu']:.1%} | {peaks} |"
        )
    return "\n".join(lines) + "\n"


def run_case(model_dir: str, case_args: list[str], nproc: int, steps: int, common: list[str], work: Path) -> dict:
    out = work / f"run{len(list(work.iterdir()))}"
    batch = 4
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
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"case failed: {' '.join(case_args)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in open(out / "metrics.jsonl", encoding="utf-8")]
    windows = [r["seconds"] for r in records if r["type"] == "step"][2:]  # first window: warm-up
    epoch = next(r for r in records if r["type"] == "epoch")
    memory = [r for r in records if r["type"] == "memory"]
    total = memory[0]["param_numel_total"]
    return {
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
    }


def wikihow_length_sample(
    folder: Path, means: tuple[int, int] = (500, 46), rows: int = 1600, seed: int = 0
) -> str:
    """A data folder in WikiHow's format whose article and summary lengths have the given mean word counts
    (default: WikiHow's published means, articles about 500 words, summaries about 46), made from the
    embedded sample's sentences.

    Lengths are log-normal with those means (sigma 0.6), scaled by 1.3 / 2.0: t5's tokenizer makes about
    1.3 tokens of a word, the embedded tokenizer about 2, so token counts, which set the cost, match
    WikiHow's under t5. No published lists: the reader splits by title hash.
    """
    frame = pd.read_csv(EMBEDDED_DATA_DIR / "wikihowAll.csv")
    texts, headlines = frame["text"].dropna().tolist(), frame["headline"].dropna().tolist()
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
        return rng.lognormvariate(math.log(mean_words * 1.3 / 2.0) - 0.6**2 / 2, 0.6)

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


def model_folder(name: str, work: Path) -> str:
    if name == "embedded":
        return str(EMBEDDED_MODEL_DIR)
    folder = work / f"{name}-random"
    if not folder.exists():
        make(name, str(folder))
    return str(folder)


def markdown(results: list[dict]) -> str:
    lines = [
        "| model | case | step time (s) | samples/s | real tokens/s | MFU | train loss | peak RSS per rank (MiB) "
        "| params held | AdamW state held |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in r["peak_memory_bytes"])
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(
            f"| {r['model']} | {r['case']} | {r['step_seconds']:.3f} | {r['samples_per_s']:.1f} "
            f"| {r['tokens_per_s']:.0f} | {mfu} | {r['train_loss']:.4f} | {peaks} "
            f"| {r['param_share']:.3f} | {r['optim_share']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="backends")
    parser.add_argument("--models", nargs="+", default=["embedded"], choices=["embedded", *sorted(SHAPES)])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per case")
    parser.add_argument("--max_source_length", type=int, default=128)
    parser.add_argument("--max_target_length", type=int, default=32)
    parser.add_argument(
        "--data",
        choices=["embedded", "wikihow_lengths", "full_lengths"],
        default="embedded",
        help=(
            "embedded: the embedded sample; wikihow_lengths: a sample with WikiHow's article and summary "
            "lengths; full_lengths: every article and summary longer than the max lengths (fixed shapes, as "
            "the peers suite's random batches)"
        ),
    )
    parser.add_argument("--mixed_precision", choices=["true", "false"], default="false")
    parser.add_argument("--out", default="bench", help="folder for results.json and results.md")
    args = parser.parse_args()
    common = [
        "--max_source_length",
        str(args.max_source_length),
        "--max_target_length",
        str(args.max_target_length),
        "--mixed_precision",
        args.mixed_precision,
    ]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "runs").mkdir()
        if args.data != "embedded":
            means = (500, 46) if args.data == "wikihow_lengths" else (4000, 1000)
            common += ["--data_dir", wikihow_length_sample(work / "data", means)]
        results = [result for model in args.models for result in run_suite(model, args, common, work)]
    table = peers_markdown(results) if args.suite == "peers" else markdown(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"settings": vars(args), "results": results}, indent=1))
    (out / "results.md").write_text(table)
    print(f"\n{table}\nwritten: {out / 'results.json'}, {out / 'results.md'}")
    return 0


def run_suite(model: str, args, common: list[str], work: Path) -> list[dict]:
    """Every case of the suite for one model; for peers, then every peer, all rated alike."""
    folder = model_folder(model, work)
    results = []
    for case, case_args in SUITES[args.suite].items():
        result = run_case(folder, case_args, args.nproc, args.steps, common, work / "runs")
        results.append({"model": model, "case": case, **result})
        print(f"{model} | {case} | {result['step_seconds']:.3f} s/step", flush=True)
    if args.suite == "peers":
        for case, framework in PEERS.items():
            results.append({"model": model, "case": case, **run_peer(folder, framework, args, work / "runs")})
            print(f"{model} | {case} | {results[-1]['step_seconds']:.3f} s/step", flush=True)
        peak = results[0]["peak_tflops"]  # this package's probe (or table), the same for every row
        for result in results:
            result.update(fixed_shape_rates(result, folder, args, peak))
    return results


if __name__ == "__main__":
    sys.exit(main())
