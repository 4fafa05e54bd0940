"""`option()`: a dataclass field with its --help text and the bounds the CLI checks."""

from dataclasses import field


def option(
    default, help: str, *, minimum: float | None = None, above: float | None = None, maximum: float | None = None
):
    """A config field. `minimum`/`maximum`: value must be >= / <= it; `above`: value must be > it."""
    return field(default=default, metadata={"help": help, "minimum": minimum, "above": above, "maximum": maximum})
