"""No host sync in a training step: on a GPU each makes the host wait for the device's queued work before it can
queue more (HostReads, below, lists what counts). The step's statistics stay on the device
until the step log's flush, once per --log_every_n_steps; a validation pass reads its stop flag a batch late.
What is left is transformers' own: its attention-mask helper asks whether a padding mask is all ones (to
skip the mask where nothing is padded), once for the encoder and once for the cross-attention of every
forward; with --attn_implementation t5_flex, whose mask never asks, nothing at all."""

import contextlib
import traceback
from pathlib import Path

import pytest
import torch

from configs.paths import REPO_ROOT
from policies.private_api import TorchDispatchMode
from tests.dist_harness import run_ranks
from tests.dist_workers import CPU, FP32, LR, _fsdp_config, batch_seed, make_batch, sharded, tiny_t5
from utils.base.log import ProgressLines
from utils.data.loaders import move_batch
from utils.distributed.process_group import StopAgreed, StopCheck
from utils.model import t5_attention
from utils.observe.flops import Seq2SeqFlops
from utils.spec import SEQ2SEQ
from utils.train import step as step_module
from utils.train.step import train_step, validate
from utils.train.step_log import StepLog

TRANSFORMERS_MASKS = "transformers/masking_utils.py"
FORWARDS, VALIDATION_BATCHES = 2, 3  # a step of two micro-batches


def reads_by_origin(reads: list) -> dict:
    counts: dict = {}
    for op, package, library in reads:
        key = (op, library) if library == TRANSFORMERS_MASKS else (op, package, library)
        counts[key] = counts.get(key, 0) + 1
    return counts


# What makes a CUDA host wait for the device: reading a value back (.item(), float(), bool()), a tensor made
# from Python data (torch.tensor: a copy from pageable memory, which waits for the stream), and ops whose
# output size depends on the values (nonzero, boolean-mask indexing). On CPU they cost nothing, but the same
# ops run on a GPU, so counting them here tells what a GPU step waits for.
HOST_READ_OPS = {"_local_scalar_dense", "lift_fresh", "nonzero", "masked_select"}


class HostReads(TorchDispatchMode):
    """Each op of HOST_READ_OPS that runs inside it: (op, the package's line that asked for it, the library
    file under it that made the op, or "")."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        boolean_index = name == "index" and any(
            index is not None and index.dtype == torch.bool for index in (args[1] if len(args) > 1 else [])
        )
        if name in HOST_READ_OPS or boolean_index:
            self.reads.append((name, *self.callers()))
        return func(*args, **(kwargs or {}))

    @staticmethod
    def callers() -> tuple[str, str]:
        """The innermost frame of the package's own code (not the tests'), and the innermost file of a library
        other than torch (transformers, peft) below it."""
        frames = traceback.extract_stack()[:-3]
        libraries = [f for f in frames if "site-packages" in f.filename and "/torch/" not in f.filename]
        own = [
            f
            for f in frames
            if f.filename.startswith(str(REPO_ROOT))
            and not {"tests", "site-packages"} & set(Path(f.filename).parts)
        ]
        package = f"{Path(own[-1].filename).name}:{own[-1].lineno} ({own[-1].line})" if own else ""
        library = libraries[-1].filename.split("site-packages/")[-1] if libraries else ""
        return package, library


def host_reads_worker(rank: int, world_size: int, kernel: str = "sdpa") -> dict:
    """For each FSDP version, the host reads of a training step as the trainer takes it (2 accumulated
    micro-batches, clipping, the non-finite check, FLOPs counted, the step's statistics recorded), after a first
    step that sets FSDP up, and of a validation pass of 3 batches that watches for a stop request; the model's
    attention is `kernel`."""
    t5_attention.register()
    out = {}
    for version in (1, 2):
        config = _fsdp_config({"fsdp_version": version, "fsdp_activation_checkpointing": True})
        model, parallelism = sharded(tiny_t5(attn_implementation=kernel), config, FP32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        settings = step_module.StepSettings(
            parallelism,
            max_grad_norm=1.0,
            sync_each_micro_batch=False,
            skip_nonfinite=True,
            flops=Seq2SeqFlops.from_config(tiny_t5(on_meta=True).config),
            recompute=True,
            spec=SEQ2SEQ,
        )
        step_log = StepLog(every=100, on_flush=lambda records: None)
        steps = HostReads()
        for step in range(2):
            micro_batches = [move_batch(make_batch(batch_seed(step, rank) + k), CPU) for k in range(2)]
            with steps if step else contextlib.nullcontext():
                stats = train_step(model, micro_batches, optimizer, None, world_size, settings)
                step_log.add(step + 1, LR, stats)
        step_log.flush()  # a host read by design, once per --log_every_n_steps: outside the recording
        loader = [make_batch(batch_seed(9, rank) + k) for k in range(3)]
        validation = HostReads()
        with validation:
            validate(model, loader, device=CPU, num_real_samples=9,
                     progress=ProgressLines(3, "validation", "batch"), stop_requested=lambda: False,
                     spec=SEQ2SEQ)  # fmt: skip
        out[version] = {"steps": steps.reads, "validation": validation.reads}
    return out


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


def stop_check_worker(rank: int, world_size: int, request_at: int, batches: int) -> int | None:
    """The batch at which StopCheck raises StopAgreed on this rank (None: the pass ended) when rank 1 is asked
    to stop before batch `request_at`."""
    check = StopCheck(lambda: rank == 1 and batch >= request_at, CPU)
    for batch in range(batches):  # noqa: B007 - the stop request reads it
        try:
            check()
        except StopAgreed:
            return batch
    return None


@pytest.mark.parametrize(
    "request_at, batches, stopped_at",
    [(1, 5, 2), (0, 5, 1), (4, 5, None), (0, 1, None)],
)
def test_every_rank_stops_at_the_same_batch_one_after_the_request(request_at, batches, stopped_at):
    """Rank 1 alone is asked to stop; both raise at the batch after it, read a batch late. A request at the
    last batch (or in a pass of one batch) lets the pass end: the trainer's checks after it see the request."""
    assert run_ranks(stop_check_worker, request_at, batches) == [stopped_at, stopped_at]
