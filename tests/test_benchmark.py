"""scripts/benchmark.py --suite gpu at tiny scale on CPU, so the GPU measurement cannot rot unseen: every
case of every suite is a valid command line for a GPU run; the gpu suite's first case and its peer run
through torchrun (the FSDP2 case is the same command with one more flag), a GPU-only case is skipped with
a note, and every row has a step time, a rate, an MFU and a planner figure."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from configs.cli import parse_args
from configs.paths import REPO_ROOT
from configs.validate import check_settings
from scripts import benchmark
from scripts.benchmark import GPU_ONLY, PEERS_OF_SUITE, SUITES

RUN_CASES = ["bf16, FSDP1", "bf16, no FSDP (one rank)", "fp16 + scaler, FSDP1"]  # the last: skipped on CPU


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_every_case_is_a_valid_gpu_run(suite):
    for flags in SUITES[suite].values():
        check_settings(parse_args(flags), 1 if suite == "gpu" else 2, "cuda")  # ConfigError if refused


@pytest.mark.slow
def test_gpu_suite_runs_at_tiny_scale_on_cpu(tmp_path):
    command = [sys.executable, "scripts/benchmark.py", "--suite", "gpu", "--steps", "3", "--cases", *RUN_CASES,
               "--batch_size", "2", "--max_source_length", "32", "--max_target_length", "8",
               "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    chosen = [case for case in SUITES["gpu"] if case in RUN_CASES]  # in the suite's order
    runnable = [case for case in chosen if not GPU_ONLY & set(SUITES["gpu"][case])]
    skipped = [case for case in chosen if case not in runnable]
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["case"] for r in results] == runnable + list(PEERS_OF_SUITE["gpu"])
    assert skipped and all(f"{case} | skipped: needs a GPU" in done.stdout for case in skipped)
    for r in results:
        assert r["step_seconds"] > 0 and 0 < r["mfu"] < 1, r
        assert r["tokens_per_s"] == pytest.approx(2 * (32 + 8) / r["step_seconds"]), r  # --batch_size 2
        assert len(r["peak_memory_bytes"]) == 1, r  # one device
    unwrapped = [case for case in runnable if "no FSDP" in case]  # the planner plans FSDP: none for these
    assert unwrapped
    assert all(("planner_bytes" in r) == (r["case"] not in unwrapped) for r in results if r["case"] in runnable)
    table = (tmp_path / "results.md").read_text()
    assert all(f"| {r['case']} |" in table for r in results)


@pytest.mark.parametrize(
    "cases, phrase",
    [(["bf16, FSDP3"], "its cases: ['bf16, FSDP1'"), (["fp32, FSDP1"], "add 'bf16, FSDP1' to --cases")],
)
def test_cases_that_are_unknown_or_leave_the_peers_without_their_baseline_are_refused(
    monkeypatch, capsys, cases, phrase
):
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--suite", "gpu", "--cases", *cases])
    with pytest.raises(SystemExit) as stopped:
        benchmark.main()
    assert stopped.value.code == 2 and phrase in capsys.readouterr().err


def test_the_peers_table_rates_each_row_against_its_own_models_bare_loop():
    def row(model, case, seconds):
        return {"model": model, "case": case, "step_seconds": seconds, "tokens_per_s": 1.0, "mfu": None,
                "peak_memory_bytes": [2**20]}  # fmt: skip

    table = benchmark.peers_markdown([
        row("t5-small", benchmark.BARE_FSDP1, 1.0), row("t5-small", "bf16, FSDP1", 2.0),
        row("t5-base", benchmark.BARE_FSDP1, 4.0), row("t5-base", "bf16, FSDP1", 2.0),
        row("t5-large", "bare DDP", 3.0),
    ])  # fmt: skip
    rows = ([cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:])
    ratios = {(model, case): ratio for model, case, _, ratio, *_ in rows}
    assert ratios == {
        ("t5-small", benchmark.BARE_FSDP1): "1.000x", ("t5-small", "bf16, FSDP1"): "2.000x",
        ("t5-base", benchmark.BARE_FSDP1): "1.000x", ("t5-base", "bf16, FSDP1"): "0.500x",
        ("t5-large", "bare DDP"): "-",  # no bare loop measured for it
    }, table  # fmt: skip


def test_the_data_suites_full_size_file_has_the_real_files_format_and_is_reused(tmp_path):
    """scripts/benchmark.py --suite data's generator at 2,000 rows: the real header, CRLF line ends inside
    quoted fields, split lists of the published proportions that the reader accepts; a second call reuses
    the file."""
    from utils.data.cache import load_wikihow
    from utils.data.wikihow import clean_text

    folder = benchmark.full_size_wikihow(tmp_path / "wikihow", rows=2000)
    content = (folder / "wikihowAll.csv").read_bytes()
    assert content.startswith(b"headline,title,text\r\n")
    assert content.count(b"\r\n") > 10 * 2000 and b"\r\n," in content  # paragraphs joined by "\r\n," inside quotes
    listed = {name: (folder / name).read_text().split() for name in benchmark.PUBLISHED_SPLITS}
    assert {name: len(titles) for name, titles in listed.items()} == {
        name: size * 2000 // benchmark.FULL_SIZE_ROWS for name, size in benchmark.PUBLISHED_SPLITS.items()
    }
    train = load_wikihow(folder, "train")
    assert 0.9 * len(listed["all_train.txt"]) < len(train) <= len(listed["all_train.txt"])
    assert not any("\r" in text for text in train["text"])
    mtime = (folder / "wikihowAll.csv").stat().st_mtime_ns
    benchmark.full_size_wikihow(tmp_path / "wikihow", rows=2000)
    assert (folder / "wikihowAll.csv").stat().st_mtime_ns == mtime
    # The same splits as JSON-lines files of your own: the rows the WikiHow path trains on.
    json_lines = benchmark.full_size_json_lines(folder)
    rows = [json.loads(line) for line in (json_lines / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [row["id"] for row in rows] == train["title"]
    assert rows[0]["document"] == clean_text(train[0]["text"]) and rows[0]["summary"] == clean_text(
        train[0]["headline"]
    )


def test_a_failed_case_is_listed_with_the_packages_error_line_and_the_suite_goes_on(capsys):
    """On a GPU one case running out of memory must not lose the others: run_suite records it and goes on;
    the line listed is the package's ERROR line, not torchrun's report that points to it."""
    args = type("Args", (), {"failures": []})()
    stdout = "[rank 0] INFO model ...\n[rank 0] ERROR failed: CUDA out of memory. Tried to allocate 11.72 GiB\n"
    stderr = "...\n  traceback : the cause is the [rank 0] ERROR line above this report\n=====\n"
    benchmark.report_failure("t5-large", "fp32, FSDP1", benchmark.CaseFailed(stdout, stderr), args)
    assert args.failures == [
        {"model": "t5-large", "case": "fp32, FSDP1", "error": "[rank 0] ERROR failed: CUDA out of memory. "
         "Tried to allocate 11.72 GiB"}
    ]  # fmt: skip
    assert "t5-large | fp32, FSDP1 | FAILED" in capsys.readouterr().out
    benchmark.report_failure("t5-large", "bf16, FSDP1", benchmark.CaseFailed("", "Killed\n\n"), args)
    assert args.failures[-1]["error"] == "Killed"


# A stand-in for torchrun: its rank runs in a session of its own (out of reach of a signal to torchrun's group),
# and SIGTERM closes the rank, as torchrun's does.
TORCHRUN_STAND_IN = """
import os, signal, subprocess, sys
rank = subprocess.Popen(["sleep", "120"], start_new_session=True)
open(sys.argv[1], "w").write(str(rank.pid))
signal.signal(signal.SIGTERM, lambda *_: (os.kill(rank.pid, signal.SIGKILL), os._exit(143)))
rank.wait()
"""


def test_a_case_past_the_deadline_is_stopped_with_its_ranks(tmp_path):
    """run_by_deadline: a torchrun still running at the deadline is stopped, and with it the rank it started
    (which would otherwise hold the GPU and the output pipes), and the case fails as over the budget."""
    rank_pid = tmp_path / "rank.pid"
    started = time.monotonic()
    with pytest.raises(benchmark.CaseFailed) as failed:
        benchmark.run_by_deadline([sys.executable, "-c", TORCHRUN_STAND_IN, str(rank_pid)], started + 1)
    assert failed.value.reason == "stopped: over the time budget (--time_budget_s)"
    # Long before the rank's own end: a kill that missed the rank would wait for its 120 s (the pipes it holds).
    assert time.monotonic() - started < 60
    pid = int(rank_pid.read_text())
    for _ in range(50):  # the rank is killed before its torchrun exits; its end may take a moment to show
        if not running(pid):
            break
        time.sleep(0.1)
    assert not running(pid)


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (Linux's /proc)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_spent_time_budget_skips_every_case_left_and_writes_what_was_measured(tmp_path, monkeypatch, capsys):
    # In this process: a spent budget starts nothing (the other tests here run the cases through torchrun).
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--suite", "gpu", "--steps", "3", "--cases", *RUN_CASES,
                                      "--batch_size", "2", "--max_source_length", "32", "--max_target_length", "8",
                                      "--time_budget_s", "0", "--out", str(tmp_path)])  # fmt: skip
    code, done = benchmark.main(), capsys.readouterr()
    assert code == 1, done.out[-3000:] + done.err[-3000:]
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["results"] == []
    runnable = [case for case in SUITES["gpu"] if case in RUN_CASES and not GPU_ONLY & set(SUITES["gpu"][case])]
    skipped = runnable + list(PEERS_OF_SUITE["gpu"])
    assert [(f["case"], f["error"]) for f in summary["failed"]] == [
        (case, "skipped: --time_budget_s spent") for case in skipped
    ]
    assert all(f"| {case} | skipped: the time budget is spent" in done.out for case in skipped)
