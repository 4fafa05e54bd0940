"""Session-wide fixtures: runs that several test modules compare with, trained once."""

from pathlib import Path

import pytest

from tests.reference_run import train_reference


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted 2-rank SHARDED_STATE_DICT run of tests/reference_run.py (read-only: copy it to
    resume into it)."""
    return train_reference(tmp_path_factory.mktemp("reference") / "out")
