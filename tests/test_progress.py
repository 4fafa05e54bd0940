"""Progress bars on a terminal, plain lines in a log (utils/base/log.py: progress_bar, ProgressLines)."""

import logging
import sys

import pytest

from utils.base.log import ProgressLines, get_logger, progress_bar


def test_a_log_gets_a_line_when_work_starts_then_at_most_one_per_interval(log_records):
    lines = ProgressLines(30, "ROUGE evaluation", "batch", every_s=3600)
    with lines:
        for _ in range(5):
            lines.update(1)
    messages = [r.getMessage() for r in log_records]
    assert len(messages) == 1, messages
    assert messages[0].startswith("ROUGE evaluation: 1/30 batches (3%), 0:00 so far, about ")
    assert lines.n == 5

    every = ProgressLines(4 * 2**20, "Caching wikihowAll.csv", "B", every_s=0)
    every.update(2**20)
    every.update(3 * 2**20)
    assert [r.getMessage().split(",")[0] for r in log_records[1:]] == [
        "Caching wikihowAll.csv: 1.0/4.0 MiB (25%)",
        "Caching wikihowAll.csv: 4.0/4.0 MiB (100%)",
    ]


def test_work_of_unknown_size_says_how_much_is_done(log_records):
    """A download without a length: what arrived and for how long, no share or time left."""
    download = ProgressLines(None, "wikihowAll.csv", "B", every_s=0)
    download.update(3 * 2**20)
    rows = ProgressLines(None, "Reading", "row", every_s=0)
    rows.update(1)
    rows.update(1)
    assert [record.getMessage() for record in log_records] == [
        "wikihowAll.csv: 3.0 MiB, 0:00 so far",
        "Reading: 1 row, 0:00 so far",
        "Reading: 2 rows, 0:00 so far",
    ]


@pytest.mark.parametrize(
    ("terminal", "tqdm_disable", "level", "lines", "expected"),
    [
        (True, "", logging.INFO, True, "bar"),  # rank 0 on a terminal
        (False, "", logging.INFO, True, "lines"),  # rank 0 into a log file
        (True, "1", logging.INFO, True, "lines"),  # TQDM_DISABLE: tqdm's own switch
        (True, "0", logging.INFO, True, "bar"),  # (tqdm alone would take any value as set)
        (False, "", logging.INFO, False, "nothing"),  # work that logs its own progress (training)
        (True, "", logging.WARNING, True, "nothing"),  # another rank: rank 0 shows it
    ],
)
def test_bars_only_on_rank_0_at_a_terminal_and_lines_in_a_log(
    monkeypatch, terminal, tqdm_disable, level, lines, expected
):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    monkeypatch.setenv("TQDM_DISABLE", tqdm_disable)
    logger, old_level = get_logger(), get_logger().level
    logger.setLevel(level)  # (setLevel, not the attribute: the logger caches isEnabledFor's answers)
    try:
        bar = progress_bar(10, "work", lines=lines)
    finally:
        logger.setLevel(old_level)
    with bar:
        if isinstance(bar, ProgressLines):
            shown = "lines"
        else:
            shown = "nothing" if bar.disable else "bar"
    assert shown == expected
