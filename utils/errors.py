"""Errors a user can fix. The entry point prints them as one line (no traceback) and exits non-zero.

Every message says what is wrong and how to fix it. Anything else that escapes is a bug and keeps its
traceback.
"""


class UserError(Exception):
    """A problem with the user's input: configuration, data, model path or checkpoint."""


class ConfigError(UserError, ValueError):
    """An unknown config field, a value of the wrong type, or an unsupported combination."""


class DataError(UserError, ValueError):
    """Malformed or insufficient training data."""


class DataFileNotFoundError(UserError, FileNotFoundError):
    """A data file that should exist does not."""
