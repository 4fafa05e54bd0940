"""Imported once, by the fork server that the rank pool's workers are forked from (tests/rank_pool.py): it sets
the server up as a rank process before torch is imported (one thread, offline, the package's deprecations as
errors), then imports what every scenario needs, and says so, or why not, in the file the pool waits on. It
dies with pytest, and its workers with it."""

import os
import traceback
from pathlib import Path

from tests import rank_pool


def say(text: str) -> None:
    """The report written whole or not at all: the pool reads it as soon as it exists."""
    report = Path(os.environ[rank_pool.SERVER_REPORT_VARIABLE])
    partial = report.with_name(report.name + ".partial")
    partial.write_text(text)
    os.replace(partial, report)


rank_pool.die_with_parent()
try:
    rank_pool.set_up_as_a_rank(rank_pool.offline_env())
    rank_pool.preload()
except BaseException:
    say(traceback.format_exc())
    raise
say("ok")
