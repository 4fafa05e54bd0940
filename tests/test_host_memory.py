"""Host memory: freed tensors that glibc keeps in its heaps go back to the OS when trimmed
(utils/observe/memory.py: trim_host_heap, which a checkpoint save calls before it gathers or stages); the
program's modules are kept out of the garbage collector's walks (T5_training.py: kept_for_the_whole_process)."""

import gc
import os
import subprocess
import sys

import pytest
import torch
import transformers

from configs.paths import REPO_ROOT

# In a fresh process: 32 tensors of 8 MB allocated after glibc has raised its mmap threshold (by freeing one
# 8 MB tensor), so they come from its heap; every other one is freed (128 MB, each hole between two live
# tensors, so that no free can shrink the heap's top), then trimmed or not. Prints how much the resident
# memory fell.
FREED_BYTES_RETURNED = """
import sys
import torch
from utils.observe import memory

warm = torch.ones(2 * 2**20)
del warm  # an 8 MB block freed: glibc now serves 8 MB from its heap
blocks = [torch.ones(2 * 2**20) for _ in range(32)]
before = memory.current_rss_bytes()
del blocks[::2]
if sys.argv[1] == "trimmed":
    memory.trim_host_heap()
print(before - memory.current_rss_bytes())
"""


def released_bytes(*modes: str) -> list[int]:
    """FREED_BYTES_RETURNED's figure for each mode, each in a fresh process (run side by side)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}  # glibc's defaults
    started = [
        subprocess.Popen(
            [sys.executable, "-c", FREED_BYTES_RETURNED, mode],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for mode in modes
    ]
    figures = []
    for process in started:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        figures.append(int(out.split()[-1]))
    return figures


@pytest.mark.slow  # 10-13 s in the fast subset (docs/development.md: the time budget)
def test_trimming_gives_freed_tensors_back_to_the_os():
    trimmed, freed = released_bytes("trimmed", "freed")
    assert trimmed > 120e6  # the 128 MB leave the resident memory
    assert freed < 30e6  # the control: freed alone, glibc keeps them resident


def test_the_programs_modules_are_frozen_out_of_collections_and_the_collector_is_left_as_it_was():
    """T5_training's imports (torch, transformers, the package) are frozen: no collection walks them again."""
    import T5_training

    walked = {id(obj) for obj in gc.get_objects()}  # what a collection walks: every tracked object but the frozen
    for kept in (T5_training.build_run, T5_training.StopRequest, torch.nn.Module, transformers.PreTrainedModel):
        assert id(kept) not in walked, kept
    assert gc.isenabled()

    gc.disable()  # a program that keeps the collector off finds it off after the imports too
    try:
        with T5_training.kept_for_the_whole_process():
            made = [[]]
        assert not gc.isenabled()
        assert id(made) not in {id(obj) for obj in gc.get_objects()}
    finally:
        gc.unfreeze()  # what the block froze in this pytest process (the session's objects too) is collected again
        gc.enable()
