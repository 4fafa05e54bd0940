"""--peft lora: LoRA adapters through PEFT under FSDP1 (use_orig_params) and FSDP2, against the unsharded
PEFT model; the adapter and merged exports; the run through torchrun, killed and resumed."""

import dataclasses
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import T5ForConditionalGeneration, T5Tokenizer

from configs.errors import ConfigError
from configs.fsdp import FSDPConfig
from configs.lora import LoraConfig
from configs.paths import EMBEDDED_MODEL_DIR, REPO_ROOT
from configs.validate import check_lora
from tests.dist_harness import run_ranks
from tests.dist_workers import (
    CPU,
    FP32,
    LORA,
    LORA_BASE,
    LR,
    _fsdp_config,
    layers_compiled_by,
    make_batch,
    reference_run,
    sharded,
    tiny_t5,
    train_wrapped,
)
from tests.hf_folders import assert_folder_is_save_pretrained_of
from tests.launch import pooled
from tests.reference_run import SMALL_RUN, complete_checkpoint_steps
from utils.base.log import warnings_ignored
from utils.checkpoint.hf_export import lora_exports, write_adapter_folder, write_model_folder
from utils.checkpoint.state_dicts import sharded_model_state
from utils.model.lora import PEFT_ASKS_A_DEPRECATED_PROPERTY, adapter_base, apply_lora
from utils.observe.memory import optim_state_numel_local
from utils.spec import SEQ2SEQ

pytest.importorskip("peft")
STEPS = 4


@pytest.fixture(scope="module")
def lora_export_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora_exports")


def lora_t5(blocks: int | None = None) -> nn.Module:
    """tiny_t5 (`blocks`: in each stack) with LoRA on q and v; the adapters' random A drawn from one seed, as
    every rank does."""
    model = tiny_t5(blocks=blocks)
    torch.manual_seed(7)
    return apply_lora(model, LORA, LORA_BASE, SEQ2SEQ)


LORA_VARIANTS = {
    "FSDP1": {},
    "FSDP1 + checkpointing": {"fsdp_activation_checkpointing": True},
    "FSDP1 use_orig_params": {"use_orig_params": True},
    "FSDP1 NO_SHARD": {"sharding_strategy": "NO_SHARD"},
    "FSDP2": {"fsdp_version": 2},
    "FSDP2 + checkpointing": {"fsdp_version": 2, "fsdp_activation_checkpointing": True},
}


# The exports lora_worker writes: {variant: merged too}. NO_SHARD's state dict holds plain tensors.
LORA_EXPORTS = {"FSDP1": True, "FSDP2": True, "FSDP1 use_orig_params": False, "FSDP1 NO_SHARD": True}


def lora_worker(rank: int, world_size: int, steps: int, export_dir: str) -> dict:
    """LoRA under each backend: per-step losses, the full state dict (rank 0), and the AdamW state elements
    this rank holds; for LORA_EXPORTS, the adapter (and merged model) exported from the shards to
    export_dir/<variant>/. Rank 0 also returns the unsharded reference and the initial weights."""
    out = {}
    tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    for name, overrides in LORA_VARIANTS.items():
        model, parallelism = sharded(lora_t5(), _fsdp_config(overrides), FP32)
        # As reference_run: AdamW (its default weight decay) over what trains. parameter_groups keeps the
        # same parameters (the torchrun LoRA runs of tests/test_lora.py use it).
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        losses = train_wrapped(model, parallelism, optimizer, rank, world_size, steps)
        state = parallelism.full_state_dict(model, CPU)
        out[name] = {"losses": losses, "state": state, "optim": optim_state_numel_local(optimizer)}
        if name in LORA_EXPORTS:
            settings = dataclasses.replace(LORA, merge_lora=LORA_EXPORTS[name])
            adapters, merged = lora_exports(sharded_model_state(model), settings, CPU)
            if rank == 0:
                model_config = tiny_t5(on_meta=True).config
                folder = f"{export_dir}/{name}/hf_adapter"
                write_adapter_folder(adapters, model_config, SEQ2SEQ, settings, LORA_BASE, tokenizer, folder)
            if merged is not None:
                model_config = tiny_t5(on_meta=True).config
                write_model_folder(
                    merged, model_config, SEQ2SEQ, tokenizer, f"{export_dir}/{name}/hf_model", 10**9, rank == 0
                )
    if rank == 0:
        out["reference"] = reference_run(steps, world_size, lora_t5())
        out["initial"] = {k: v.clone() for k, v in lora_t5().state_dict().items()}
    return out


@pytest.fixture(scope="module")
def lora_runs(lora_export_dir):
    return run_ranks(lora_worker, STEPS, str(lora_export_dir))


def test_lora_under_fsdp_matches_the_unsharded_peft_model(lora_runs):
    rank0, rank1 = lora_runs
    reference_losses, reference_state = rank0["reference"]
    for name in LORA_VARIANTS:
        assert rank0[name]["losses"] == rank1[name]["losses"], name
        assert rank0[name]["losses"] == pytest.approx(reference_losses, rel=1e-5), name
        state = rank0[name]["state"]
        assert sorted(state) == sorted(reference_state), name
        for key, value in reference_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


def test_only_the_adapters_train_and_only_they_hold_optimizer_state(lora_runs):
    rank0, rank1 = lora_runs
    initial = rank0["initial"]
    adapter_numel = sum(v.numel() for k, v in initial.items() if "lora_" in k)
    for name in LORA_VARIANTS:
        state = rank0[name]["state"]
        changed = {key for key, value in initial.items() if not torch.equal(state[key], value)}
        assert changed and all("lora_B" in key or "lora_A" in key for key in changed), (name, changed)
        assert any("lora_B" in key for key in changed)  # B starts at zero: the update has happened
        # AdamW's two moments of the adapters, over the ranks together, and nothing for the frozen model.
        copies = 2 if "NO_SHARD" in name else 1  # NO_SHARD: both ranks hold all of it
        assert rank0[name]["optim"] + rank1[name]["optim"] == 2 * adapter_numel * copies, name


def test_shard_written_adapter_and_merged_model_are_what_peft_writes_from_the_gathered_model(
    lora_runs, lora_export_dir, tmp_path
):
    """For FSDP1, FSDP1 NO_SHARD (plain tensors) and FSDP2, and the adapter alone without --merge_lora
    (FSDP1 use_orig_params): the adapter folder and the merged hf_model/ written from the shards hold, tensor
    for tensor, what PEFT writes from the gathered trained model (save_pretrained; merge_and_unload then
    save_pretrained). The adapter loads with PeftModel.from_pretrained onto the base its config names, the
    merged folder with plain from_pretrained, and both give the trained model's logits."""
    from peft import PeftModel

    rank0 = lora_runs[0]
    batch = make_batch(0, rows=2)
    inputs = {"input_ids": batch["source_ids"], "attention_mask": batch["source_mask"],
              "decoder_input_ids": batch["target_ids"]}  # fmt: skip
    for name, merged in LORA_EXPORTS.items():
        exported, scratch = lora_export_dir / name, tmp_path / name
        reference = lora_t5()
        reference.load_state_dict(rank0[name]["state"], strict=True)
        reference.eval()
        with torch.no_grad():
            expected_logits = reference(**inputs).logits

        reference.save_pretrained(scratch / "adapter")
        expected = load_file(scratch / "adapter" / "adapter_model.safetensors")
        written = load_file(exported / "hf_adapter" / "adapter_model.safetensors")
        assert written.keys() == expected.keys() and expected, name
        assert all(torch.equal(written[key], expected[key]) for key in expected), name
        adapter_config = json.loads((exported / "hf_adapter" / "adapter_config.json").read_text())
        expected_config = json.loads((scratch / "adapter" / "adapter_config.json").read_text())
        for config in (adapter_config, expected_config):  # a set in PEFT: its order varies
            config["target_modules"] = sorted(config["target_modules"])
        assert adapter_config == expected_config
        assert adapter_config["base_model_name_or_path"] == str(EMBEDDED_MODEL_DIR)
        # The workers' base is tiny_t5(): the embedded model's shape with its own seeded weights.
        with warnings_ignored(PEFT_ASKS_A_DEPRECATED_PROPERTY):  # as the package's own get_peft_model call
            adapter = PeftModel.from_pretrained(tiny_t5(), exported / "hf_adapter").eval()
        with torch.no_grad():
            torch.testing.assert_close(adapter(**inputs).logits, expected_logits)

        if not merged:
            assert not (exported / "hf_model").exists(), name
            continue
        assert_folder_is_save_pretrained_of(
            exported / "hf_model", reference.merge_and_unload().state_dict(), scratch / "merged"
        )
        plain = T5ForConditionalGeneration.from_pretrained(exported / "hf_model").eval()
        with torch.no_grad():
            torch.testing.assert_close(plain(**inputs).logits, expected_logits, rtol=1e-4, atol=1e-5)


def test_the_adapter_names_its_base_as_from_pretrained_finds_it():
    """adapter_config.json's base: a local folder by its absolute path (found from any working directory), a
    hub name as it is."""
    assert adapter_base(os.path.relpath(EMBEDDED_MODEL_DIR)) == str(EMBEDDED_MODEL_DIR)
    assert adapter_base("t5-small") == "t5-small"


@pytest.mark.parametrize(
    "lora, message",
    [
        ({"peft": "lora", "lora_target_modules": " , "}, "--lora_target_modules is empty"),
        ({"merge_lora": True}, "--merge_lora sets up LoRA adapters: it needs --peft lora"),
        ({"lora_r": 16}, "--lora_r sets up LoRA adapters"),
        ({"peft": "lora", "lora_dropout": 1.0}, "--lora_dropout 1 drops every input"),
    ],
)
def test_lora_settings_that_cannot_run_are_refused(lora, message):
    with pytest.raises(ConfigError, match=message):
        check_lora(LoraConfig(**lora))


@pytest.mark.parametrize(
    "fsdp",
    [
        {"cpu_ram_efficient_loading": True},
        {"cpu_ram_efficient_loading": True, "fsdp_version": 2},
        {"compile": True, "use_orig_params": True},
        {"compile": True, "fsdp_version": 2},
    ],
)
def test_lora_runs_with_rank0_only_loading_and_compiled(fsdp):
    """Refused until rank-0-only loading built the adapters as a loaded model's, and the compiled LoRA step was
    shown to train as the eager one (the tests below)."""
    from configs.run import RunConfig
    from configs.validate import check_settings

    check_settings(RunConfig(lora=LoraConfig(peft="lora"), fsdp=FSDPConfig(**fsdp)), 2, "cpu")


LORA_RUN = ("--peft", "lora", "--lr", "0.01", "--epochs", "1", "--eval_rouge", "false")  # one short epoch


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory):
    """The uninterrupted LoRA run of a backend (the checkpoint format does not change its losses): FSDP1's and
    FSDP2's differ by rounding (their gradient reductions divide at different points), which twelve steps at
    this learning rate grow to 2.6e-5 relative on a CPU with AVX-512, so each stop resumes to its own."""
    references = {}

    def reference(fsdp_version: str) -> Path:
        if fsdp_version not in references:
            output_dir = tmp_path_factory.mktemp(f"lora_reference_fsdp{fsdp_version}") / "out"
            run = pooled([*SMALL_RUN, *LORA_RUN, "--fsdp_version", fsdp_version, "--output_dir", str(output_dir)])
            assert run.returncode == 0, run.describe()
            references[fsdp_version] = output_dir
        return references[fsdp_version]

    return reference


STOPPED_AT = 7  # --max_steps: the stop's checkpoint, which the resume continues


@pytest.mark.slow
@pytest.mark.parametrize(
    "fsdp_version, checkpoint_type, stop",
    [("1", "SHARDED_STATE_DICT", "max_steps"), ("2", "FULL_STATE_DICT", "kill")],
)
def test_a_stopped_lora_run_resumes_to_the_uninterrupted_runs_losses(
    tmp_path_factory, lora_reference, fsdp_version, checkpoint_type, stop
):
    """Resumed without repeating --peft lora (the run's record keeps it): the adapters and their AdamW state
    come back into an empty PEFT skeleton (FSDP1 materialising each unit, adapters wrapped apart; FSDP2
    allocating its shards), from DCP's shards or from the memory-mapped model.pt and optimizer.pt in PEFT's
    names. Every step after the resume has the loss of the same backend's uninterrupted run; the run ends with
    the adapter export only. FSDP2: SIGKILLed through torchrun after its first checkpoint and resumed in new
    processes; FSDP1: stopped by --max_steps and resumed, pooled."""
    from tests.test_resume import assert_losses_match, kill_and_resume, resumed_from

    args = (*LORA_RUN, "--fsdp_version", fsdp_version)
    if stop == "kill":
        result = kill_and_resume(tmp_path_factory, checkpoint_type, args, fresh_resume=True)
        output_dir, resumed, saved = result.output_dir, result.resumed, result.checkpoints_at_kill
    else:
        output_dir = tmp_path_factory.mktemp("stopped_lora") / "out"
        stopped = pooled([*SMALL_RUN, *args, "--checkpoint_type", checkpoint_type, "--output_dir", str(output_dir),
                          "--max_steps", str(STOPPED_AT)])  # fmt: skip
        assert stopped.returncode == 0, stopped.describe()
        saved = complete_checkpoint_steps(output_dir)
        resumed = pooled(["--output_dir", str(output_dir), "--resume", "true", "--max_steps", "0"])
    assert resumed.returncode == 0, resumed.describe()
    assert saved and resumed_from(resumed)[2] == saved[-1], (saved, resumed.describe())
    # FSDP1's adapter units (q and v of 2 encoder and 2 decoder blocks, the decoder's cross-attention too:
    # 12 layers, an A and a B each) are named with the way out; FSDP2 has none
    adapter_units = "FSDP1: 24 of the units are LoRA adapters"
    assert (adapter_units in resumed.output) == (fsdp_version == "1"), resumed.describe()
    assert_losses_match(output_dir, lora_reference(fsdp_version))
    assert (output_dir / "hf_adapter" / "adapter_model.safetensors").is_file()
    assert not (output_dir / "hf_model").exists()


def test_target_names_that_adapt_nothing_are_refused():
    """PEFT would adapt what matches and say nothing about the rest; a gated T5 has wi_0/wi_1, not wi."""
    from transformers import T5Config

    with pytest.raises(ConfigError, match="--lora_target_modules zz: no such layer.*q,"):
        apply_lora(
            T5ForConditionalGeneration.from_pretrained(EMBEDDED_MODEL_DIR),
            replace(LORA, lora_target_modules="q,zz"),
            LORA_BASE,
            SEQ2SEQ,
        )
    gated = T5Config(vocab_size=1100, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=1,
                     feed_forward_proj="gated-gelu", decoder_start_token_id=0)  # fmt: skip
    with pytest.raises(ConfigError, match="--lora_target_modules wi: .*wi_0,wi_1"):
        apply_lora(T5ForConditionalGeneration(gated), replace(LORA, lora_target_modules="wi"), LORA_BASE, SEQ2SEQ)


def test_a_full_state_file_says_whether_it_holds_adapters(tmp_path):
    """A LoRA run's .pt (PEFT names) is loaded after the adapters exist; a plain one into the plain model."""
    from utils.model.lora import holds_adapters

    torch.manual_seed(7)
    peft_model = apply_lora(
        T5ForConditionalGeneration.from_pretrained(EMBEDDED_MODEL_DIR), LORA, LORA_BASE, SEQ2SEQ
    )
    torch.save(peft_model.state_dict(), tmp_path / "lora.pt")
    torch.save(T5ForConditionalGeneration.from_pretrained(EMBEDDED_MODEL_DIR).state_dict(), tmp_path / "plain.pt")
    assert holds_adapters(str(tmp_path / "lora.pt"))
    assert not holds_adapters(str(tmp_path / "plain.pt"))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    from scripts.make_tiny_family import make

    folder = tmp_path_factory.mktemp("lora_llama") / "llama"
    make("llama", str(folder))
    return str(folder)


@pytest.mark.parametrize("family", ["t5", "llama"])
def test_adapters_on_a_skeleton_get_the_loaded_models_values_and_random_draws(family, tiny_llama):
    """Rank-0-only loading builds the base on the meta device: PEFT would move the adapters it initialised
    there, and their values would be lost. Built on the skeleton, they equal those of the loaded model (the
    same draws: the random stream after them is the same too), the base stays on meta and frozen. The control:
    left on meta (adapters_on_meta, for a LoRA run's .pt to fill), they hold nothing."""
    from utils.model.loading import load_model
    from utils.spec import CAUSAL

    folder, spec = (str(EMBEDDED_MODEL_DIR), SEQ2SEQ) if family == "t5" else (tiny_llama, CAUSAL)
    lora = LoraConfig(peft="lora")  # r=8, PEFT's own init (kaiming A, zero B)
    built = {}
    for case, on_meta, adapters_on_meta in (("loaded", False, False), ("skeleton", True, False),
                                            ("control", True, True)):  # fmt: skip
        torch.manual_seed(11)
        base = load_model(folder, on_meta=on_meta)
        model = apply_lora(base, lora, folder, spec, adapters_on_meta=adapters_on_meta)
        built[case] = (dict(model.named_parameters()), torch.get_rng_state())
    loaded, loaded_rng = built["loaded"]
    skeleton, skeleton_rng = built["skeleton"]
    adapters = [name for name in loaded if "lora_" in name]
    assert adapters and sorted(skeleton) == sorted(loaded)
    for name, param in skeleton.items():
        assert param.requires_grad == loaded[name].requires_grad, name
        if name in adapters:
            assert not param.is_meta and torch.equal(param, loaded[name]), name
        else:
            assert param.is_meta, name
    assert torch.equal(skeleton_rng, loaded_rng)
    control = built["control"][0]
    assert all(control[name].is_meta for name in adapters)


def mid_llama(folder: Path) -> int:
    """A Llama of 39M parameters (156 MB in fp32) with the tiny Llama's tokenizer: large enough that its copy
    shows in a rank's resident memory above the noise of a process's own (about 15 MB). Its parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from scripts.make_tiny_family import make

    make("llama", str(folder))
    config = LlamaConfig.from_pretrained(folder)
    config.update({"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 16,
                   "num_attention_heads": 8, "num_key_value_heads": 8})  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


# Short LoRA runs in fp32, with nothing but training and the adapter's export.
RANK0_RUN = ("--peft", "lora", "--mixed_precision", "false", "--num_train_samples", "16",
             "--run_validation", "false", "--log_every_n_steps", "1", "--keep_last_n", "0")  # fmt: skip
# The Llama's steps: its second step's loss reads the adapters' A (B's first update is A's image), enough to
# show that they start alike; each of its steps takes seconds here.
T5_STEPS, LLAMA_STEPS = 3, 2


def lora_run(output_dir: Path, *args: str, steps: int = T5_STEPS, fresh_workers: bool = False) -> dict:
    """A RANK0_RUN of `steps` steps (pooled): its per-step losses, and each rank's loading high-water mark over
    the fp32 model (the memory account's load_rss_delta_bytes, as scripts/benchmark.py's loading suite divides
    it; meaningful on fresh_workers only, whose memory is a new rank's after its imports: a reused worker's heap
    may hold an earlier scenario's freed tensors, which loading then reuses without raising the resident
    memory)."""
    from tests.reference_run import read_records

    run = pooled([*RANK0_RUN, "--max_steps", str(steps), "--output_dir", str(output_dir), *args],
                 fresh_workers=fresh_workers)  # fmt: skip
    assert run.returncode == 0, run.describe()
    records = read_records(output_dir)
    memory = sorted((r for r in records if r["type"] == "memory"), key=lambda r: r["rank"])
    return {
        "losses": [r["loss"] for r in records if r["type"] == "step"],
        "load_share": [r["load_rss_delta_bytes"] / (4 * r["param_numel_total"]) for r in memory],
        "output": run.output,
    }


@pytest.mark.slow
def test_lora_with_rank0_only_loading_trains_as_loading_on_every_rank_and_spares_rank1_the_model(tmp_path):
    """--peft lora --cpu_ram_efficient_loading true, FSDP1 and FSDP2, the tiny T5 and a 39M-parameter Llama (a
    text-format run on the chat sample, on fresh pooled workers, whose memory says what loading holds as a new
    rank's would): the fp32 losses are bit-identical to the same run with rank-0-only loading off (the
    adapters start alike: built on the skeleton as on the loaded model). Rank 1 never holds the Llama while
    loading: its high-water mark stays under one fp32 copy (measured 0.66x with FSDP1: its shard and the unit
    being flattened; 0.61x with FSDP2: its shard, filled by rank 0's broadcast), where with loading on every
    rank it holds more than one (the control: 1.98x, 1.33x; the same figures through torchrun). And FSDP1 reads
    a LoRA run's .pt (adapters included) by name on rank 0 alone: the same losses as every rank loading it,
    other than a fresh LoRA run's."""
    from utils.model.loading import load_model

    llama = tmp_path / "llama"
    mid_llama(llama)
    llama_data = ("--model_name", str(llama), "--dataset_name", str(REPO_ROOT / "data" / "code_chat"),
                  "--dataset_text_field", "content", "--max_seq_len", "64", "--batch_size_training", "2",
                  "--cache_dir", str(tmp_path / "cache"))  # fmt: skip
    families = {"t5": ((), T5_STEPS, False), "llama": (llama_data, LLAMA_STEPS, True)}
    runs = {}
    for family, (data, steps, fresh_workers) in families.items():
        for version in ("1", "2"):
            for rank0 in ("true", "false"):
                runs[family, version, rank0] = lora_run(
                    tmp_path / f"{family}-{version}-{rank0}", *data, "--fsdp_version", version,
                    "--cpu_ram_efficient_loading", rank0, steps=steps, fresh_workers=fresh_workers,
                )  # fmt: skip
    for (family, version, rank0), run in runs.items():  # the T5's memory is not measured (lora_run)
        shares = f", loading high-water mark / fp32 model per rank {[round(s, 2) for s in run['load_share']]}"
        print(f"{family} FSDP{version} rank-0-only loading {rank0}: losses {run['losses']}"
              f"{shares if family == 'llama' else ''}")  # fmt: skip
    for family, (_, steps, _) in families.items():
        for version in ("1", "2"):
            on, off = runs[family, version, "true"], runs[family, version, "false"]
            assert len(on["losses"]) == steps and on["losses"] == off["losses"], (family, version)
    for version in ("1", "2"):
        on, off = runs["llama", version, "true"]["load_share"][1], runs["llama", version, "false"]["load_share"][1]
        assert on < 0.8 < 1.0 < off, (version, on, off)

    # A LoRA run's .pt with adapters that are not PEFT's initial ones (B non-zero): read, not initialised.
    torch.manual_seed(5)
    peft_model = apply_lora(load_model(str(EMBEDDED_MODEL_DIR)), LoraConfig(peft="lora"), LORA_BASE, SEQ2SEQ)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.05)
    weights = tmp_path / "lora.pt"
    torch.save(peft_model.state_dict(), weights)
    from_pt = {}
    for rank0 in ("true", "false"):
        from_pt[rank0] = lora_run(tmp_path / f"pt-{rank0}", "--resume", str(weights), "--fsdp_version", "1",
                                  "--cpu_ram_efficient_loading", rank0)  # fmt: skip
    print(f"T5 FSDP1 from a LoRA .pt: {from_pt['true']['losses']} (rank-0-only), {from_pt['false']['losses']}")
    assert from_pt["true"]["losses"] == from_pt["false"]["losses"]
    assert from_pt["true"]["losses"] != runs["t5", "1", "true"]["losses"]  # the adapters came from the file


# The compiled LoRA step against the eager one, fp32 on CPU, 4 steps, the tiny T5 with its 2 blocks a stack (max
# relative difference of the losses): inductor 2.0e-8 (FSDP2), 1.3e-8 (FSDP1 use_orig_params); aot_eager 0
# (FSDP2), 1.6e-8 (FSDP1); with the test's 1 block a stack, aot_eager 0 (FSDP2), 2.0e-8 (FSDP1). Float32's
# rounding is 6e-8: compiled, the step is the same computation, its sums in other orders. The adapters agree
# to 3.3e-8 absolute (aot_eager, FSDP1; 7.5e-9 with 1 block a stack): AdamW divides each update by its
# gradient's running RMS, which turns a rounding of a near-zero gradient into a relative difference of up to
# 5e-6 in a small weight.
COMPILED_LORA_RTOL = 1e-6
COMPILED_ADAPTERS_ATOL = 1e-6


# The compiled LoRA step's model: one T5Block in each stack, which holds every kind of adapted layer (q and v of
# the encoder's and the decoder's self-attention and of the cross-attention). A second block in each adapts no
# other kind of layer, and adds graphs to compile (FSDP1: 27 instead of 16; FSDP2: 4 instead of 2), which is
# nearly all of the test's time: 68 s instead of 45. Blocks without a position bias of their own are compiled,
# without adapters, in tests/test_fsdp2.py.
COMPILED_LORA_BLOCKS = 1


def lora_compile_worker(rank: int, world_size: int, steps: int, backend: str) -> dict:
    """LoRA's fp32 per-step losses and final adapters, each T5Block compiled (torch.compile `backend`, through
    utils/fsdp/shard.py's compile_layers) and not, for FSDP1 (original parameters) and FSDP2; the graphs
    compiled."""
    import torch._dynamo

    out: dict = {}
    graphs: list = []
    with layers_compiled_by(backend, lambda: graphs.append(1)):
        for name, overrides in (
            ("FSDP1 use_orig_params", {"use_orig_params": True}),
            ("FSDP2", {"fsdp_version": 2}),
        ):
            for compiled in (False, True):
                torch._dynamo.reset()
                graphs.clear()
                model = lora_t5(COMPILED_LORA_BLOCKS)
                model, parallelism = sharded(model, _fsdp_config({**overrides, "compile": compiled}), FP32)
                optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
                losses = train_wrapped(model, parallelism, optimizer, rank, world_size, steps)
                state = parallelism.full_state_dict(model, CPU)
                adapters = {key: value for key, value in state.items() if "lora_" in key}
                out[name, compiled] = {"losses": losses, "adapters": adapters, "graphs": len(graphs)}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compiled_lora_trains_as_the_eager_lora_step(backend):
    """--peft lora --compile true: each T5Block compiled with its adapters (FSDP2; FSDP1 with original
    parameters, whose adapter units break the block's graph: 16 graphs) trains to the eager LoRA step's fp32
    losses within COMPILED_LORA_RTOL and adapters within COMPILED_ADAPTERS_ATOL. CI compiles
    with aot_eager (the tracing, FSDP's hooks and the backward graph inductor sees); inductor's own figures are
    in COMPILED_LORA_RTOL's note (the same worker, backend "inductor": 7 minutes here)."""
    rank0 = run_ranks(lora_compile_worker, STEPS, backend, timeout_s=600)[0]
    for name in ("FSDP1 use_orig_params", "FSDP2"):
        eager, compiled = rank0[name, False], rank0[name, True]
        assert eager["graphs"] == 0 < compiled["graphs"], name  # the control trains eagerly, the other compiled
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=COMPILED_LORA_RTOL, abs=0), name
        for key, value in eager["adapters"].items():
            torch.testing.assert_close(compiled["adapters"][key], value, rtol=0, atol=COMPILED_ADAPTERS_ATOL)
        pairs = zip(compiled["losses"], eager["losses"], strict=True)
        adapters = max(
            (compiled["adapters"][key] - value).abs().max().item() for key, value in eager["adapters"].items()
        )
        print(backend, name, compiled["graphs"], "graphs; max relative loss difference",
              max(abs(c - e) / abs(e) for c, e in pairs), "max adapter difference", adapters)  # fmt: skip


# The Llama 2 guide's LoRA flags, as it types them (configs/hf_names.py: --use_peft_lora True -> --peft lora).
GUIDE_LORA = ("--use_peft_lora", "True", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.1",
              "--lora_target_modules", "q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj")  # fmt: skip


@pytest.mark.slow
def test_the_guides_command_with_lora_under_its_yaml_trains_and_its_adapter_loads_with_peft(tiny_llama, tmp_path):
    """The Llama 2 guide's command with its LoRA flags, through accelerate launch with its YAML, whose
    fsdp_cpu_ram_efficient_loading: true made --peft lora a refusal: the run trains with rank-0-only loading,
    and hf_adapter/ loads with PeftModel.from_pretrained onto the base it names, its B matrices trained."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.test_accelerate_env import accelerate_launch_run
    from tests.test_causal import LLAMA2_CONFIG, seed_004_flags

    output_dir = tmp_path / "run"
    # 2 of the command's 12 steps: the first update trains every B, and the run's length is not what is tested
    flags = [*seed_004_flags(tiny_llama, str(output_dir), max_steps=2), *GUIDE_LORA]
    run = accelerate_launch_run(flags, config=LLAMA2_CONFIG, timeout=300)
    assert run.returncode == 0, run.describe()
    record = json.loads((output_dir / "config.json").read_text(encoding="utf-8"))
    assert record["fsdp_config"]["cpu_ram_efficient_loading"] and record["lora_config"]["peft"] == "lora"
    assert "--use_peft_lora True -> --peft lora" in run.output
    assert "LoRA r=8 alpha=16 on q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj" in run.output
    with warnings_ignored(PEFT_ASKS_A_DEPRECATED_PROPERTY):
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_llama), output_dir / "hf_adapter"
        )
    trained = {name: param for name, param in model.named_parameters() if "lora_B" in name}
    assert len(trained) == 2 * 7 and all(param.abs().sum() > 0 for param in trained.values())
