"""No host sync in a training step: on a GPU each makes the host wait for the device's queued work before it can
queue more (tests/dist_workers.py: HostReads lists what counts). The step's statistics stay on the device
until the step log's flush, once per --log_every_n_steps; a validation pass reads its stop flag a batch late.
What is left is transformers' own: its attention-mask helper asks whether a padding mask is all ones (to
skip the mask where nothing is padded), once for the encoder and once for the cross-attention of every
forward; with --attn_implementation t5_flex, whose mask never asks, nothing at all."""

import pytest

from tests.dist_harness import run_ranks
from tests.dist_workers import host_reads_worker, stop_check_worker

TRANSFORMERS_MASKS = "transformers/masking_utils.py"
FORWARDS, VALIDATION_BATCHES = 2, 3  # a step of two micro-batches


def reads_by_origin(reads: list) -> dict:
    counts: dict = {}
    for op, package, library in reads:
        key = (op, library) if library == TRANSFORMERS_MASKS else (op, package, library)
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_a_training_step_reads_nothing_back_but_transformers_mask_check():
    for rank, versions in enumerate(run_ranks(host_reads_worker)):
        for version, reads in versions.items():
            where = f"FSDP{version}, rank {rank}"
            masks = ("_local_scalar_dense", TRANSFORMERS_MASKS)
            assert reads_by_origin(reads["steps"]) == {masks: 2 * FORWARDS}, f"{where}: {reads['steps']}"
            # validation: the same per forward, and the stop flag of each batch but the last, read a batch late
            stop_flag = [r for r in reads["validation"] if "host.item()" in r[1]]
            assert len(stop_flag) == VALIDATION_BATCHES - 1, f"{where}: {reads['validation']}"
            others = [r for r in reads["validation"] if r not in stop_flag]
            assert reads_by_origin(others) == {masks: 2 * VALIDATION_BATCHES}, f"{where}: {others}"


def test_with_t5_flex_a_training_step_reads_nothing_back():
    for rank, versions in enumerate(run_ranks(host_reads_worker, "t5_flex")):
        for version, reads in versions.items():
            where = f"FSDP{version}, rank {rank}"
            assert reads["steps"] == [], f"{where}: {reads['steps']}"
            stop_flag = [r for r in reads["validation"] if "host.item()" in r[1]]
            assert reads["validation"] == stop_flag and len(stop_flag) == VALIDATION_BATCHES - 1, where


@pytest.mark.parametrize(
    "request_at, batches, stopped_at",
    [(1, 5, 2), (0, 5, 1), (4, 5, None), (0, 1, None)],
)
def test_every_rank_stops_at_the_same_batch_one_after_the_request(request_at, batches, stopped_at):
    """Rank 1 alone is asked to stop; both raise at the batch after it, read a batch late. A request at the
    last batch (or in a pass of one batch) lets the pass end: the trainer's checks after it see the request."""
    assert run_ranks(stop_check_worker, request_at, batches) == [stopped_at, stopped_at]
