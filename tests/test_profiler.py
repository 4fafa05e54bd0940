"""--profile_start_step (utils/observe/profiler.py): each rank's trace holds exactly the chosen global steps,
each a ProfilerStep#<step> span, with FSDP's all-gathers and reduce-scatters (FSDP1 through torchrun, FSDP2 in
a spawned group); a resume or an early end inside the range; on CUDA, an out-of-memory error's snapshot;
the range checked against --max_steps; and scripts/summarize_trace.py's arithmetic and output."""

import gzip
import json
import re

import pytest
import torch
from torch.profiler import record_function

from configs.errors import ConfigError
from configs.observability import ObserveConfig
from configs.validate import check_settings
from scripts.summarize_trace import main as summarize_main
from scripts.summarize_trace import self_times, step_spans, summarize, time_in_flight
from tests.dist_harness import run_ranks
from tests.launch import pooled
from tests.run_configs import run_config
from utils.base import layout
from utils.observe import profiler as profiler_module
from utils.observe.profiler import StepProfiler

CPU = torch.device("cpu")
UNITS = 5  # the tiny T5's FSDP units: the root and its 4 T5Blocks


def read_trace(path) -> list[dict]:
    """The spans of a trace file, which must be gzipped Chrome trace JSON."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        trace = json.load(f)
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "Trace"]


def steps_traced(events: list[dict]) -> list[int]:
    return sorted(step_spans(events))


def run_steps(profiler: StepProfiler, steps: range) -> None:
    """A stand-in training loop: each step a matrix product, labelled with its step, and work between steps
    (a checkpoint, an evaluation) labelled with the step before it."""
    x = torch.randn(64, 64)
    with profiler:
        for step in steps:
            with profiler.step(step), record_function(f"work {step}"):
                x = torch.tanh(x @ x)
            with record_function(f"between {step}"):
                x = x + 1


def labels_traced(events: list[dict], label: str) -> list[int]:
    return sorted(int(e["name"].split()[1]) for e in events if re.fullmatch(rf"{label} \d+", e["name"]))


# ------------------------------------------------------------------------------------- in one process


def test_only_the_chosen_steps_are_traced_each_a_span_named_by_its_global_step(tmp_path, log_records):
    observe = ObserveConfig(profile_start_step=3, profile_num_steps=2)
    run_steps(StepProfiler(observe, str(tmp_path), 0, CPU, steps_done=0, recompute=False), range(1, 7))
    folder = layout.profile_dir(str(tmp_path), 3, 4)
    events = read_trace(layout.trace_file(folder, 0))
    # Step 2, the warmup, and steps 5 and 6 ran under the profiler too, but left nothing in the trace; what
    # follows step 3 is in its span, what follows step 4, the last, is not.
    assert steps_traced(events) == [3, 4] and labels_traced(events, "work") == [3, 4]
    assert labels_traced(events, "between") == [3]
    assert any(e["name"] == "aten::mm" for e in events)
    written = [r.getMessage() for r in log_records if "profile of steps" in r.getMessage()]
    assert written == [f"profile of steps 3-4: every rank's trace in {folder} (tensorboard --logdir "
                       f"{tmp_path / 'profile'}, or ui.perfetto.dev)"]  # fmt: skip


def test_a_resume_inside_the_range_traces_its_rest_and_an_early_end_what_it_trained(tmp_path):
    observe = ObserveConfig(profile_start_step=3, profile_num_steps=3)
    # Resumed after step 3 (no step before the range to warm up in), ended by --max_steps after step 4.
    run_steps(StepProfiler(observe, str(tmp_path), 1, CPU, steps_done=3, recompute=False), range(4, 5))
    events = read_trace(layout.trace_file(layout.profile_dir(str(tmp_path), 4, 5), 1))
    assert steps_traced(events) == [4] and labels_traced(events, "work") == [4]


def test_no_profile_without_a_start_step_or_after_the_range(tmp_path):
    run_steps(StepProfiler(ObserveConfig(), str(tmp_path), 0, CPU, steps_done=0, recompute=False), range(1, 4))
    after = ObserveConfig(profile_start_step=2, profile_num_steps=2)
    resumed_past_it = StepProfiler(after, str(tmp_path), 0, CPU, steps_done=3, recompute=False)
    run_steps(resumed_past_it, range(4, 6))
    assert not (tmp_path / layout.PROFILE_DIR).exists()


@pytest.mark.filterwarnings("ignore:CUDA is not available")
@pytest.mark.parametrize("recompute", [False, True])
def test_memory_history_is_recorded_over_the_range_on_cuda_without_stacks_under_activation_checkpointing(
    tmp_path, monkeypatch, recompute
):
    """On CUDA the profiled steps also record the allocator's history; with activation checkpointing its
    stacks are left out (they made the recompute fail under torch 2.11 on an H200)."""
    calls = []
    monkeypatch.setattr(profiler_module, "record_memory_history", lambda entries, stacks: calls.append(stacks))
    monkeypatch.setattr(profiler_module, "stop_memory_history", lambda: calls.append("stop"))
    monkeypatch.setattr(profiler_module, "dump_memory_snapshot", lambda path: open(path, "wb").close())
    monkeypatch.setattr(profiler_module, "write_gzipped_trace", lambda profiler, path: None)
    observe = ObserveConfig(profile_start_step=2, profile_num_steps=2)
    cuda = torch.device("cuda")
    run_steps(StepProfiler(observe, str(tmp_path), 0, cuda, steps_done=0, recompute=recompute), range(1, 5))
    assert calls == [not recompute, "stop"]


def test_an_out_of_memory_error_on_cuda_leaves_the_allocators_state_and_still_ends_the_run(
    tmp_path, monkeypatch, log_records
):
    dumped = []

    def dump_memory_snapshot(path: str) -> None:  # torch's needs CUDA: the pickle is stood in for
        dumped.append(path)
        with open(path, "wb") as f:
            f.write(b"snapshot")

    monkeypatch.setattr(profiler_module, "dump_memory_snapshot", dump_memory_snapshot)
    profiler = StepProfiler(ObserveConfig(), str(tmp_path), 1, torch.device("cuda"), steps_done=4, recompute=False)
    with pytest.raises(torch.OutOfMemoryError), profiler:
        with profiler.step(5):
            pass
        with profiler.step(6):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    path = layout.memory_snapshot_file(layout.out_of_memory_dir(str(tmp_path), 5), 1)
    assert open(path, "rb").read() == b"snapshot" and len(dumped) == 1
    assert [r.getMessage() for r in log_records if "out of memory" in r.getMessage()] == [
        f"out of memory after step 5: the allocator's state is in {path} (https://pytorch.org/memory_viz)"
    ]


def test_a_range_past_max_steps_is_refused_with_the_fix():
    check_settings(run_config(profile_start_step=8, profile_num_steps=3, max_steps=10), 2, "cpu")
    check_settings(run_config(profile_start_step=40, max_steps=0), 2, "cpu")  # no step budget: not known yet
    with pytest.raises(ConfigError) as refused:
        check_settings(run_config(profile_start_step=9, profile_num_steps=3, max_steps=10), 2, "cpu")
    assert str(refused.value) == (
        "--profile_start_step 9 --profile_num_steps 3 profiles steps 9-11, past --max_steps 10: choose steps up "
        "to 10, or a higher --max_steps"
    )


def test_the_summary_counts_self_time_and_overlapping_collectives_once():
    def span(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "cat": cat}

    events = [
        span("ProfilerStep#7", 0, 100, cat="user_annotation"),
        span("aten::linear", 10, 40),
        span("aten::mm", 20, 10),  # inside linear: 10 of linear's 40 are mm's
        span("aten::mm", 60, 20),
        span("gloo:all_gather", 40, 20, tid=2, cat="user_annotation"),
        span("gloo:all_gather", 50, 20, tid=3, cat="user_annotation"),  # overlaps the first: 40-70 in flight
        span("gloo:all_gather", 90, 30, tid=2, cat="user_annotation"),  # half of it after the step
    ]
    times = self_times(events, "cpu_op")
    assert (times["aten::linear"].self_us, times["aten::mm"].self_us, times["aten::mm"].calls) == (30, 30, 2)
    assert time_in_flight(events, re.compile("^gloo:all_gather"), [(0, 100)]) == 40
    text = summarize({"traceEvents": events}, top=2)
    assert text.splitlines()[0] == "steps 7-7 (1 profiled): 0.1 ms"
    assert "all-gather in flight: 0.0 ms, 40.0% of the profiled time" in text


# ---------------------------------------------------------------------------------- through FSDP


def assert_fsdp_collectives_in_each_step(events: list[dict], all_gather_op: str) -> None:
    """Every unit all-gathered (in the forward, again in the backward) and reduce-scattered once, in each
    profiled step, and gloo's all-gathers (the transfers, on its worker threads) inside the steps; nothing
    traced outside them."""
    spans = step_spans(events)
    begin = min(span["ts"] for span in spans.values())
    end = max(span["ts"] + span["dur"] for span in spans.values())
    assert all(begin <= e["ts"] and e["ts"] + e["dur"] <= end + 1 for e in events), "traced outside the steps"
    for step, span in spans.items():
        inside = [e["name"] for e in events if span["ts"] <= e["ts"] <= span["ts"] + span["dur"]]
        assert inside.count("c10d::_reduce_scatter_base_") == UNITS, (step, sorted(set(inside)))
        assert inside.count(all_gather_op) >= UNITS, (step, sorted(set(inside)))
        assert inside.count("gloo:all_gather") == inside.count(all_gather_op), step


def profiled_fsdp2_worker(rank: int, world_size: int, output_dir: str) -> str:
    from configs.fsdp import FSDPConfig
    from tests.dist_workers import FP32, LR, batch_seed, make_batch, sharded, tiny_t5
    from utils.spec import SEQ2SEQ
    from utils.train.step import StepSettings, train_step

    config = FSDPConfig(fsdp_version=2, mixed_precision=False, fsdp_activation_checkpointing=False)
    model, parallelism = sharded(tiny_t5(), config, FP32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    observe = ObserveConfig(profile_start_step=2, profile_num_steps=2)
    settings = StepSettings(parallelism, spec=SEQ2SEQ)
    with StepProfiler(observe, output_dir, rank, CPU, steps_done=0, recompute=False) as profiler:
        for step in range(1, 4):
            with profiler.step(step):
                train_step(model, make_batch(batch_seed(step, rank)), optimizer, None, world_size, settings)
    return layout.trace_file(layout.profile_dir(output_dir, 2, 3), rank)


@pytest.mark.slow  # 11 to 17 s (a spawned group); FSDP1's, through torchrun below, is slow too
def test_fsdp2_steps_hold_their_all_gathers_and_reduce_scatters(tmp_path):
    for trace in run_ranks(profiled_fsdp2_worker, str(tmp_path), timeout_s=120):
        events = read_trace(trace)
        assert steps_traced(events) == [2, 3]
        assert_fsdp_collectives_in_each_step(events, "c10d::_allgather_base_")
        assert any(e["name"].startswith("FSDP::all_gather (encoder.block.0)") for e in events)


@pytest.mark.slow  # a whole training through torchrun
def test_a_profiled_run_writes_each_ranks_trace_of_the_chosen_steps(tmp_path, capsys):
    """Through torchrun (FSDP1, the default): --profile_start_step 2 --profile_num_steps 2 of 3 steps."""
    output_dir = tmp_path / "out"
    run = pooled(
        ["--num_train_samples", "24", "--run_validation", "false", "--max_steps", "3", "--peak_tflops", "1",
         "--profile_start_step", "2", "--profile_num_steps", "2", "--output_dir", str(output_dir)],
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.describe()
    folder = layout.profile_dir(str(output_dir), 2, 3)
    assert run.output.count(f"[rank 0] INFO profile of steps 2-3: every rank's trace in {folder}") == 1
    assert "[rank 1] INFO" not in run.output
    for rank in (0, 1):
        events = read_trace(layout.trace_file(folder, rank))
        assert steps_traced(events) == [2, 3]
        assert_fsdp_collectives_in_each_step(events, "c10d::allgather_")
    assert summarize_main([layout.trace_file(folder, 0)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"steps 2-3 \(2 profiled\): [\d.]+ ms", lines[0]), lines
    assert lines[2] == "top 5 operators by self time (CPU):" and len(lines) == 12, lines
    rows = [re.fullmatch(r"  (\S+) +(\d+) +([\d.]+) +([\d.]+)%", row) for row in lines[4:9]]
    assert all(rows), lines
    # The trace's own operators, by falling self time. Which one leads depends on the processor (aten::mm on one
    # CPU, aten::bernoulli_ on another), so no name is expected first: the list is what the trace holds.
    operators = {e["name"] for e in read_trace(layout.trace_file(folder, 0)) if e.get("cat") == "cpu_op"}
    assert {row[1] for row in rows} <= operators and "aten::mm" in operators, (lines, sorted(operators))
    times = [float(row[3]) for row in rows]
    assert times == sorted(times, reverse=True) and times[-1] > 0, lines
    share = float(re.fullmatch(r"all-gather in flight: [\d.]+ ms, ([\d.]+)% of the profiled time", lines[10])[1])
    assert 0 < share < 100, lines
