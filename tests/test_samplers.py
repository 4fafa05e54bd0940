"""The training sampler's order: every sample once per epoch, ranks disjoint, a function of (seed, epoch),
exactly resumable; with --group_by_length, each step's batches of similar length."""

import random
import statistics

import pytest

from utils.data.samplers import TARGET_BUCKET, LengthGrouping, length_keys, train_sampler_for

N, WORLD, BATCH = 3000, 2, 4  # 3 mega-batches of 256 batches
RNG = random.Random(7)
LENGTHS = [RNG.randint(10, 5000) for _ in range(N)]


def dealt(grouped: bool, epoch: int = 0, consumed: int = 0, seed: int = 1, world: int = WORLD) -> list[list[int]]:
    """Each rank's indices for the epoch, from `consumed` samples on."""
    grouping = LengthGrouping(LENGTHS, BATCH) if grouped else None
    out = []
    for rank in range(world):
        sampler = train_sampler_for(range(N), rank, world, seed, grouping)
        sampler.set_epoch(epoch, consumed)
        out.append(list(sampler))
    return out


def step_spreads(ranks: list[list[int]]) -> list[int]:
    """Per step, max - min length over the batches of all ranks."""
    steps = len(ranks[0]) // BATCH
    spreads = []
    for step in range(steps):
        lengths = [LENGTHS[i] for rank in ranks for i in rank[step * BATCH : (step + 1) * BATCH]]
        spreads.append(max(lengths) - min(lengths))
    return spreads


@pytest.mark.parametrize("grouped", [False, True])
def test_every_sample_once_per_epoch_on_disjoint_ranks(grouped):
    ranks = dealt(grouped)
    assert sorted(ranks[0] + ranks[1]) == list(range(N))


def test_grouping_gives_each_step_similar_lengths():
    plain, grouped = statistics.mean(step_spreads(dealt(False))), statistics.mean(step_spreads(dealt(True)))
    assert grouped < plain / 10, (grouped, plain)  # measured: about 110x narrower


def test_grouping_by_target_then_source_pads_less_on_both_sides():
    """--length_key target_then_source: a step's summaries within one bucket but at the mega-batches' edges,
    and less padding of source plus target than grouping by the source alone (which leaves the summaries
    shuffled) where most articles fill the source length, as WikiHow's do at 512 tokens."""
    sources = [min(length, 512) for length in LENGTHS]
    targets = [RNG.randint(5, 300) for _ in range(N)]

    def padded(keys) -> tuple[float, list[int]]:
        grouping = LengthGrouping(keys, BATCH)
        ranks = [list(train_sampler_for(range(N), rank, WORLD, 1, grouping)) for rank in range(WORLD)]
        pads, spreads = 0, []
        for rank in ranks:
            for start in range(0, len(rank) - BATCH + 1, BATCH):
                batch = rank[start : start + BATCH]
                for side in (sources, targets):
                    pads += max(side[i] for i in batch) * BATCH - sum(side[i] for i in batch)
                spreads.append(max(targets[i] for i in batch) - min(targets[i] for i in batch))
        return pads, spreads

    by_source, _ = padded(length_keys(sources, targets, "source"))
    both, spreads = padded(length_keys(sources, targets, "target_then_source"))
    assert both < by_source / 2, (both, by_source)
    assert statistics.median(spreads) < TARGET_BUCKET, spreads
    assert length_keys(LENGTHS, targets, "source") is LENGTHS


@pytest.mark.parametrize("grouped", [False, True])
def test_order_is_a_function_of_seed_and_epoch(grouped):
    assert dealt(grouped, epoch=3) == dealt(grouped, epoch=3)
    assert dealt(grouped, epoch=3) != dealt(grouped, epoch=4)
    assert dealt(grouped, epoch=3) != dealt(grouped, epoch=3, seed=2)


@pytest.mark.parametrize("grouped", [False, True])
def test_a_resume_continues_the_same_order(grouped):
    whole = dealt(grouped, epoch=2)
    for steps_done in (1, 17, 60):
        rest = dealt(grouped, epoch=2, consumed=steps_done * BATCH * WORLD)
        assert rest == [rank[steps_done * BATCH :] for rank in whole], steps_done


@pytest.mark.parametrize("grouped", [False, True])
def test_a_resume_on_another_world_size_sees_every_sample_once(grouped):
    """30 steps on 2 ranks, then the rest of the epoch on 1 rank (and the other way): no sample twice, none
    lost. The grouping's mega-batches do not depend on the number of ranks."""
    for before, after in ((2, 1), (1, 2)):
        steps = 30
        first = [i for rank in dealt(grouped, world=before) for i in rank[: steps * BATCH]]
        rest = [i for rank in dealt(grouped, consumed=steps * BATCH * before, world=after) for i in rank]
        assert sorted(first + rest) == list(range(N)), (before, after)


def test_an_epoch_every_real_sample_of_which_was_trained_is_over_on_any_world_size():
    """32 samples on 2 ranks end the epoch at 32 consumed; on 3 ranks the epoch's list is padded to 33, and the
    one entry left after 32 is a repeat: no step remains."""
    for world in (2, 3, 5):
        samplers = [train_sampler_for(range(32), rank, world, seed=1) for rank in range(world)]
        for sampler in samplers:
            sampler.set_epoch(0, samples_consumed=32)
        assert [len(s) for s in samplers] == [0] * world and [list(s) for s in samplers] == [[]] * world, world
    # the control: 30 consumed on 2 ranks leave 2 real samples, one step of 3 on 3 ranks (one of them a repeat)
    trained = [i for rank in range(2) for i in list(train_sampler_for(range(32), rank, 2, seed=1))[:15]]
    samplers = [train_sampler_for(range(32), rank, 3, seed=1) for rank in range(3)]
    for sampler in samplers:
        sampler.set_epoch(0, samples_consumed=30)
    left = [i for sampler in samplers for i in sampler]
    assert [len(s) for s in samplers] == [1, 1, 1] and set(trained) | set(left) == set(range(32)), left


def test_fewer_samples_left_than_ranks_still_give_every_rank_its_steps():
    """33 samples, 32 consumed on 2 ranks, resumed on 3: one real sample left, and every rank takes one step
    (a rank without one would skip the others' collectives)."""
    samplers = [train_sampler_for(range(33), rank, 3, seed=1) for rank in range(3)]
    for sampler in samplers:
        sampler.set_epoch(0, samples_consumed=32)
    dealt_out = [list(sampler) for sampler in samplers]
    assert [len(s) for s in samplers] == [1, 1, 1] and [len(d) for d in dealt_out] == [1, 1, 1], dealt_out
    assert len({i for d in dealt_out for i in d}) == 1  # the one sample left, and its repeats


def test_padding_share_counts_each_sides_padding_over_what_the_model_sees():
    """scripts/padding_share.py: one batch of articles of 1 and 3 tokens, summaries of 2: 2 padded source
    tokens of 6, none of the target's 4, 2 of all 10."""
    from scripts.padding_share import padded_shares

    for order in ("shuffled", "source", "target_then_source"):
        shares = padded_shares([1, 3], [2, 2], batch_size=2, nproc=1, order=order)
        assert shares == pytest.approx((2 / 6, 0, 2 / 10)), order
