"""Shared fixtures: runs that several test modules compare with (trained once a session), the package
logger's records, and a tiny T5 tokenizer trained here."""

import logging
import random
from pathlib import Path

import pytest

from tests import rank_pool
from tests.launch import Background
from tests.reference_run import train_reference
from utils.base.log import get_logger


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted 2-rank SHARDED_STATE_DICT run of tests/reference_run.py (read-only: copy it to
    resume into it)."""
    return train_reference(tmp_path_factory.mktemp("reference") / "out")


# The README demo (tests/test_demo_figures.py), the suite's longest launch (50 s alone on this project's Xeon
# cores, 4 minutes on the earlier EPYC), starts with the session and runs beside the other tests, which leave
# the cores idle about a fifth of the time (waiting for launches to start, for collective timeouts, for
# signals); its tests run last.
DEMO_TIMEOUT_S = 1800


def reads_the_demo(item) -> bool:
    return "fresh_demo" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items) -> None:
    items.sort(key=reads_the_demo)  # stable: the other tests keep their order


@pytest.fixture(scope="session", autouse=True)
def demo_launch(request, tmp_path_factory):
    """The README's demo command in the background, started before the first test when a selected test reads
    it (None otherwise); killed at the session's end if still running."""
    if not any(reads_the_demo(item) for item in request.session.items):
        yield None
        return
    folder = tmp_path_factory.mktemp("demo")
    run = Background(["--output_dir", str(folder / "out")], folder / "demo.log")
    yield run
    if run.proc.poll() is None:
        run.kill()


def uses_the_rank_pool(item) -> bool:
    module = getattr(item, "module", None)
    return any(hasattr(module, name) for name in ("run_ranks", "pooled"))


@pytest.fixture(scope="session", autouse=True)
def rank_pool_started(request) -> None:
    """The rank pool's imports started with the session when a selected test uses the pool, so that they
    (about 3 s) run beside the tests before the first that does."""
    if any(uses_the_rank_pool(item) for item in request.session.items):
        rank_pool.pool().start_imports()


@pytest.fixture(scope="session")
def fresh_demo(demo_launch) -> Path:
    """The output folder of the README's demo command, run once beside the other tests."""
    run = demo_launch.finish(timeout=DEMO_TIMEOUT_S)
    assert run.returncode == 0, run.describe()
    return demo_launch.log_path.parent / "out"


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def log_records():
    """Records of the package logger. Its own handler: setup_logging() turns propagation (caplog) off."""
    logger = get_logger()
    handler, old_level = _ListHandler(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


_WORDS = (
    "the a to and it of in for is pour flour into bowl add water knead ten minutes put oven wait enjoy "
    "mix bake loaf zebra hay every morning give feed pick ripe apples look branch easily come off "
    "summarize step one two text summary"
).split()


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """A real T5Tokenizer on a sentencepiece model of ~200 pieces trained on generated sentences."""
    sentencepiece = pytest.importorskip("sentencepiece")
    transformers = pytest.importorskip("transformers")
    rng = random.Random(0)
    sentences = [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))) + rng.choice([".", ",", ";", ":"])
        for _ in range(400)
    ]
    folder = tmp_path_factory.mktemp("t5_tokenizer")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_prefix=str(folder / "spiece"),
        vocab_size=200,
        hard_vocab_limit=False,  # the corpus may not support 200 pieces; fewer is fine
        character_coverage=1.0,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        minloglevel=2,
    )
    # From the folder: T5Tokenizer(vocab_file=...) does not load the vocabulary in transformers 5.
    return transformers.T5Tokenizer.from_pretrained(str(folder))


# A test of the fast subset (not marked slow) that takes longer than this, its fixtures' setup included, is
# listed at the end of the run: when the fast subset is over its budget, the first to make faster or mark slow.
# A list, never a failure: no test depends on the machine's speed.
FAST_TEST_LIMIT_S = 5.0
_seconds: dict[str, float] = {}
_slow_marked: set[str] = set()


def pytest_runtest_logreport(report) -> None:
    if report.when in ("setup", "call"):
        _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
        if "slow" in report.keywords:
            _slow_marked.add(report.nodeid)


def pytest_terminal_summary(terminalreporter) -> None:
    """The tests of the fast subset that were not fast on this machine, and how many rank processes the session
    started and why any was replaced (tests/rank_pool.py)."""
    over = sorted(
        (
            (seconds, test)
            for test, seconds in _seconds.items()
            if test not in _slow_marked and seconds > FAST_TEST_LIMIT_S
        ),
        reverse=True,
    )
    if over:
        terminalreporter.write_line(f"not marked slow, but over {FAST_TEST_LIMIT_S:g} s here (setup included):")
        for seconds, test in over:
            terminalreporter.write_line(f"  {seconds:6.1f} s  {test}")
    for line in rank_pool.summary():
        terminalreporter.write_line(line)
