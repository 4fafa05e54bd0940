"""A stop request (SIGTERM, Ctrl-C) is agreed by the ranks' vote a step after the step it came in, waiting for
nothing (utils/train/preemption.py: StopVote), and saved there: within two optimizer steps of the signal on
FSDP1 and FSDP2, at its own step on one unwrapped rank, whatever --log_every_n_steps is; the signal's line names
that step. A vote still in flight when its group is torn down ends with the peer's side of the group."""

import time

import pytest
import torch.distributed as dist

from tests.dist_harness import run_ranks
from tests.launch import pooled
from tests.reference_run import complete_checkpoint_steps, logged_steps
from utils.train.preemption import StopRequest, StopVote

PASS_STEPS = 6


def _vote_worker(rank: int, world_size: int, request_at: int | None) -> tuple:
    """(the step after which the vote agrees on a stop, or None; what settling the vote in flight at the pass's
    end says; the step rank 1's request was told it is saved at) for a pass of PASS_STEPS steps, when rank 1
    alone is asked to stop during step `request_at` (None: never)."""
    vote, request = StopVote(world_size), StopRequest()
    vote.expect(request, 0, PASS_STEPS)
    told = None
    for step in range(1, PASS_STEPS + 1):
        if rank == 1 and step == request_at:  # a signal during the step, before its vote
            told, request.requested = request.save_step, True
        if vote.after_step(request, step, PASS_STEPS):
            return step, vote.settle(), told
    return None, vote.settle(), told


@pytest.mark.parametrize("request_at, agreed", [(1, 2), (4, 5), (5, 6), (PASS_STEPS, None), (None, None)])
def test_every_rank_agrees_on_a_stop_after_the_step_after_the_request(request_at, agreed):
    """Rank 1 alone is asked; both agree after the same step, the one after the request, which the request was
    told. Asked during the pass's last step, the vote is still in flight at its end: settling it says so (the
    epoch's end saves, and agrees again). The control: no request, no stop."""
    told, settled = (min(request_at + 1, PASS_STEPS), True) if request_at else (None, False)
    assert run_ranks(_vote_worker, request_at) == [(agreed, settled, None), (agreed, settled, told)]


def test_one_rank_needs_no_vote_and_stops_after_the_step_it_was_asked_in():
    vote, request = StopVote(world_size=1), StopRequest()
    assert vote.group is None  # no process group is touched
    assert not vote.after_step(request, 1, 10) and request.save_step == 2
    request.requested = True
    assert vote.after_step(request, 2, 10)


def _torn_down_worker(rank: int, world_size: int, both_cast: bool) -> bool:
    """Rank 0 casts a vote (and rank 1 too, with `both_cast`), then both tear the process group down as a
    failed run does, the vote unread: whether rank 0's vote has ended within 10 s."""
    vote, request = StopVote(world_size), StopRequest()
    if rank == 0 or both_cast:
        vote.after_step(request, 1, 10)
    dist.destroy_process_group()
    if vote.pending is None:
        return True
    work, _ = vote.pending
    deadline = time.monotonic() + 10
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    return work.is_completed()


@pytest.mark.parametrize("both_cast", [True, False])
def test_a_vote_in_flight_ends_when_the_group_is_torn_down(both_cast):
    """Cast by both, it has arrived; cast by rank 0 alone (its peer failed first), it ends in an error as the
    peer's group goes, so the rank's exit does not wait for the group's timeout."""
    assert run_ranks(_torn_down_worker, both_cast) == [True, True]


# A signal to every rank (as torchrun forwards it) as step 3 starts; the step log flushes every 5 steps, where a
# stop agreed on its all-reduce would save (step 5). 64 samples: 8 steps on 2 ranks, 16 on one.
SIGNAL_STEP, LOG_EVERY = 3, 5
STOPS = {  # case: (flags, ranks, signal, the step saved at)
    "FSDP1": (["--fsdp_version", "1"], 2, "SIGINT", SIGNAL_STEP + 1),
    "FSDP2": (["--fsdp_version", "2"], 2, "SIGTERM", SIGNAL_STEP + 1),
    "one rank unwrapped": (["--single_rank_fsdp", "false"], 1, "SIGTERM", SIGNAL_STEP),
}


@pytest.mark.parametrize("case", list(STOPS))
def test_a_signal_is_saved_within_two_steps_at_the_step_its_line_names(tmp_path, case):
    flags, nproc, name, saved_at = STOPS[case]
    output_dir = tmp_path / "out"
    args = ["--epochs", "1", "--num_train_samples", "64", "--num_val_samples", "8", "--eval_rouge", "false",
            "--mixed_precision", "false", "--log_every_n_steps", str(LOG_EVERY), "--save_every_n_steps", "1000",
            *flags, "--output_dir", str(output_dir)]  # fmt: skip
    ranks = ",".join(str(rank) for rank in range(nproc))
    env = {"SIGNAL_STEP": str(SIGNAL_STEP), "SIGNAL_RANKS": ranks, "SIGNAL": name}
    run = pooled(args, nproc=nproc, env=env, script="tests/signal_entry.py")
    assert run.returncode == 0, run.describe()
    said = f"received {name}: saving a checkpoint at step {saved_at}, then stop"
    assert run.output.count(said) == 1, run.describe()
    assert f"stopped at step {saved_at} on {name}; continue with --resume true" in run.output, run.describe()
    assert complete_checkpoint_steps(output_dir) == [saved_at]
    assert logged_steps(output_dir) == list(range(1, saved_at + 1))  # every step saved, and none after
