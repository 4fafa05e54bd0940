"""The one logger of the package, configured once per process with its rank.

Rank 0 logs INFO and above; the other ranks log WARNING and above, each line prefixed with the rank, so
that N ranks do not print N copies of the same progress messages. The same rule holds for transformers'
progress bars ("Loading weights"): rank 0 shows them, the other ranks would only repeat them.
"""

import contextlib
import logging
import re
import sys
import warnings

from transformers.utils import logging as hf_logging

LOGGER_NAME = "t5_fsdp"


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


@contextlib.contextmanager
def warnings_ignored(*warned: tuple[type[Warning], str]):
    """Ignore, inside the block only, the warnings of each (category, message start): the ones a call is known
    to raise about library internals nobody here can act on. Everything else still warns. (Leaving the block
    makes Python forget which warnings it has shown once per location, so keep blocks to calls that are not
    in the step loop's every iteration, or wrap the loop as a whole.)"""
    with warnings.catch_warnings():
        for category, message in warned:
            warnings.filterwarnings("ignore", message=re.escape(message), category=category)
        yield


def quiet_helper_process() -> None:
    """In a helper process that torch starts (DCP's background checkpoint writer), INFO lines would only
    repeat what the rank's own log says ("Waiting for checkpoint save request...", on every save): only
    warnings and errors show."""
    logging.disable(logging.INFO)


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
    if rank not in (None, 0):
        hf_logging.disable_progress_bar()
    return logger
