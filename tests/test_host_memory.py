"""Host memory: freed tensors that glibc keeps in its heaps go back to the OS when trimmed
(utils/observe/memory.py: trim_host_heap, which a checkpoint save calls before it gathers or stages)."""

import os
import subprocess
import sys

import pytest

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
