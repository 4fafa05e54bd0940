"""FSDP2 (fully_shard) against the unsharded reference and against FSDP1, on a 2-process gloo CPU group."""

import gc
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from transformers import T5ForConditionalGeneration

from configs.paths import EMBEDDED_MODEL_DIR
from policies.mixed_precision import Precision
from scripts.compare_step_losses import step_losses
from tests.dist_harness import run_ranks
from tests.dist_workers import (
    CPU,
    FP32,
    FSDP2_VARIANTS,
    LR,
    _fsdp_config,
    batch_seed,
    checkpoint_worker,
    fsdp_run,
    full_state_against,
    layers_compiled_by,
    make_batch,
    parity_worker,
    reference_run,
    sharded,
    tiny_t5,
    train_wrapped,
)
from tests.hf_folders import assert_folder_is_save_pretrained_of
from tests.launch import pooled, torchrun
from tests.reference_run import (
    SHARDED,
    SMALL_RUN,
    TOTAL_STEPS,
    checkpoint_dir,
    complete_checkpoint_steps,
    read_records,
    step_lrs,
)
from utils.fsdp.shard import COMPILE_RECOMPILE_LIMIT
from utils.model.rank0_loading import UnitMaterializer
from utils.spec import SEQ2SEQ

STEPS = 4


def relative_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def parity():
    return run_ranks(parity_worker, STEPS, "fsdp2")


def test_fsdp2_matches_the_unsharded_reference_for_every_strategy(parity):
    rank0, rank1 = parity
    for name in FSDP2_VARIANTS:
        assert rank0["losses"][name] == rank1["losses"][name], name
        for step, (got, want) in enumerate(zip(rank0["losses"][name], rank0["reference_losses"], strict=True)):
            assert relative_diff(got, want) < 1e-5, f"{name} step {step + 1}: {got} vs {want}"


def test_fsdp2_loses_no_gradient(parity):
    """FSDP2 warns that a unit returning a view, modified in place, skips its pre-backward hook (docs/pitfalls.md
    #15; it warns on T5's checkpointed blocks). Had any gradient been lost, the weights after 4 AdamW
    steps would differ from the unsharded model's; they agree to float rounding for every variant."""
    for name, diff in parity[0]["max_param_diff"].items():
        assert diff < 1e-5, f"{name}: weights differ from the reference by {diff}"


def bf16_worker(rank: int, world_size: int, steps: int) -> dict:
    """bf16 (bfSixteen) per-step losses of both backends."""
    return {
        version: fsdp_run(
            _fsdp_config({"fsdp_version": version}), rank, world_size, steps, Precision("bfSixteen")
        )[0]
        for version in (1, 2)
    }


def test_bf16_losses_of_both_backends_agree_within_bf16_tolerance():
    losses = run_ranks(bf16_worker, STEPS)[0]
    for step, (fsdp1, fsdp2) in enumerate(zip(losses[1], losses[2], strict=True)):
        # bf16 has an 8-bit mantissa (relative precision 2**-8 = 0.4%); both backends round the same way.
        assert relative_diff(fsdp2, fsdp1) < 1e-2, f"step {step + 1}: {fsdp2} vs {fsdp1}"


def test_fsdp2_full_state_checkpoint_and_the_shard_written_export_hold_the_trained_model(tmp_path):
    path = str(tmp_path / "model.pt")
    rank0, rank1 = run_ranks(checkpoint_worker, path, 2)
    assert rank0["saved"] == path and rank1["saved"] is None
    assert rank0["missing"] == [] and rank0["unexpected"] == [] and rank0["tied"]
    assert rank0["max_logit_diff"] <= 1e-5 * max(1.0, rank0["logit_scale"])
    # The export written from the shards: several files (EXPORT_FILE_BYTES), equal to the gathered model.
    assert rank0["export_files"] == rank1["export_files"] > 1
    assert_folder_is_save_pretrained_of(Path(f"{path}.hf"), rank0["gathered"], tmp_path / "save_pretrained")


def rank0_loading_worker(rank: int, world_size: int, fsdp_version: int = 2) -> dict:
    """Only rank 0 has the weights (FSDP2: in its model; FSDP1: in the embedded model's safetensors file,
    every rank on meta); after wrapping, every rank's full state dict must equal them."""
    config = _fsdp_config({"fsdp_version": fsdp_version, "cpu_ram_efficient_loading": True})
    if fsdp_version == 2:
        reference = tiny_t5(seed=123)  # what rank 0 "loaded"
        model, parallelism = sharded(tiny_t5(seed=123) if rank == 0 else tiny_t5(on_meta=True), config, FP32)
        held = None
    else:
        # Live host tensor bytes each time FSDP1 materialises a module, before the reference exists, over those
        # live before loading (a process that ran other work may hold some: only what loading holds counts).
        before = _live_host_tensor_bytes()
        held = []
        original = UnitMaterializer.__call__

        calls = []

        def measured(materializer, module):
            calls.append(module)
            if len(calls) % 8 == 0:  # every 8th module (a gc walk each): the growth a leak makes shows
                held.append(_live_host_tensor_bytes())
            original(materializer, module)

        UnitMaterializer.__call__ = measured
        try:
            model, parallelism = sharded(
                tiny_t5(on_meta=True), config, FP32, weights_source=str(EMBEDDED_MODEL_DIR)
            )
        finally:
            UnitMaterializer.__call__ = original
        held = max(held) - before
        reference = T5ForConditionalGeneration.from_pretrained(EMBEDDED_MODEL_DIR)
    return {
        **full_state_against(model, reference.state_dict()),
        "tied": _lm_head_is_shared(model),
        "any_meta": any(p.is_meta for p in model.parameters()),
        "held_bytes": held,
        "model_bytes": 4 * sum(p.numel() for p in reference.parameters()),
    }


def _live_host_tensor_bytes() -> int:
    """Bytes of every live CPU tensor's storage in this process that a collection sees (those frozen with the
    imports aside: T5_training.kept_for_the_whole_process), each storage once."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            try:
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a fake tensor that an earlier scenario's torch.compile keeps: no memory
                continue
    return sum(storages.values())


def _lm_head_is_shared(model) -> bool:
    """One parameter behind lm_head and shared: FSDP2 keeps the modules, FSDP1 flattens them (one view
    each, of the same flat-parameter slice when the tie survived)."""
    inner = getattr(model, "module", model)
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            return inner.lm_head.weight.data_ptr() == inner.shared.weight.data_ptr()
    return inner.lm_head.weight is inner.shared.weight


@pytest.mark.slow
@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_rank0_only_loading_gives_every_rank_rank0s_weights(fsdp_version):
    for result in run_ranks(rank0_loading_worker, fsdp_version):
        assert result["keys_equal"] and result["max_diff"] == 0.0
        assert result["tied"], "lm_head and shared must stay one parameter"
        assert not result["any_meta"]
        if fsdp_version == 1:  # while wrapping, each unit's full parameters are freed once it is sharded
            # (measured: 0.62x of the fp32 model; 1.38x when a strong memo kept every unit alive)
            assert result["held_bytes"] < 0.9 * result["model_bytes"], result


@pytest.mark.slow
def test_sharded_checkpoint_crosses_backends_with_identical_continued_losses(tmp_path, reference):
    """FSDP2 continues the FSDP1 reference run's step-20 checkpoint to step 22 (--max_steps), FSDP1 continues
    FSDP2's step-22 checkpoint to the end: the losses of the uninterrupted FSDP1 run, both ways across. (The
    checkpoint of a --max_steps end resumes exactly too: the epoch's StepLR step waits for its real end.)"""
    crossed = tmp_path / "crossed"
    # The second resume lifts the first one's --max_steps, which its record would otherwise keep.
    steps = [(2, str(checkpoint_dir(reference, 20)), ["--max_steps", "22"]), (1, "true", ["--max_steps", "0"])]
    for version, resume, extra in steps:
        args = [*SMALL_RUN, "--checkpoint_type", SHARDED, "--fsdp_version", str(version),
                "--output_dir", str(crossed), "--resume", resume, *extra]  # fmt: skip
        # FSDP2's resume from DCP's shards in a new process per rank (through torchrun); FSDP1's back pooled.
        done = (torchrun if version == 2 else pooled)(args)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "resumed from" in done.stdout and f"FSDP{version}:" in done.stdout
        assert f"--fsdp_version {version} (the run had {3 - version})" in done.stdout  # the backend crossed
        if version == 2:  # --max_steps 22 stopped inside epoch 2 (of 2), ended the epoch as usual, saved, exported
            assert sorted(step_losses(crossed)) == [21, 22]
            state = json.loads((checkpoint_dir(crossed, 22) / "train_state.json").read_text())
            assert state["progress"]["global_step"] == 22 and state["progress"]["epoch"] == 2
            assert (crossed / "hf_model" / "model.safetensors").is_file()
            assert [r["epoch"] for r in read_records(crossed) if r["type"] == "epoch"] == [2]
    assert complete_checkpoint_steps(crossed)[-1] == TOTAL_STEPS
    losses, expected = step_losses(crossed), step_losses(reference)
    assert sorted(losses) == list(range(21, TOTAL_STEPS + 1)), sorted(losses)
    for step in losses:  # every step trained after crossing
        assert relative_diff(losses[step], expected[step]) < 1e-5, step
    assert step_lrs(crossed) == {step: lr for step, lr in step_lrs(reference).items() if step > 20}


def compile_worker(rank: int, world_size: int, steps: int, backend: str) -> dict:
    """fp32 per-step losses and final weights with every T5Block compiled (torch.compile `backend`, through
    utils/fsdp/shard.py's own compile_layers), for FSDP1 (original parameters) and FSDP2; then, on FSDP2, an
    evaluation: a no-grad forward twice, generation at two lengths. Where each graph was compiled (the step, or the
    evaluation's phase; counted by the backend's calls, recompiles and graph breaks included); the unsharded,
    uncompiled reference on rank 0."""
    import torch._dynamo

    from utils.eval.generation import generate

    phase: list = [0]
    compiled_at: list = []
    out = {"reference": reference_run(steps, world_size) if rank == 0 else None}
    with layers_compiled_by(backend, lambda: compiled_at.append(phase[0])):
        for version, overrides in ((1, {"use_orig_params": True}), (2, {"fsdp_version": 2})):
            torch._dynamo.reset()
            compiled_at.clear()
            model, parallelism = sharded(tiny_t5(), _fsdp_config({**overrides, "compile": True}), FP32)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            losses = []
            for step in range(steps):
                phase[0] = step
                losses += train_wrapped(model, parallelism, optimizer, rank, world_size, step + 1, first=step)
            state = parallelism.full_state_dict(model, CPU)
            if version == 2:  # the evaluation's graphs are the blocks', alike on both backends: counted once
                model.eval()
                for label in ("validation", "validation again"):
                    phase[0] = label
                    with torch.no_grad():
                        SEQ2SEQ.token_losses(model, make_batch(batch_seed(steps, rank)))
                for label, new_tokens in (("generation", 6), ("generation, other lengths", 9)):
                    phase[0] = label
                    prompts = SEQ2SEQ.prompts(make_batch(batch_seed(steps, rank)))
                    generate(model, parallelism, prompts, {"max_new_tokens": new_tokens})
            out[version] = {"losses": losses, "state": state if rank == 0 else None, "compiled_at": compiled_at[:]}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compiled_blocks_train_like_the_reference_on_both_backends(backend):
    """--compile: every T5Block compiled before sharding (FSDP2; FSDP1 with original parameters) trains like
    the unsharded model. CI uses the aot_eager backend (tracing, FSDP's hooks, activation checkpointing
    and the backward graph as inductor sees them, without minutes of C++ compilation); inductor itself is
    measured by scripts/benchmark.py."""

    rank0 = run_ranks(compile_worker, STEPS, backend, timeout_s=600)[0]
    reference_losses, reference_state = rank0["reference"]
    for version in (1, 2):
        for step, (got, want) in enumerate(zip(rank0[version]["losses"], reference_losses, strict=True)):
            assert relative_diff(got, want) < 1e-5, f"FSDP{version} step {step + 1}: {got} vs {want}"
        diff = max((rank0[version]["state"][k] - v).abs().max().item() for k, v in reference_state.items())
        assert diff < 1e-5, (version, diff)
        # Compiled blocks stay compiled: every training graph (forward and backward of each kind of block,
        # and any recompile) is made in the first step; the later steps, of the same shapes, make none. The
        # evaluation compiles its no-grad forward and generation's cached steps once each: a second
        # validation and a generation of other lengths make none, and generation still compiles (past
        # dynamo's recompile limit it would run uncompiled, and these counts would stop).
        compiled = Counter(rank0[version]["compiled_at"])
        training = {phase: n for phase, n in compiled.items() if isinstance(phase, int)}
        assert set(training) == {0}, (version, compiled)
        if version == 1:  # the evaluation runs on FSDP2 (the blocks' graphs are alike on both)
            continue
        assert compiled["validation"] > 0 and compiled["generation"] > 0, (version, compiled)
        assert compiled["validation again"] == compiled["generation, other lengths"] == 0, (version, compiled)
        assert compiled.total() <= COMPILE_RECOMPILE_LIMIT, (version, compiled)
        print(f"FSDP{version} compiles by phase: {dict(compiled)}")
