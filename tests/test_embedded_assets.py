"""The committed data/sample and data/tiny-t5 are exactly what scripts/make_embedded_assets.py makes.

The script is run once (in a subprocess, into a temporary folder); its output is compared with the committed
copies: byte for byte for the CSV, the split lists and the sentencepiece model, tensor by tensor for the
model weights. Then the committed assets are checked for what the training run relies on.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from configs.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "make_embedded_assets.py"
COMMITTED = REPO_ROOT / "data"
SAMPLE_FILES = ("wikihowAll.csv", "all_train.txt", "all_val.txt", "all_test.txt")
SPLIT_LISTS = {"train": "all_train.txt", "validation": "all_val.txt", "test": "all_test.txt"}


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("assets")
    # Run from another directory: the script must not depend on the current one.
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out_dir", str(out_dir)],
        cwd=out_dir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in out_dir.iterdir()) == ["sample", "tiny-t5"], "temporary folder left behind"
    return out_dir


@pytest.mark.slow  # 10-13 s in the fast subset (docs/development.md: the time budget)
@pytest.mark.parametrize("name", SAMPLE_FILES)
def test_sample_is_byte_identical(regenerated: Path, name: str) -> None:
    assert (regenerated / "sample" / name).read_bytes() == (COMMITTED / "sample" / name).read_bytes(), (
        f"data/sample/{name} is not what scripts/make_embedded_assets.py makes: rerun it and commit"
    )


@pytest.mark.slow  # shares the 10 s regeneration with the sample files' checks
def test_sentencepiece_model_is_byte_identical(regenerated: Path) -> None:
    new = (regenerated / "tiny-t5" / "spiece.model").read_bytes()
    assert new == (COMMITTED / "tiny-t5" / "spiece.model").read_bytes()


@pytest.mark.slow  # shares the 10 s regeneration with the sample files' checks
def test_model_weights_and_config_are_identical(regenerated: Path) -> None:
    from safetensors.torch import load_file
    from transformers import T5Config

    new = load_file(regenerated / "tiny-t5" / "model.safetensors")
    old = load_file(COMMITTED / "tiny-t5" / "model.safetensors")
    assert new.keys() == old.keys()
    for key in old:
        assert new[key].dtype == old[key].dtype, key
        assert torch.equal(new[key], old[key]), key

    def config(folder: Path) -> dict:
        d = T5Config.from_pretrained(folder).to_dict()
        d.pop("transformers_version", None)
        return d

    assert config(regenerated / "tiny-t5") == config(COMMITTED / "tiny-t5")


@pytest.mark.slow  # shares the 10 s regeneration with the sample files' checks
def test_tokenizer_vocabulary_is_identical(regenerated: Path) -> None:
    from transformers import T5Tokenizer

    new = T5Tokenizer.from_pretrained(regenerated / "tiny-t5")
    old = T5Tokenizer.from_pretrained(COMMITTED / "tiny-t5")
    assert new.get_vocab() == old.get_vocab()


# ---------------------------------------------------------------------------------------------------------
# The committed assets themselves
# ---------------------------------------------------------------------------------------------------------


def _rows() -> tuple[list[str], list[list[str]]]:
    with open(COMMITTED / "sample" / "wikihowAll.csv", encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        return next(reader), list(reader)


def _titles(name: str) -> list[str]:
    return (COMMITTED / "sample" / name).read_text(encoding="utf-8").splitlines()


def test_sample_format_and_split_sizes() -> None:
    """The real file's format, and split sizes under the builder's rules (docs/pitfalls.md #12)."""
    header, rows = _rows()
    assert header == ["headline", "title", "text"]
    titles = [row[1].strip().replace(" ", "") for row in rows]
    assert len(set(titles)) == len(titles), "titles must be unique"

    lists = {split: _titles(name) for split, name in SPLIT_LISTS.items()}
    for split, names in lists.items():
        assert len(set(names)) == len(names), split
        assert all(" " not in name for name in names), split
    assert not set(lists["train"]) & set(lists["validation"])
    assert not set(lists["train"]) & set(lists["test"])
    assert not set(lists["validation"]) & set(lists["test"])

    kept = dict.fromkeys(lists, 0)
    dropped_listed = 0
    for row in rows:
        split = next((s for s, names in lists.items() if row[1].strip().replace(" ", "") in names), None)
        ok = len(row) == 3
        if ok:
            headline, _, text = (field.strip() for field in row)
            ok = len(headline) < 0.75 * len(text)
            headline, text = headline.replace(".,", "."), re.sub(r"[.]+[\n]+[,]", ".\n", text)
            ok = ok and bool(headline) and bool(text)
        if split is not None:
            kept[split] += ok
            dropped_listed += not ok
        if ok:
            assert 140 <= len(text) <= 450, row
            assert all(line.endswith(".") for line in headline.split("\n")), row
    assert kept == {"train": 1600, "validation": 320, "test": 320}
    assert dropped_listed >= 5, "the sample should exercise the loader's filter"
    assert len((COMMITTED / "sample" / "wikihowAll.csv").read_bytes()) < 1_500_000


def test_committed_tokenizer_matches_the_model() -> None:
    from transformers import AutoTokenizer, T5Config, T5Tokenizer

    folder = COMMITTED / "tiny-t5"
    tokenizer = T5Tokenizer.from_pretrained(folder)
    config = T5Config.from_pretrained(folder)
    assert len(tokenizer) == config.vocab_size == 1100  # 1000 sentencepiece pieces + 100 <extra_id_*>
    assert tokenizer.convert_tokens_to_ids(["<pad>", "</s>", "<unk>"]) == [0, 1, 2]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (config.pad_token_id, config.eos_token_id)
    assert config.decoder_start_token_id == tokenizer.pad_token_id
    assert tokenizer.convert_tokens_to_ids("<extra_id_0>") == config.vocab_size - 1

    _, rows = _rows()
    headline = rows[0][0].strip().replace(".,", ".")
    ids = tokenizer(headline).input_ids
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True).split() == headline.split()
    assert AutoTokenizer.from_pretrained(folder)(headline).input_ids == ids


def test_committed_model_is_tiny_t5_with_tied_embeddings() -> None:
    from transformers import T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_pretrained(COMMITTED / "tiny-t5")
    c = model.config
    assert (c.d_model, c.d_kv, c.num_heads, c.d_ff, c.num_layers, c.num_decoder_layers) == (64, 16, 4, 256, 2, 2)
    assert c.feed_forward_proj == "relu" and c.tie_word_embeddings
    shared = model.shared.weight
    for tied in (model.encoder.embed_tokens.weight, model.decoder.embed_tokens.weight, model.lm_head.weight):
        assert tied is shared or tied.data_ptr() == shared.data_ptr()
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
