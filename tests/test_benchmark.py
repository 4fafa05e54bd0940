"""scripts/benchmark.py --suite gpu at tiny scale on CPU, so the GPU measurement cannot rot unseen: every
case that can run on CPU runs through torchrun, the GPU-only ones are skipped with a note, and every row
has a step time, a rate, an MFU and a planner figure."""

import json
import subprocess
import sys

import pytest

from configs.paths import REPO_ROOT
from scripts.benchmark import GPU_ONLY, PEERS_OF_SUITE, SUITES


@pytest.mark.slow
def test_gpu_suite_runs_at_tiny_scale_on_cpu(tmp_path):
    command = [sys.executable, "scripts/benchmark.py", "--suite", "gpu", "--steps", "3",
               "--max_source_length", "32", "--max_target_length", "8", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runnable = [case for case, flags in SUITES["gpu"].items() if not GPU_ONLY & set(flags)]
    skipped = [case for case in SUITES["gpu"] if case not in runnable]
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["case"] for r in results] == runnable + list(PEERS_OF_SUITE["gpu"])
    assert skipped and all(f"{case} | skipped: needs a GPU" in done.stdout for case in skipped)
    for r in results:
        assert r["step_seconds"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1, r
        assert len(r["peak_memory_bytes"]) == 1, r  # one device
    assert all("planner_bytes" in r for r in results if r["case"] in runnable)
    table = (tmp_path / "results.md").read_text()
    assert all(f"| {r['case']} |" in table for r in results)
