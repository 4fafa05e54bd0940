"""scripts/benchmark.py --suite gpu and --suite gpu_causal at tiny scale on CPU, so the GPU measurements cannot
rot unseen: every case of every suite is a valid command line for a GPU run; the gpu suite's first case and its
peer run through torchrun (the FSDP2 case is the same command with one more flag), the gpu_causal suite's first
case and its HF Trainer peer on the same rows, a GPU-only case is skipped with a note, and every row has a step
time, a rate, an MFU (and a planner figure, or the graphs compiled)."""

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
from scripts.benchmark import CAUSAL_DATA, GPU_ONLY, PEERS_OF_SUITE, SUITES

RUN_CASES = ["bf16, FSDP1", "bf16, no FSDP (one rank)", "fp16 + scaler, FSDP1"]  # the last: skipped on CPU


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_every_case_is_a_valid_gpu_run(suite):
    data = [*CAUSAL_DATA, "--max_seq_len", "2048"] if suite == "gpu_causal" else []
    for flags in SUITES[suite].values():
        # ConfigError if refused; (9, 0): an H100/H200, where float8 runs
        check_settings(parse_args([*data, *flags]), 1 if suite.startswith("gpu") else 2, "cuda", (9, 0))


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
    # the first case, its peer, the other cases: the comparison first, where a time budget may cut the suite
    assert [r["case"] for r in results] == runnable[:1] + list(PEERS_OF_SUITE["gpu"]) + runnable[1:]
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
    skipped = runnable[:1] + list(PEERS_OF_SUITE["gpu"]) + runnable[1:]
    assert [(f["case"], f["error"]) for f in summary["failed"]] == [
        (case, "skipped: --time_budget_s spent") for case in skipped
    ]
    assert all(f"| {case} | skipped: the time budget is spent" in done.out for case in skipped)


CAUSAL_FIRST = next(iter(SUITES["gpu_causal"]))  # SDPA's dense document mask: the peers' reference
CAUSAL_PEER = "HF Trainer, sdpa, flattened rows"


@pytest.mark.slow  # two launches, torchrun's and the peer's (imports, the tiny Llama): 25-80 s with the load
def test_gpu_causal_suite_and_its_hf_trainer_peer_train_on_the_same_rows_at_tiny_scale_on_cpu(tmp_path):
    """The package's SDPA case and HF's Trainer on the same packed rows (llama-tiny, blocks of 256 tokens, 2 a
    step): each step of the peer reads exactly the real tokens of the package's step (its own count against the
    package's step records) and is rated by the same FLOP count; the GPU-only cases and peers are listed as not
    run here, and no graph is compiled."""
    command = [sys.executable, "scripts/benchmark.py", "--suite", "gpu_causal", "--steps", "5",
               "--batch_size", "2", "--max_seq_len", "256", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "results.json").read_text())
    package, peer = summary["results"]
    assert (package["case"], peer["case"]) == (CAUSAL_FIRST, CAUSAL_PEER)
    assert peer["step_tokens"] == package["step_tokens"] and len(package["step_tokens"]) == 5
    assert peer["timed"]["tokens"] == package["timed"]["tokens"] > 0
    assert peer["timed"]["model_flops"] == pytest.approx(package["timed"]["model_flops"], rel=1e-9)
    for r in (package, peer):
        assert r["tokens_per_step"] == r["timed"]["tokens"] / (5 - benchmark.CAUSAL_WARMUP_STEPS), r
        assert 0 < r["mfu"] < 1 and r["compiled_graphs"] == 0 and len(r["peak_memory_bytes"]) == 1, r
    not_run = {(n["case"], n["reason"]) for n in summary["not_run"]}
    gpu_only = set(SUITES["gpu_causal"]) - {CAUSAL_FIRST} | set(PEERS_OF_SUITE["gpu_causal"]) - {CAUSAL_PEER}
    assert not_run == {(case, "needs a GPU") for case in gpu_only}
    table = (tmp_path / "results.md").read_text()
    assert f"| {CAUSAL_FIRST} |" in table and f"| {CAUSAL_PEER} |" in table and "Not run on this machine" in table


def test_the_timed_rates_are_the_timed_steps_tokens_and_flops_over_their_seconds():
    timed = {"steps": 4, "seconds": 2.0, "tokens": 8000, "model_flops": 6e12}
    assert benchmark.timed_rates(timed, nproc=1, peak_tflops=10.0) == {
        "tokens_per_step": 2000, "tokens_per_s": 4000, "mfu": pytest.approx(0.3)}  # fmt: skip
    assert benchmark.timed_rates(timed, nproc=1, peak_tflops=None)["mfu"] is None


def test_the_causal_rows_spread_as_stated_within_the_block(tmp_path):
    """chat_length_rows: token counts (the tiny Llama tokenizer, <s> and </s> added as the package reads whole
    texts) around a fifth of the block at the median, a long tail, none past the block."""
    from transformers import AutoTokenizer

    from scripts.make_tiny_family import llama_tokenizer

    llama_tokenizer(tmp_path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    folder = Path(benchmark.chat_length_rows(tmp_path / "rows", tokenizer, rows=300, block=512))
    texts = [json.loads(line)["text"] for line in (folder / "train.jsonl").read_text().splitlines()]
    lengths = sorted(len(tokenizer(text).input_ids) + 1 for text in texts)  # + </s>
    assert len(lengths) == 300 and len((folder / "validation.jsonl").read_text().splitlines()) == 8
    median = lengths[150]
    assert 0.8 * 0.2 * 512 < median < 1.2 * 0.2 * 512, median
    assert lengths[-1] <= 512 and lengths[-30] > 2 * median, lengths[-30:]  # the tail: a tenth past twice it


@pytest.mark.parametrize(
    "argv, phrase",
    [
        (["--suite", "gpu_causal", "--models", "t5-small"], "measures decoder-only models, not ['t5-small']"),
        (["--suite", "gpu", "--models", "llama-tiny"], "measures T5 models, not ['llama-tiny']"),
        (["--suite", "gpu_causal", "--peers", "HF Trainer, eager"], "has no peer ['HF Trainer, eager']"),
        (["--suite", "gpu_causal", "--cases", "bf16, flex_attention"], f"add {CAUSAL_FIRST!r} to --cases"),
        (["--suite", "gpu_causal", "--steps", "4"], "times the steps after its first 4"),
    ],
)
def test_a_gpu_causal_command_that_cannot_measure_is_refused(monkeypatch, capsys, argv, phrase):
    monkeypatch.setattr(sys, "argv", ["benchmark.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        benchmark.main()
    assert stopped.value.code == 2 and phrase in capsys.readouterr().err


def test_cases_without_the_peers_need_no_reference_and_the_models_folder_is_made_once(tmp_path, monkeypatch):
    """--peers with no name runs no peer, so the cases need not include the first one (the session's later parts);
    a GPU-only case is listed as not run here, not as failed; the random-weight model folder made in --models_dir
    is reused by the next invocation."""
    models = tmp_path / "models"

    def run(out: str) -> dict:
        monkeypatch.setattr(sys, "argv", ["benchmark.py", "--suite", "gpu_causal", "--peers", "--cases",
                                          "bf16, flex_attention", "--models_dir", str(models),
                                          "--out", str(tmp_path / out)])  # fmt: skip
        assert benchmark.main() == 0
        return json.loads((tmp_path / out / "results.json").read_text())

    summary = run("first")
    assert summary["results"] == summary["failed"] == []
    assert summary["not_run"] == [{"model": "llama-tiny", "case": "bf16, flex_attention", "reason": "needs a GPU"}]
    made = models / "llama-tiny-random" / "made.json"
    written = made.stat().st_mtime_ns
    run("second")
    assert made.stat().st_mtime_ns == written
