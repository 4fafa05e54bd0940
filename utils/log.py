"""The one logger of the package, configured once per process with its rank.

Rank 0 logs INFO and above; the other ranks log WARNING and above, each line prefixed with the rank, so
that N ranks do not print N copies of the same progress messages. The same rule holds for transformers'
progress bars ("Loading weights"): rank 0 shows them, the other ranks would only repeat them.
"""

import logging
import sys

from transformers.utils import logging as hf_logging

LOGGER_NAME = "t5_fsdp"


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def setup_logging(rank: int) -> logging.Logger:
    """Configure the package logger for this process; safe to call again (replaces the handler)."""
    logger = get_logger()
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
    if rank != 0:
        hf_logging.disable_progress_bar()
    return logger
