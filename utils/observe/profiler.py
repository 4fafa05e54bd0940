"""--profile_start_step: a torch.profiler trace of chosen optimizer steps on every rank and, on CUDA, a memory
snapshot of the same steps; on CUDA an out-of-memory error also leaves the allocator's state behind
(utils/base/layout.py names the files).

    with StepProfiler(observe, output_dir, rank, device, steps_done) as profiler:   # around training
        ...
        with profiler.step(step):                                                  # each optimizer step
            train_step(...)

Each step is a `ProfilerStep#<global step>` span holding its step and what follows it up to the next step; the
step before the range is traced and dropped (the profiler's own start-up). What a trace holds and costs:
docs/observability.md#profiles.
"""

import contextlib
import gzip
import os
import shutil
import tempfile

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from configs.observability import ObserveConfig
from policies.private_api import dump_memory_snapshot, record_memory_history, stop_memory_history
from utils.base import layout
from utils.base.files import atomic_path
from utils.base.log import get_logger

# Allocation events a memory snapshot keeps (the newest), the value of torch's guide to CUDA memory: a few
# steps of a large model, in some tens of MB of host memory.
MEMORY_HISTORY_ENTRIES = 100_000
MEMORY_VIZ = "https://pytorch.org/memory_viz"


class StepProfiler:
    """The profile of global steps --profile_start_step .. + --profile_num_steps - 1, of those this process
    trains (a resume inside the range profiles the rest of it), and on CUDA the allocator's state at an
    out-of-memory error. `steps_done`: the global step training starts after."""

    def __init__(
        self,
        observe: ObserveConfig,
        output_dir: str,
        rank: int,
        device: torch.device,
        steps_done: int,
        *,
        recompute: bool,
    ):
        start = observe.profile_start_step
        self.first = max(start, steps_done + 1)
        self.last = start + observe.profile_num_steps - 1
        self.starts_after = self.steps_done = steps_done
        self.output_dir, self.rank = output_dir, rank
        self.on_cuda = device.type == "cuda"
        self.folder = layout.profile_dir(output_dir, self.first, self.last)
        self.wanted = start > 0 and self.first <= self.last
        self.profiler: torch.profiler.profile | None = None  # while the range is ahead or being traced
        self.recording_memory = False
        # Allocation stacks make activation checkpointing's recompute fail (docs/observability.md#profiles).
        self.memory_stacks = not recompute

    def __enter__(self) -> "StepProfiler":
        if self.wanted:
            activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.on_cuda else [])]
            self.profiler = torch.profiler.profile(
                activities=activities, schedule=self._action, on_trace_ready=self._write, record_shapes=True
            )
            # torch counts steps from 0 at the start, and names the spans and asks the schedule by that count;
            # counted from the global step, both go by the run's steps (torchtitan does the same).
            self.profiler.step_num = self.steps_done
            self.profiler.start()
        return self

    def _action(self, step: int) -> ProfilerAction:
        """What the profiler does during global step `step`: warm up in the step before the range (when this
        process trains it), trace the range, and write the trace after its last step."""
        if self.first <= step < self.last:
            return ProfilerAction.RECORD
        if step == self.last:
            return ProfilerAction.RECORD_AND_SAVE
        if step == self.first - 1 and step > self.starts_after:
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    @contextlib.contextmanager
    def step(self, step: int):
        """Around global step `step` (steps come one after the other, from steps_done + 1)."""
        if self.profiler is not None:
            self.profiler.step()  # its count becomes `step`: this step's action and its span begin
            if self.on_cuda and step == self.first:
                record_memory_history(MEMORY_HISTORY_ENTRIES, stacks=self.memory_stacks)
                self.recording_memory = True
        yield
        self.steps_done = step
        if self.profiler is not None and step == self.last:
            self._stop()  # the trace ends with its last step, not at the next step's start

    def __exit__(self, kind, error, traceback) -> None:
        if self.on_cuda and isinstance(error, torch.OutOfMemoryError):
            self._write_out_of_memory()
        if self.profiler is not None:
            self._stop()  # training ended inside the range (--max_steps, a stop, an error): the steps traced

    def _stop(self) -> None:
        profiler, self.profiler = self.profiler, None
        profiler.stop()  # writes the trace (_write) when it was tracing

    def _write(self, profiler: torch.profiler.profile) -> None:
        """The trace, and on CUDA the memory snapshot of the traced steps (torch's on_trace_ready)."""
        os.makedirs(self.folder, exist_ok=True)
        write_gzipped_trace(profiler, layout.trace_file(self.folder, self.rank))
        snapshot = ""
        if self.recording_memory:
            with atomic_path(layout.memory_snapshot_file(self.folder, self.rank)) as tmp:
                dump_memory_snapshot(tmp)
            self._stop_recording_memory()
            snapshot = f" and memory snapshots ({MEMORY_VIZ}"
            snapshot += ")" if self.memory_stacks else "; without stacks under activation checkpointing)"
        get_logger().info(
            "profile of steps %d-%d: every rank's trace%s in %s (tensorboard --logdir %s, or ui.perfetto.dev)",
            self.first, self.last, snapshot, self.folder, os.path.dirname(self.folder),
        )  # fmt: skip

    def _write_out_of_memory(self) -> None:
        """The allocator's state when this rank ran out of memory: every segment and block, and where memory
        history was being recorded (the profiled steps) the allocations and frees, with their stacks unless
        activation checkpointing left them out."""
        path = layout.memory_snapshot_file(layout.out_of_memory_dir(self.output_dir, self.steps_done), self.rank)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with atomic_path(path) as tmp:
                dump_memory_snapshot(tmp)
        except Exception as err:  # the out-of-memory error stays the one the run reports
            get_logger().warning("out of memory; its memory snapshot could not be written: %s", err)
        else:
            get_logger().warning("out of memory after step %d: the allocator's state is in %s (%s)",
                                 self.steps_done, path, MEMORY_VIZ)  # fmt: skip
        self._stop_recording_memory()

    def _stop_recording_memory(self) -> None:
        if self.recording_memory:
            stop_memory_history()
            self.recording_memory = False


def write_gzipped_trace(profiler: torch.profiler.profile, path: str) -> None:
    """The trace as Chrome trace JSON, gzipped (TensorBoard's plugin, Perfetto and chrome://tracing open it
    as is), written atomically: torch writes the JSON to a temporary file first."""
    with tempfile.NamedTemporaryFile(suffix=".json", dir=os.path.dirname(path)) as raw:
        profiler.export_chrome_trace(raw.name)
        with atomic_path(path) as tmp, open(raw.name, "rb") as source, gzip.open(tmp, "wb") as target:
            shutil.copyfileobj(source, target)
