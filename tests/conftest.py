"""Shared fixtures: runs that several test modules compare with (trained once a session), the package
logger's records, and a tiny T5 tokenizer trained here."""

import logging
import random
from pathlib import Path

import pytest

from tests.reference_run import train_reference
from utils.log import get_logger


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted 2-rank SHARDED_STATE_DICT run of tests/reference_run.py (read-only: copy it to
    resume into it)."""
    return train_reference(tmp_path_factory.mktemp("reference") / "out")


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
