"""Step time and peak memory of training configurations, measured through torchrun; JSON + markdown table.

    python scripts/benchmark.py --suite backends --models embedded t5-small --nproc 2 --out bench/

Each case is one short run of T5_training.py (one epoch, no validation, no checkpoints) on the embedded
sample. Step time is the median of the logged step windows after the first (warm-up) window; peak memory
is each rank's peak from the epoch record (peak RSS on CPU, CUDA peak allocated on GPU). Models other than
`embedded` are random-weight folders of the published shapes, made by scripts/make_random_t5.py.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.make_random_t5 import SHAPES, make  # noqa: E402
from utils.paths import EMBEDDED_MODEL_DIR, REPO_ROOT  # noqa: E402

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
    "strategies": {
        "FULL_SHARD": ["--sharding_strategy", "FULL_SHARD"],
        "SHARD_GRAD_OP": ["--sharding_strategy", "SHARD_GRAD_OP"],
        "NO_SHARD": ["--sharding_strategy", "NO_SHARD"],
    },
}


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
        "peak_memory_bytes": epoch["peak_memory_bytes"],
        "param_share": max(r["param_numel_local"] for r in memory) / total,
        "optim_share": max(r["optim_state_numel_local"] for r in memory) / (2 * total),  # AdamW: 2 moments
        "param_numel_total": total,
    }


def model_folder(name: str, work: Path) -> str:
    if name == "embedded":
        return str(EMBEDDED_MODEL_DIR)
    folder = work / f"{name}-random"
    if not folder.exists():
        make(name, str(folder))
    return str(folder)


def markdown(results: list[dict]) -> str:
    lines = [
        "| model | case | step time (s) | samples/s | peak RSS per rank (MiB) | params held | AdamW state held |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in r["peak_memory_bytes"])
        lines.append(
            f"| {r['model']} | {r['case']} | {r['step_seconds']:.3f} | {r['samples_per_s']:.1f} | {peaks} "
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
    parser.add_argument("--mixed_precision", choices=["true", "false"], default="false")
    parser.add_argument("--out", default="bench", help="folder for results.json and results.md")
    args = parser.parse_args()
    common = [
        "--max_source_length",
        str(args.max_source_length),
        "--max_target_length",
        "32",
        "--mixed_precision",
        args.mixed_precision,
    ]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "runs").mkdir()
        for model in args.models:
            folder = model_folder(model, work)
            for case, case_args in SUITES[args.suite].items():
                result = run_case(folder, case_args, args.nproc, args.steps, common, work / "runs")
                results.append({"model": model, "case": case, **result})
                print(markdown(results[-1:]).splitlines()[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"settings": vars(args), "results": results}, indent=1))
    (out / "results.md").write_text(markdown(results))
    print(f"\n{markdown(results)}\nwritten: {out / 'results.json'}, {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
