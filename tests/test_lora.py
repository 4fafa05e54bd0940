"""--peft lora: LoRA adapters through PEFT under FSDP1 (use_orig_params) and FSDP2, against the unsharded
PEFT model; the adapter and merged exports; the run through torchrun, killed and resumed."""

import json
from dataclasses import replace

import pytest
import torch
from transformers import T5ForConditionalGeneration, T5Tokenizer

from configs.errors import ConfigError
from configs.fsdp import FSDPConfig
from configs.lora import LoraConfig
from configs.paths import EMBEDDED_MODEL_DIR
from configs.validate import check_lora
from tests.dist_harness import run_ranks
from tests.dist_workers import LORA, LORA_BASE, LORA_VARIANTS, lora_worker, make_batch
from tests.launch import torchrun
from utils.checkpoint.hf_export import write_lora_folders
from utils.model.lora import adapter_base, apply_lora

pytest.importorskip("peft")
STEPS = 4


@pytest.fixture(scope="module")
def lora_runs():
    return run_ranks(lora_worker, STEPS)


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
        assert rank0[name]["optim"] + rank1[name]["optim"] == 2 * adapter_numel, name


def test_adapter_and_merged_exports_load_and_agree(tmp_path):
    """The adapter loads with PeftModel.from_pretrained onto the base; the merged folder loads with plain
    from_pretrained; both give the trained PEFT model's logits."""
    from peft import PeftModel

    settings = replace(LORA, merge_lora=True)
    base_model = adapter_base(str(EMBEDDED_MODEL_DIR))
    assert base_model == str(EMBEDDED_MODEL_DIR)  # a local folder, named by its absolute path
    torch.manual_seed(7)
    trained = apply_lora(T5ForConditionalGeneration.from_pretrained(EMBEDDED_MODEL_DIR), settings, base_model)
    with torch.no_grad():  # stand-in for training: non-zero adapters
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    folders = (str(tmp_path / "hf_adapter"), str(tmp_path / "hf_model"))
    write_lora_folders(
        trained.state_dict(), trained.get_base_model().config, tokenizer, settings, base_model, folders
    )

    batch = make_batch(0, rows=2)
    inputs = {"input_ids": batch["source_ids"], "attention_mask": batch["source_mask"],
              "decoder_input_ids": batch["target_ids"]}  # fmt: skip
    expected = trained.eval()(**inputs).logits
    adapter_config = json.loads((tmp_path / "hf_adapter" / "adapter_config.json").read_text())
    assert adapter_config["r"] == LORA.lora_r
    assert adapter_config["base_model_name_or_path"] == str(EMBEDDED_MODEL_DIR)
    base = T5ForConditionalGeneration.from_pretrained(adapter_config["base_model_name_or_path"])
    adapter = PeftModel.from_pretrained(base, folders[0]).eval()
    torch.testing.assert_close(adapter(**inputs).logits, expected)
    merged = T5ForConditionalGeneration.from_pretrained(folders[1]).eval()
    torch.testing.assert_close(merged(**inputs).logits, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "lora, fsdp, message",
    [
        ({"peft": "lora"}, {"fsdp_version": 2, "cpu_ram_efficient_loading": True}, "--cpu_ram_efficient_loading"),
        ({"peft": "lora", "lora_target_modules": " , "}, {"fsdp_version": 2}, "--lora_target_modules is empty"),
        ({"merge_lora": True}, {}, "--merge_lora sets up LoRA adapters: it needs --peft lora"),
        ({"lora_r": 16}, {}, "--lora_r sets up LoRA adapters"),
        ({"peft": "lora", "lora_dropout": 1.0}, {"fsdp_version": 2}, "--lora_dropout 1 drops every input"),
        ({"peft": "lora"}, {"fsdp_version": 2, "compile": True}, "--compile true is not supported"),
    ],
)
def test_lora_settings_that_cannot_run_are_refused(lora, fsdp, message):
    with pytest.raises(ConfigError, match=message):
        check_lora(LoraConfig(**lora), FSDPConfig(**fsdp))


LORA_RUN = ("--peft", "lora", "--lr", "0.01", "--epochs", "1", "--eval_rouge", "false")  # one short epoch


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory):
    """One uninterrupted LoRA run (the checkpoint format does not change its losses)."""
    from tests.reference_run import SMALL_RUN

    reference = tmp_path_factory.mktemp("lora_reference") / "out"
    run = torchrun([*SMALL_RUN, *LORA_RUN, "--output_dir", str(reference)])
    assert run.returncode == 0, run.describe()
    return reference


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_kill_and_resume_with_lora_equals_the_uninterrupted_run(tmp_path_factory, lora_reference, checkpoint_type):
    """Through torchrun (FSDP1, adapters wrapped apart): the adapters and their AdamW state come back from
    the checkpoint (a FULL one's model.pt, in PEFT's names, is loaded after the adapters exist), so every
    step after the resume has the uninterrupted run's loss; the run ends with the adapter export only."""
    from tests.test_resume import assert_losses_match, kill_and_resume, resumed_from

    reference = lora_reference
    result = kill_and_resume(tmp_path_factory, checkpoint_type, LORA_RUN)
    assert result.resumed.returncode == 0, result.resumed.describe()
    assert result.checkpoints_at_kill and resumed_from(result.resumed)[2] == result.checkpoints_at_kill[-1]
    assert_losses_match(result.output_dir, reference)
    assert (result.output_dir / "hf_adapter" / "adapter_model.safetensors").is_file()
    assert not (result.output_dir / "hf_model").exists()


def test_target_names_that_adapt_nothing_are_refused():
    """PEFT would adapt what matches and say nothing about the rest; a gated T5 has wi_0/wi_1, not wi."""
    from transformers import T5Config

    with pytest.raises(ConfigError, match="--lora_target_modules zz: no such layer.*q,"):
        apply_lora(
            T5ForConditionalGeneration.from_pretrained(EMBEDDED_MODEL_DIR),
            replace(LORA, lora_target_modules="q,zz"),
            LORA_BASE,
        )
    gated = T5Config(vocab_size=1100, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=1,
                     feed_forward_proj="gated-gelu", decoder_start_token_id=0)  # fmt: skip
    with pytest.raises(ConfigError, match="--lora_target_modules wi: .*wi_0,wi_1"):
        apply_lora(T5ForConditionalGeneration(gated), replace(LORA, lora_target_modules="wi"), LORA_BASE)


def test_a_full_state_file_says_whether_it_holds_adapters(tmp_path):
    """A LoRA run's .pt (PEFT names) is loaded after the adapters exist; a plain one into the plain model."""
    from utils.model.lora import holds_adapters

    torch.manual_seed(7)
    peft_model = apply_lora(T5ForConditionalGeneration.from_pretrained(EMBEDDED_MODEL_DIR), LORA, LORA_BASE)
    torch.save(peft_model.state_dict(), tmp_path / "lora.pt")
    torch.save(T5ForConditionalGeneration.from_pretrained(EMBEDDED_MODEL_DIR).state_dict(), tmp_path / "plain.pt")
    assert holds_adapters(str(tmp_path / "lora.pt"))
    assert not holds_adapters(str(tmp_path / "plain.pt"))
