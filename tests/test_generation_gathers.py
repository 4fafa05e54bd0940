"""--gather_for_generation: generation under FULL_SHARD gathers each layer unit once per evaluation instead of
once per generated token, writes the same tokens, and leaves every unit sharded for training, which goes on
exactly as after a generation that gathered per token. Counted on 2 gloo ranks: both FSDP versions, a hybrid
mesh with original parameters, bf16."""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

from configs.fsdp import FSDPConfig
from policies.mixed_precision import Precision
from policies.private_api import fsdp1_unsharded_flat_parameter
from tests.dist_harness import run_ranks
from tests.dist_workers import FP32, LR, _fsdp_config, make_batch, sharded, tiny_t5, train_wrapped
from utils.fsdp.parallelism import Unwrapped
from utils.spec import SEQ2SEQ

GATHER_TOKENS = (2, 4)  # new tokens of two generations: their difference in all-gathers is per token


GATHER_VARIANTS = {  # name: (FSDP overrides, precision)
    "FSDP1": ({"fsdp_version": 1}, FP32),
    "FSDP2": ({"fsdp_version": 2}, FP32),
    "FSDP1 HYBRID_SHARD, original parameters": (
        {"sharding_strategy": "HYBRID_SHARD", "use_orig_params": True},
        FP32,
    ),
    "FSDP2 bf16": ({"fsdp_version": 2}, Precision("bfSixteen_fp32_reduce")),
}


def generation_gathers_worker(rank: int, world_size: int) -> dict:
    """For each of GATHER_VARIANTS, with and without --gather_for_generation: the all-gathers of a greedy
    generation of each of GATHER_TOKENS new tokens, its token ids, whether every unit is sharded again after it,
    and the loss of a training step after it."""
    from scripts.gpu_check import AllGatherCount
    from utils.eval.generation import gathered_for_generation, generate

    out = {}
    settings = {"num_beams": 1, "do_sample": False}
    for name, (overrides, precision) in GATHER_VARIANTS.items():
        for keep in (False, True):
            model, parallelism = sharded(tiny_t5(seed=3), _fsdp_config(overrides), precision)
            model.eval()
            counts, ids = {}, {}
            for tokens in GATHER_TOKENS:
                counter = AllGatherCount()
                with counter, gathered_for_generation(model, parallelism, keep):
                    ids[tokens] = generate(
                        model,
                        parallelism,
                        SEQ2SEQ.prompts(make_batch(rank, rows=2)),
                        {**settings, "max_new_tokens": tokens, "min_new_tokens": tokens},
                    ).tolist()
                counts[tokens] = counter.count
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            out[(name, keep)] = {
                "whole_numel": parallelism.param_numel_whole(model),
                "all_gathers": counts,
                "ids": ids,
                "sharded_after": all_units_sharded(model),
                "losses_after": train_wrapped(model, parallelism, optimizer, rank, world_size, 1),
            }
    return out


def all_units_sharded(model: nn.Module) -> bool:
    """No unit holds its gathered parameters: FSDP1's unsharded buffers freed, FSDP2's parameters DTensors."""
    if isinstance(model, FSDP):
        buffers = [fsdp1_unsharded_flat_parameter(unit) for unit in FSDP.fsdp_modules(model)]
        return all(b is None or b.untyped_storage().size() == 0 for b in buffers)
    return all(isinstance(p, DTensor) for p in model.parameters())


@pytest.fixture(scope="module")
def runs():
    return run_ranks(generation_gathers_worker)


def per_token(counts: dict) -> float:
    fewer, more = GATHER_TOKENS
    return (counts[more] - counts[fewer]) / (more - fewer)


@pytest.mark.parametrize("variant", GATHER_VARIANTS)
def test_kept_units_are_gathered_once_and_write_the_same_tokens(runs, variant):
    layers = len(tiny_t5(on_meta=True).decoder.block)
    for rank, out in enumerate(runs):
        every_token, kept = out[(variant, False)], out[(variant, True)]
        # Per token: every decoder layer unit again (and, FSDP2, the root's forward method); kept: none.
        assert per_token(every_token["all_gathers"]) >= layers, (rank, every_token["all_gathers"])
        assert per_token(kept["all_gathers"]) == 0, (rank, kept["all_gathers"])
        assert kept["all_gathers"][GATHER_TOKENS[0]] < every_token["all_gathers"][GATHER_TOKENS[0]], rank
        assert kept["ids"] == every_token["ids"], rank
        assert kept["sharded_after"] and every_token["sharded_after"], rank
        assert kept["losses_after"] == every_token["losses_after"], rank  # bit for bit
        # what auto weighs: the whole model, neither the shard nor one copy per replica
        assert every_token["whole_numel"] == sum(p.numel() for p in tiny_t5(on_meta=True).parameters()), rank


def test_auto_keeps_what_fits_in_half_the_free_memory(monkeypatch):
    from utils.eval import generation

    model = tiny_t5()
    unwrapped = Unwrapped(FSDPConfig(single_rank_fsdp=False))  # counts the parameters as they are
    numel = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(generation.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(generation, "any_rank", lambda flag, device: flag)  # one rank standing for all
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cpu = torch.device("cpu")
    for free, keep in ((4 * numel * 2, True), (4 * numel * 2 - 2, False), (None, False)):
        monkeypatch.setattr(generation, "available_memory", lambda free=free: free)
        assert generation.keep_gathered(model, unwrapped, "auto", torch.float32, cpu) is keep, free
    monkeypatch.setattr(generation, "available_memory", lambda: 2 * numel * 2)  # bf16 needs half
    assert generation.keep_gathered(model, unwrapped, "auto", torch.bfloat16, cpu)
    assert not generation.keep_gathered(model, unwrapped, "auto", torch.float32, cpu)
    assert generation.keep_gathered(model, unwrapped, "true", torch.float32, cpu)
    assert not generation.keep_gathered(model, unwrapped, "false", torch.bfloat16, cpu)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # the host's memory is shared by its ranks
    assert not generation.keep_gathered(model, unwrapped, "auto", torch.bfloat16, cpu)
    monkeypatch.setattr(generation.dist, "get_world_size", lambda: 1)
    # one rank: nothing to gather
    assert not generation.keep_gathered(model, unwrapped, "auto", torch.bfloat16, cpu)
