"""One rank without FSDP (--single_rank_fsdp false): the model itself trains, in fp32 exactly as the unsharded
reference does and as FSDP1 at world size 1 does; in bf16 under autocast; its checkpoints and exports are
FSDP's, so a run resumes across the two forms step for step. In-process cases on a gloo group of this
process; the whole program on one pooled rank."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import T5ForConditionalGeneration

from configs.errors import ConfigError
from configs.validate import check_settings
from policies.mixed_precision import Precision
from policies.private_api import compiled_graphs
from scripts.compare_step_losses import step_losses
from tests.dist_harness import one_process_group
from tests.dist_workers import (
    CPU,
    FP32,
    LR,
    _fsdp_config,
    _split_rows,
    accumulation_reference,
    batch_seed,
    layers_compiled_by,
    make_batch,
    reference_run,
    sharded,
    tiny_t5,
    train_wrapped,
)
from tests.launch import pooled
from tests.reference_run import read_records
from tests.run_configs import run_config
from utils.eval.generation import generate
from utils.fsdp.parallelism import FSDP1, Parallelism
from utils.spec import SEQ2SEQ
from utils.train.step import StepSettings, train_step
from utils.train.step_log import StepLog

STEPS = 3
UNWRAPPED = {"single_rank_fsdp": False}
BF16 = Precision("bfSixteen_fp32_reduce")


def one_rank_model(precision: Precision = FP32, **overrides) -> tuple[torch.nn.Module, Parallelism]:
    return sharded(tiny_t5(), _fsdp_config({**UNWRAPPED, **overrides}), precision)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_unwrapped_model_trains_as_the_unsharded_reference(checkpointing):
    reference_losses, reference_state = reference_run(STEPS, world_size=1)
    with one_process_group():
        model, parallelism = one_rank_model(fsdp_activation_checkpointing=checkpointing)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = train_wrapped(model, parallelism, optimizer, rank=0, world_size=1, steps=STEPS)
        # the control: the same settings but the flag wrap the model in FSDP1
        wrapped, fsdp1 = sharded(tiny_t5(), _fsdp_config({"fsdp_activation_checkpointing": checkpointing}), FP32)
    assert isinstance(model, T5ForConditionalGeneration) and parallelism.units(model) == []
    assert isinstance(fsdp1, FSDP1) and len(fsdp1.units(wrapped)) == 5  # the root and the 4 T5Blocks
    # reported from float64 sums (the reference: a float32 mean)
    assert losses == pytest.approx(reference_losses, rel=1e-6)
    state = model.state_dict()
    assert max((state[name] - value).abs().max().item() for name, value in reference_state.items()) < 1e-6


def test_bf16_runs_under_autocast_with_fp32_weights_and_generates_as_plain_generate_does():
    batch = make_batch(seed=5)
    prompts = SEQ2SEQ.prompts(batch)
    with one_process_group():
        model, parallelism = one_rank_model(BF16)
        model.eval()
        with torch.no_grad():
            logits = model(**prompts, decoder_input_ids=batch["target_ids"]).logits
        # generate calls the encoder without forward: its matmuls are in bf16 too
        encoder_query = model.encoder.block[0].layer[0].SelfAttention.q
        dtypes = []
        hook = encoder_query.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
        tokens = generate(model, parallelism, prompts, {"max_new_tokens": 6})
        hook.remove()
        autocast_after = torch.is_autocast_enabled("cpu")
        fp32_model, _ = one_rank_model(FP32)  # the control: fp32 computes in fp32
        with torch.no_grad():
            fp32_logits = fp32_model(**prompts, decoder_input_ids=batch["target_ids"]).logits
    assert logits.dtype == torch.bfloat16 and fp32_logits.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert dtypes == [torch.bfloat16]
    assert not autocast_after  # generate's autocast, entered around forward's, left nothing switched on
    # The reference: the stock model's own generate under autocast, as HF's Trainer evaluates in bf16.
    reference = tiny_t5().eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference.generate(**prompts, max_new_tokens=6, use_cache=True)
    assert torch.equal(tokens, expected)


def test_accumulated_micro_batches_without_a_reduction_and_clipping_train_as_the_reference():
    reference_losses, reference_norms, reference_state = accumulation_reference(STEPS, world_size=1, max_norm=0.05)
    records: list[dict] = []
    step_log = StepLog(every=STEPS, on_flush=records.extend)
    with one_process_group():
        model, parallelism = one_rank_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        # FSDP's no_sync: none here
        settings = StepSettings(parallelism, max_grad_norm=0.05, sync_each_micro_batch=False, spec=SEQ2SEQ)
        for step in range(STEPS):
            micro_batches = _split_rows(make_batch(batch_seed(step, rank=0), rows=4), parts=2)
            step_log.add(step + 1, LR, train_step(model, micro_batches, optimizer, None, 1, settings))
        step_log.flush()
    assert [r["loss"] for r in records] == pytest.approx(reference_losses, rel=1e-6)
    assert [r["grad_norm"] for r in records] == pytest.approx(reference_norms, rel=1e-5)
    state = model.state_dict()
    assert max((state[name] - value).abs().max().item() for name, value in reference_state.items()) < 1e-6


@pytest.mark.slow  # 8 s: dynamo's tracing
def test_compiled_blocks_compile_in_the_first_step_only():
    compiled_at: list[int] = []
    step = [0]
    with one_process_group(), layers_compiled_by("aot_eager", lambda: compiled_at.append(step[0])):
        torch._dynamo.reset()
        graphs_before = compiled_graphs()
        model, parallelism = one_rank_model(compile=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for step[0] in range(STEPS):
            losses += train_wrapped(
                model, parallelism, optimizer, rank=0, world_size=1, steps=step[0] + 1, first=step[0]
            )
        graphs = compiled_graphs() - graphs_before
        torch._dynamo.reset()
    reference_losses, _ = reference_run(STEPS, world_size=1)
    assert losses == pytest.approx(reference_losses, rel=1e-6)
    # The embedded model's 4 kinds of block, forward and backward: all in step 0, none after.
    assert set(Counter(compiled_at)) == {0}, Counter(compiled_at)
    assert graphs == len(compiled_at)  # the epoch record's compiled_graphs: the backend's calls
    print(f"one rank without FSDP compiles by step: {dict(Counter(compiled_at))}")


def test_the_skeleton_a_checkpoint_fills_keeps_its_tied_weights():
    with one_process_group():
        model, _ = sharded(tiny_t5(on_meta=True), _fsdp_config(UNWRAPPED), FP32, restores=True)
    assert model.shared.weight.device == CPU
    assert model.encoder.embed_tokens.weight is model.shared.weight is model.lm_head.weight
    # the control: torch's to_empty alone unties them (an optimizer would then miss 'shared.weight')
    plain = tiny_t5(on_meta=True).to_empty(device=CPU)
    assert plain.encoder.embed_tokens.weight is not plain.shared.weight


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--fsdp_cpu_offload", "--fsdp_cpu_offload true is FSDP's"),
        ("--cpu_ram_efficient_loading", "Pass --cpu_ram_efficient_loading false"),
    ],
)
def test_what_only_fsdp_does_is_refused_without_it(flag, message):
    config = run_config(**{"single_rank_fsdp": False, flag.removeprefix("--"): True})
    with pytest.raises(ConfigError, match=message):
        check_settings(config, world_size=1, device_type="cuda")
    check_settings(config, world_size=2, device_type="cuda")  # on several ranks the flag does nothing


@pytest.mark.parametrize(
    "fsdp_setting",
    [{"compile": True}, {"weight_decay": 0.01}, {"sharding_strategy": "HYBRID_SHARD"}],
    ids=["compile", "weight decay", "hybrid strategy"],
)
def test_fsdp1s_own_rules_do_not_apply_where_fsdp_does_not_wrap(fsdp_setting):
    with pytest.raises(ConfigError, match="FSDP1"):  # the control: FSDP1 at world size 1 refuses each
        check_settings(run_config(**fsdp_setting), world_size=1, device_type="cuda")
    check_settings(run_config(**fsdp_setting, single_rank_fsdp=False), world_size=1, device_type="cuda")


def evaluation_records(output_dir: Path) -> list[tuple]:
    """(validation loss, ROUGE-L) of each epoch and evaluation record of a run."""
    return [
        (r.get("val_loss"), r.get("rougeL")) for r in read_records(output_dir) if r["type"] in ("epoch", "eval")
    ]


RUN = ["--epochs", "1", "--num_train_samples", "24", "--num_val_samples", "8", "--eval_num_samples", "4",
       "--max_new_tokens", "8", "--mixed_precision", "false", "--log_every_n_steps", "1", "--save_every_n_steps",
       "3", "--checkpoint_type", "SHARDED_STATE_DICT"]  # fmt: skip


@pytest.mark.slow  # three whole runs on a pooled rank (8 s); the fast subset keeps the step parity
def test_a_run_without_fsdp_trains_saves_and_resumes_as_fsdp1_does(tmp_path):
    unwrapped, fsdp1, resumed = tmp_path / "unwrapped", tmp_path / "fsdp1", tmp_path / "resumed"
    run = pooled([*RUN, "--output_dir", str(unwrapped), "--single_rank_fsdp", "false"], nproc=1)
    assert run.returncode == 0, run.describe()
    line = "no FSDP: one rank trains the model itself (--single_rank_fsdp false), in fp32\n"
    assert line in run.output, run.describe()
    assert "Warning" not in run.output, run.describe()
    run = pooled([*RUN, "--output_dir", str(fsdp1)], nproc=1)
    assert run.returncode == 0, run.describe()
    assert "FSDP1: 5 units (root + 4 T5Block), NO_SHARD" in run.output, run.describe()

    losses = step_losses(str(unwrapped))
    assert sorted(losses) == list(range(1, 7)) and losses == step_losses(str(fsdp1))
    evaluations = [evaluation_records(output_dir) for output_dir in (unwrapped, fsdp1)]
    assert evaluations[0] == evaluations[1] and len(evaluations[0]) == 2  # the same validation loss and ROUGE
    policies = [json.loads((d / "config.json").read_text())["mixed_precision_policy"] for d in (unwrapped, fsdp1)]
    assert policies == ["fp32", "fp32_policy"]  # the run record names no FSDP policy where FSDP did not wrap
    model_file = Path("hf_model") / "model.safetensors"
    assert (unwrapped / model_file).read_bytes() == (fsdp1 / model_file).read_bytes()

    # Each run's step-3 checkpoint resumed by the other form: steps 4 to 6 as both runs trained them.
    for source, form, log_line in ((unwrapped, "true", "FSDP1: 5 units"), (fsdp1, "false", "no FSDP: ")):
        output_dir = resumed / form
        checkpoint = source / "checkpoints" / "step_00000003"
        args = [*RUN, "--output_dir", str(output_dir), "--single_rank_fsdp", form, "--resume", str(checkpoint)]
        run = pooled(args, nproc=1)
        assert run.returncode == 0, run.describe()
        assert log_line in run.output, run.describe()
        assert step_losses(str(output_dir)) == {step: losses[step] for step in (4, 5, 6)}
