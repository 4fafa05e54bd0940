"""scripts/packing_kernels.py: each attention kernel's packed blocks against the documents alone, and its
speed against the unpacked control, at tiny scale on the CPU (the GPU figures are measured where one is lent)."""

import json

import pytest

import causal_lm_dataset
from scripts.packing_kernels import main


def test_the_kernels_keep_packed_documents_apart_and_a_kernel_that_does_not_is_caught(tmp_path, monkeypatch):
    out = tmp_path / "kernels.json"
    argv = ["--kernels", "sdpa", "eager", "--max_seq_len", "512", "--batch_size", "2", "--steps", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["documents"] > result["blocks"] == 2  # several documents a block
    assert set(result["kernels"]) == {"sdpa", "eager", "sdpa unpacked"}
    for kernel in ("sdpa", "eager"):
        assert result["kernels"][kernel]["max_relative_difference"] < 1e-6
    for entry in result["kernels"].values():
        assert entry["tokens_per_s"] > 0 and entry["tokens"] > 0

    # Control: blocks read without their position ids (a causal mask over the whole block) are caught.
    collate = causal_lm_dataset.causal_collate

    def without_positions(items, pad_token_id):
        batch = collate(items, pad_token_id)
        batch.pop("position_ids", None)
        return batch

    monkeypatch.setattr(causal_lm_dataset, "causal_collate", without_positions)
    assert main([*argv[:-1], "0", "--out", str(out)]) == 1
    assert json.loads(out.read_text())["kernels"]["sdpa"]["max_relative_difference"] > 1e-2


@pytest.mark.slow  # 15-30 s: two timed epochs of a tiny Llama
def test_bfd_packs_the_same_rows_into_fewer_blocks_with_less_padding_and_trains_on_each_token(tmp_path):
    """--strategies: the WikiHow sample's first 24 rows in blocks of 256 tokens, packed by documents (in order)
    and by bfd: bfd makes fewer blocks with a smaller padding share, and an epoch over either trains on the
    same real tokens (every row's, none dropped), fewer steps and computed tokens with bfd."""
    out = tmp_path / "strategies.json"
    argv = ["--strategies", "documents", "bfd", "--data", "wikihow", "--rows", "24", "--max_seq_len", "256",
            "--batch_size", "2", "--repeats", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    documents, bfd = result["strategies"]["documents"], result["strategies"]["bfd"]
    assert result["rows"] == 24 and bfd["blocks"] < documents["blocks"]
    assert bfd["padding_share"] < documents["padding_share"]
    assert bfd["tokens"] == documents["tokens"] and "0.0% of their tokens dropped" in bfd["note"]
    assert bfd["steps"] < documents["steps"] and bfd["computed_tokens"] < documents["computed_tokens"]
    assert bfd["tokens_per_s"] > 0 and documents["tokens_per_s"] > 0
