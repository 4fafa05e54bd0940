"""Compare the per-step losses of several runs (their metrics.jsonl) against the first one.

    python scripts/compare_step_losses.py outputs/full_shard outputs/no_shard --rtol 1e-4

Prints the largest relative difference of each run from the first and exits 1 if any exceeds --rtol or the
runs have different steps. Used to check that sharding strategies, activation checkpointing (and later
backends or a resumed run) train identically.
"""

import argparse
import json
import sys
from pathlib import Path


def step_losses(run_dir: str) -> dict[int, float]:
    """{global step: loss} from run_dir/metrics.jsonl (a later record of a step replaces an earlier one)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist: is {run_dir!r} an output_dir of T5_training.py?")
    losses = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if record.get("type") == "step":
                losses[record["step"]] = record["loss"]
    return losses


def max_relative_difference(losses: dict[int, float], reference: dict[int, float]) -> float:
    return max(abs(losses[s] - reference[s]) / max(abs(reference[s]), 1e-12) for s in reference)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="output_dir of each run; the first is the reference")
    parser.add_argument("--rtol", type=float, default=1e-4, help="largest allowed relative difference")
    args = parser.parse_args(argv)
    reference = step_losses(args.runs[0])
    print(f"{args.runs[0]}: {len(reference)} steps (reference)")
    ok = True
    for run in args.runs[1:]:
        losses = step_losses(run)
        if losses.keys() != reference.keys():
            print(f"{run}: steps differ from the reference ({len(losses)} vs {len(reference)})")
            ok = False
            continue
        diff = max_relative_difference(losses, reference)
        verdict = "ok" if diff <= args.rtol else "DIFFERENT"
        print(f"{run}: {len(losses)} steps, max relative difference {diff:.2e} ({verdict})")
        ok = ok and diff <= args.rtol
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
