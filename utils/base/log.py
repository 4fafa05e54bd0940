"""The one logger of the package, configured once per process with its rank, and its progress bars.

Rank 0 logs INFO and above; the other ranks log WARNING and above, each line prefixed with the rank, so
that N ranks do not print N copies of the same progress messages. Progress bars follow the same rule, and
are drawn only on a terminal: in a log file a bar's redrawn lines would be noise, so long work logs a plain
line now and then instead (`progress_bar`). TQDM_DISABLE=1, tqdm's own switch, also turns the bars into lines.
transformers' bars ("Loading weights") are on where this package's are.
"""

import contextlib
import logging
import os
import re
import sys
import time
import warnings

from huggingface_hub.utils import disable_progress_bars as disable_hub_bars
from tqdm import tqdm

LOGGER_NAME = "t5_fsdp"


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


@contextlib.contextmanager
def warnings_ignored(*warned: tuple[type[Warning], str]):
    """Ignore, inside the block only, the warnings of each (category, message start): the ones a call is known
    to raise about library internals nobody here can act on. Everything else still warns. Keep blocks off the
    step loop's every iteration (docs/pitfalls.md #40)."""
    with warnings.catch_warnings():
        for category, message in warned:
            warnings.filterwarnings("ignore", message=re.escape(message), category=category)
        yield


def quiet_helper_process() -> None:
    """In a helper process that torch starts (DCP's background checkpoint writer), INFO lines would only
    repeat what the rank's own log says ("Waiting for checkpoint save request...", on every save): only
    warnings and errors show; and not its "Checkpoint save failed" either, which the rank that waits for the
    write turns into one message of its own (utils/checkpoint/manager.py)."""
    logging.disable(logging.INFO)
    logging.getLogger().addFilter(lambda record: not record.getMessage().startswith("Checkpoint save failed"))


def setup_logging(rank: int | None = None, stream=None) -> logging.Logger:
    """Configure the package logger for this process; safe to call again (replaces the handler). `rank`: this
    process's rank under torchrun, which prefixes every line; None for a single-process script (no prefix).
    `stream`: where lines go (stdout; a script whose output is its stdout logs to stderr)."""
    logger = get_logger()
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stdout)
    prefix = "" if rank is None else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank in (None, 0) else logging.WARNING)
    logger.propagate = False
    if not bars_shown():
        # transformers takes its bars' switch from huggingface_hub's when it is imported (the settings are read
        # before it is: a refused one answers sooner), and keeps its own once it is.
        disable_hub_bars()
        if "transformers.utils.logging" in sys.modules:
            sys.modules["transformers.utils.logging"].disable_progress_bar()
    return logger


def bars_shown() -> bool:
    """Whether this process draws progress bars: it logs INFO (rank 0, or a script), stderr (where tqdm draws)
    is a terminal, and TQDM_DISABLE is not 1, true, yes or on."""
    disabled = os.environ.get("TQDM_DISABLE", "").strip().lower() in ("1", "true", "yes", "on")
    return get_logger().isEnabledFor(logging.INFO) and sys.stderr.isatty() and not disabled


def progress_bar(total: int | None, desc: str, *, unit: str = "it", colour: str | None = None, initial: int = 0,
             lines: bool = True) -> "tqdm | ProgressLines":  # fmt: skip
    """A progress bar for `total` units of work (use as a context manager; `update(n)` as work is done):
    a tqdm bar where bars are drawn (`bars_shown`); elsewhere, on the process that logs INFO, plain log
    lines (`ProgressLines`), unless `lines` is False (work that logs its own progress); else nothing. `total`
    None: not known (a download without a length), so no share or time left is shown."""
    if bars_shown():
        # disable=False: bars_shown has decided (tqdm alone would take any TQDM_DISABLE value, even 0, as set)
        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024, colour=colour,
                    initial=initial, dynamic_ncols=True, disable=False)  # fmt: skip
    if lines and get_logger().isEnabledFor(logging.INFO):
        return ProgressLines(total, desc, unit, initial)
    return tqdm(total=total, initial=initial, disable=True)


class ProgressLines:
    """A progress bar's stand-in for a log: one INFO line after the first update (the work has started, and
    how fast it goes), then at most one every `every_s` seconds, e.g.
    `ROUGE evaluation: 12/30 batches (40%), 0:14 so far, about 0:21 left`. The work's own closing line says
    when it is done. The attributes tqdm's callers read (`n`, `total`, `disable`) are kept."""

    disable = False

    def __init__(self, total: int | None, desc: str, unit: str, initial: int = 0, every_s: float = 30.0):
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.initial = initial  # done before this process started: not counted in its pace
        self.every_s = every_s
        self.started = time.perf_counter()
        self.last_line: float | None = None

    def __enter__(self) -> "ProgressLines":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if self.last_line is None or now - self.last_line >= self.every_s:
            self.last_line = now
            get_logger().info("%s", self.line(now - self.started))

    def line(self, elapsed: float) -> str:
        if self.unit == "B":
            of = "" if self.total is None else f"/{self.total / 2**20:.1f}"
            amount = f"{self.n / 2**20:.1f}{of} MiB"
        else:
            of, count = ("", self.n) if self.total is None else (f"/{self.total}", self.total)
            plural = ("es" if self.unit.endswith(("s", "sh", "ch", "x")) else "s") if count != 1 else ""
            amount = f"{self.n}{of} {self.unit}{plural}"
        if self.total is None:  # not known: no share, no time left
            return f"{self.desc}: {amount}, {format_duration(elapsed)} so far"
        share = self.n / self.total if self.total else 1.0
        done_here = self.n - self.initial
        left = elapsed * (self.total - self.n) / done_here if done_here > 0 else 0.0
        times = f"{format_duration(elapsed)} so far, about {format_duration(left)} left"
        return f"{self.desc}: {amount} ({share:.0%}), {times}"


def size_text(size: int) -> str:
    """Bytes as people read them: MB below a GB, else GB."""
    return f"{size / 1e6:.1f} MB" if size < 1e9 else f"{size / 1e9:.2f} GB"


def format_duration(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
