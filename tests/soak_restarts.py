"""Repeat the torchrun restart tests: each case of tests/reference_run.py's RESTART_CASES, N times, against
one uninterrupted reference run. A restart that works one time in six (what the hang looked like) passes a
single test now and then; ten in a row is the evidence. Not part of pytest (minutes per case).

    .venv/bin/python -m tests.soak_restarts --repeat 10 [--case fsdp1-full ...] [--out /tmp/soak]

Prints one row per run: the case, torchrun's exit status (the worst of its agents), the step at which the
killed rank died, the checkpoint the restart continued from, and the largest relative per-step loss
difference against the reference; then how many of each case finished with the reference's losses.
"""

import argparse
import re
import tempfile
import time
from pathlib import Path

from scripts.compare_step_losses import step_losses
from tests.reference_run import KILL_STEP, RESTART_CASES, TOTAL_STEPS, restart_run, train_reference

CONTINUED = re.compile(r"torchrun restart \d+ of this run: continuing from (\S+)")
TOLERANCE = 1e-5


def soak(case: str, index: int, root: Path, reference: dict[int, float]) -> bool:
    folder = root / f"{case}-{index}"
    folder.mkdir()
    start = time.monotonic()
    agents, killed = restart_run(folder / "out", case)
    output = "".join(agent.output for agent in agents)
    status = max(agent.returncode for agent in agents)
    continued = sorted({Path(path).name for path in CONTINUED.findall(output)}) or ["-"]
    losses = step_losses(str(folder / "out")) if (folder / "out" / "metrics.jsonl").is_file() else {}
    complete = sorted(losses) == list(range(1, TOTAL_STEPS + 1))
    worst = max((abs(losses[s] - reference[s]) / abs(reference[s]) for s in losses), default=float("nan"))
    ok = status == 0 and killed and complete and worst <= TOLERANCE
    print(
        f"| {case} | {index} | {status} | {KILL_STEP if killed else 'no kill'} | {', '.join(continued)} "
        f"| {worst:.1e} | {time.monotonic() - start:.0f} s | {'ok' if ok else 'FAILED: see ' + str(folder)} |",
        flush=True,
    )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="runs per case")
    parser.add_argument("--case", action="append", choices=list(RESTART_CASES), help="default: every case")
    parser.add_argument("--out", type=Path, help="where the runs go (default: a new temporary folder)")
    options = parser.parse_args()
    root = options.out or Path(tempfile.mkdtemp(prefix="soak_restarts_"))
    root.mkdir(parents=True, exist_ok=True)
    reference = step_losses(str(train_reference(root / "reference" / "out")))
    print("| case | run | exit | killed after step | continued from | max rel. loss diff | time | result |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    finished = {}
    for case in options.case or list(RESTART_CASES):
        finished[case] = sum(soak(case, index, root, reference) for index in range(1, options.repeat + 1))
    for case, count in finished.items():
        print(f"{case}: {count} of {options.repeat} finished with the reference's losses")
    raise SystemExit(0 if all(count == options.repeat for count in finished.values()) else 1)


if __name__ == "__main__":
    main()
