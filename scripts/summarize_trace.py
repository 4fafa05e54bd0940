"""Summarise a torch.profiler trace of --profile_start_step: the ops that took the time, and the all-gathers.

    python scripts/summarize_trace.py outputs/profile/steps_5-7/rank_0.pt.trace.json.gz
    python scripts/summarize_trace.py outputs/profile/steps_5-7/rank_0.pt.trace.json.gz --top 10

Prints the profiled steps (the `ProfilerStep#<N>` spans) and their time; the top operators by self time (an
operator's time less the operators it called, summed over its calls; on CUDA also the GPU kernels by
time); and the share of the profiled time in which an all-gather was in flight, and any collective at all.
The collectives are the transfers themselves: gloo's spans on its worker threads (`gloo:all_gather`) on CPU,
NCCL's kernels (`ncclDevKernel_AllGather...`) on CUDA, not the calls that enqueue them. Time in flight
counts overlapped time too: a collective that runs beside computation is not necessarily waited for.
Reads the file (.json or .json.gz) only; any Chrome trace that torch.profiler wrote will do.
"""

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass

STEP_SPAN = re.compile(r"^ProfilerStep#(\d+)$")
ALL_GATHER = re.compile(r"^gloo:all_gather|^nccl\w*all_?gather", re.IGNORECASE)
COLLECTIVE = re.compile(r"^gloo:|^nccl\w*(all_?gather|reduce|broadcast|send|recv|all_?to_?all)", re.IGNORECASE)
OPERATOR = "cpu_op"
KERNEL = "kernel"


@dataclass
class OpTime:
    calls: int = 0
    self_us: float = 0.0


def read_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def complete_events(trace: dict) -> list[dict]:
    """The spans (Chrome trace "X" events) of the trace, without the profiler's own span around all."""
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "Trace"]


def step_spans(events: list[dict]) -> dict[int, dict]:
    """The profiled steps: global step -> its ProfilerStep#<step> span."""
    return {int(m.group(1)): e for e in events if (m := STEP_SPAN.match(e["name"]))}


def self_times(events: list[dict], category: str) -> dict[str, OpTime]:
    """Per name, the calls and self time of the events of `category`: each span's duration less that of the
    spans directly inside it on the same thread."""
    by_thread = defaultdict(list)
    for event in events:
        by_thread[(event["pid"], event["tid"])].append(event)
    inner = defaultdict(float)  # id(span) -> the duration of the spans directly inside it
    for spans in by_thread.values():
        open_spans: list[dict] = []
        for span in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while open_spans and open_spans[-1]["ts"] + open_spans[-1]["dur"] <= span["ts"]:
                open_spans.pop()
            if open_spans:
                inner[id(open_spans[-1])] += span["dur"]
            open_spans.append(span)
    times: dict[str, OpTime] = defaultdict(OpTime)
    for event in events:
        if event.get("cat") == category:
            times[event["name"]].calls += 1
            times[event["name"]].self_us += event["dur"] - inner[id(event)]
    return times


def time_in_flight(events: list[dict], pattern: re.Pattern, window: list[tuple[float, float]]) -> float:
    """Microseconds inside `window` (the steps' spans) during which an event named by `pattern` ran, on
    any thread or stream (overlapping events counted once)."""
    intervals = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if pattern.search(e["name"]))
    covered, reach = 0.0, float("-inf")
    for begin, end in intervals:
        begin = max(begin, reach)
        if end > begin:
            covered += sum(max(0.0, min(end, hi) - max(begin, lo)) for lo, hi in window)
            reach = end
    return covered


def summarize(trace: dict, top: int = 5) -> str:
    events = complete_events(trace)
    steps = step_spans(events)
    if not steps:
        raise ValueError("no ProfilerStep#<N> spans: not a trace of --profile_start_step")
    window = [(span["ts"], span["ts"] + span["dur"]) for span in steps.values()]
    profiled = sum(end - begin for begin, end in window)
    numbers = sorted(steps)
    lines = [f"steps {numbers[0]}-{numbers[-1]} ({len(numbers)} profiled): {profiled / 1000:.1f} ms"]
    tables = [(OPERATOR, "operators by self time (CPU)"), (KERNEL, "GPU kernels by time")]
    for category, title in tables:
        times = self_times(events, category)
        if not times:
            continue
        lines += ["", f"top {top} {title}:", f"  {'name':<44} {'calls':>6} {'ms':>10} {'% of steps':>10}"]
        for name, time in sorted(times.items(), key=lambda item: -item[1].self_us)[:top]:
            share = 100 * time.self_us / profiled
            lines.append(f"  {name[:44]:<44} {time.calls:>6} {time.self_us / 1000:>10.1f} {share:>9.1f}%")
    lines.append("")
    for what, pattern in (("all-gather", ALL_GATHER), ("any collective", COLLECTIVE)):
        flight = time_in_flight(events, pattern, window)
        lines.append(
            f"{what} in flight: {flight / 1000:.1f} ms, {100 * flight / profiled:.1f}% of the profiled time"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a rank's trace: output_dir/profile/steps_<A>-<B>/rank_<r>.pt.trace.json.gz")
    parser.add_argument("--top", type=int, default=5, help="how many operators to list (default 5)")
    args = parser.parse_args(argv)
    try:
        print(summarize(read_trace(args.trace), args.top))
    except (OSError, ValueError, KeyError) as error:  # json's errors are ValueErrors
        print(f"{args.trace}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
