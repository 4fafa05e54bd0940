"""What the launcher (torchrun, or none) tells a process about its place in the job, and what the process
tells it back on failure. Read from the environment, without torch: the settings are checked with it before
torch is imported.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; a plain `python T5_training.py`
runs as a world of one.
"""

import contextlib
import json
import os
import time


def launcher_ranks() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) without it."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


def ranks_on_this_host(world_size: int) -> int:
    """How many of the job's ranks share this host: torchrun's LOCAL_WORLD_SIZE; without it, all `world_size`
    (the cautious guess for what they share: memory, cores)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def point_launcher_to_the_log(rank: int) -> None:
    """Under torchrun: its closing report (ChildFailedError) shows, for the rank that failed first, what that
    rank's error file says, else only a link to torch's docs. The file says the cause is this rank's ERROR line
    above the report, rather than repeating it: a refusal stays one message."""
    tell_the_launcher(f"the cause is the [rank {rank}] ERROR line above this report")


def tell_the_launcher(message: str) -> None:
    """Under torchrun: `message` in this rank's error file, which torchrun's closing report shows if this rank
    failed first."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with contextlib.suppress(OSError):  # the launcher's report is a courtesy: never a second failure
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": message, "timestamp": str(int(time.time()))}, f)
