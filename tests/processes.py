"""What Linux's /proc says of processes: a process's children, everything below it, whether it still runs."""

from pathlib import Path


def child_pids(pid: int) -> list[int]:
    """The direct children of a process."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except OSError:  # the task ended meanwhile
            pass
    return children


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, each child before its own children."""
    found = []
    for child in child_pids(pid):
        found += [child, *descendants(child)]
    return found


def is_running(pid: int) -> bool:
    """True while any thread of the process exists and is not a zombie. The first thread can be a zombie while
    the others are still ending, the files they share (and any lock on them) still open: a process killed on a
    loaded machine is gone only when all are."""
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
        if state != "Z":
            return True
    return False
