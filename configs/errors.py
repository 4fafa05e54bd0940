"""Errors a user can fix. The entry point prints them as one line (no traceback) and exits non-zero.

Every message says what is wrong and how to fix it. Anything else that escapes is a bug and keeps its
traceback.
"""

import errno
import re


class UserError(Exception):
    """A problem with the user's input: configuration, data, model path or checkpoint."""


class ConfigError(UserError, ValueError):
    """An unknown config field, a value of the wrong type, or an unsupported combination."""


class DataError(UserError, ValueError):
    """Malformed or insufficient training data."""


class DataFileNotFoundError(UserError, FileNotFoundError):
    """A data file that should exist does not."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupt or made for another model."""


class TrainingDivergedError(UserError):
    """A NaN or infinite loss or gradient norm with --on_nonfinite stop: the run ends without saving."""


def __getattr__(name: str):
    """`FAILURES`, what a failed run can raise: torch.distributed.checkpoint's CheckpointException derives from
    BaseException, not Exception, so `except Exception` would let a corrupt shard escape with a traceback on
    every rank (docs/pitfalls.md #25). Built on first use, which imports torch: the settings are read and checked
    without it."""
    if name == "FAILURES":
        from torch.distributed.checkpoint.api import CheckpointException

        return (Exception, CheckpointException)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def error_chain(err: BaseException | None):
    """`err`, then the error it was raised from or while handling, and so on down the chain."""
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def error_summary(err: BaseException, limit: int = 400) -> str:
    """The telling part of a failure, as one sentence: DCP wraps the per-rank causes (each an exception, or an
    (exception, traceback) pair), state_dict loading lists them."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    for cause in getattr(err, "failures", {}).values():  # CheckpointException: {rank: cause}
        if isinstance(cause, tuple):  # DCP's (exception, traceback summary)
            cause = cause[0]
        if not isinstance(cause, BaseException):
            return str(cause)[:limit]
        inner = error_summary(cause, limit)
        return inner if inner.startswith(type(cause).__name__) else f"{type(cause).__name__}: {inner}"
    text = text or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# How a full disk or an exhausted quota is worded by Python (OSError), Rust libraries (tokenizers, safetensors:
# "os error 28") and torch's C++ writers, which keep only the text.
DISK_FULL = re.compile(
    r"No space left on device|Disk quota exceeded|os error (28|122)|errno (28|122)", re.IGNORECASE
)


def is_disk_full(err: BaseException | None) -> bool:
    """Whether `err`, or an error it was raised from or while handling, says the disk (or the quota) is full."""
    for link in error_chain(err):
        if isinstance(link, OSError) and link.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if DISK_FULL.search(error_summary(link)):
            return True
    return False
