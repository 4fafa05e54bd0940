"""The encoder-decoder families (docs/models.md): what the loader takes and refuses, the FSDP unit classes read
from each model, the skeleton a restore fills, and LoRA's default targets. Tiny random models of each family,
built offline by scripts/make_tiny_family.py, once per session."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from configs.errors import ConfigError
from configs.lora import LoraConfig
from configs.paths import EMBEDDED_MODEL_DIR
from policies.wrapping import layer_classes
from scripts.make_tiny_family import FAMILIES, make
from tests.dist_harness import run_ranks
from tests.dist_workers import family_worker
from tests.hf_folders import parameter_ties
from utils.checkpoint.hf_export import convert_checkpoint
from utils.checkpoint.state_dicts import set_optimizer_state
from utils.model.loading import load_model, load_model_for_run, load_tokenizer
from utils.model.lora import target_modules
from utils.train.optim import parameter_groups

LAYERS = {
    "t5": {"T5Block"},
    "t5-v1_1": {"T5Block"},
    "mt5": {"MT5Block"},
    "umt5": {"UMT5Block"},
    "bart": {"BartEncoderLayer", "BartDecoderLayer"},
    "pegasus": {"PegasusEncoderLayer", "PegasusDecoderLayer"},  # transformers declares no _no_split_modules
}
LORA_DEFAULTS = {"t5": ["q", "v"], "t5-v1_1": ["q", "v"], "mt5": ["q", "v"], "umt5": ["q", "v"],
                 "bart": ["q_proj", "v_proj"], "pegasus": ["q_proj", "v_proj"]}  # fmt: skip


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    dirs = {"t5": str(EMBEDDED_MODEL_DIR)}
    for family in FAMILIES:
        make(family, str(root / family))
        dirs[family] = str(root / family)
    return dirs


@pytest.mark.parametrize("family", sorted(LAYERS))
def test_each_family_loads_in_its_own_class_with_its_units_tokenizer_and_lora_targets(family_dirs, family):
    folder = family_dirs[family]
    model = load_model(folder, dropout_rate=0.0)
    assert model.config.model_type == family.removesuffix("-v1_1")
    assert {cls.__name__ for cls in layer_classes(model)} == LAYERS[family]
    layers = [m for m in model.modules() if type(m) in layer_classes(model)]
    assert len(layers) == 4  # two encoder and two decoder layers: every stack layer is a unit
    names = ["dropout_rate"] if hasattr(model.config, "dropout_rate") else ["dropout", "attention_dropout",
                                                                            "activation_dropout"]  # fmt: skip
    assert {getattr(model.config, name) for name in names} == {0.0}  # --dropout_rate reaches BART's three
    tokenizer = load_tokenizer(folder)
    assert len(tokenizer) <= model.config.vocab_size
    assert target_modules(LoraConfig(peft="lora"), model) == LORA_DEFAULTS[family]


@pytest.mark.parametrize("family", sorted(LAYERS))
def test_a_skeleton_has_the_loaded_models_parameters_and_ties(family_dirs, family):
    """The meta skeleton a checkpoint restore (or rank-0 loading) fills: mT5 and UMT5 hold an lm_head of their
    own, which transformers 5 would build tied to the embedding."""
    loaded = load_model(family_dirs[family])
    skeleton = load_model(family_dirs[family], on_meta=True)

    assert parameter_ties(skeleton) == parameter_ties(loaded)
    assert {n: p.shape for n, p in skeleton.state_dict().items()} == {
        n: p.shape for n, p in loaded.state_dict().items()
    }
    assert all(p.is_meta for p in skeleton.parameters())
    # The same weights train (PEGASUS's position table is frozen when built from a config, not when loaded):
    # else FSDP1 would wrap the skeleton in other units than the run it restores.
    trains = {name: p.requires_grad for name, p in loaded.named_parameters()}
    assert {name: p.requires_grad for name, p in skeleton.named_parameters()} == trains


def test_a_folder_whose_architecture_is_another_familys_is_refused(family_dirs, tmp_path):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((Path(family_dirs["bart"]) / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["T5ForConditionalGeneration"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="names the architecture T5ForConditionalGeneration .a t5 model. but its "
                                          "model_type is bart"):  # fmt: skip
        load_model(str(tmp_path))


def test_missing_weights_stop_the_run_naming_them_and_unused_ones_are_named_in_a_warning(
    family_dirs, tmp_path, caplog
):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((Path(family_dirs["bart"]) / name).read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    removed = "model.encoder.layers.1.fc2.weight"
    save_file({**{k: v for k, v in weights.items() if k != removed}, "extra.weight": torch.zeros(2)},
              tmp_path / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(
        ConfigError, match=f"lacks weights of its BartForConditionalGeneration: {removed} are missing"
    ):
        load_model(str(tmp_path))
    save_file(
        {**weights, "extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors", metadata={"format": "pt"}
    )
    with caplog.at_level("WARNING"):
        load_model(str(tmp_path))
    assert "extra.weight" in caplog.text and "does not use" in caplog.text


def with_config(folder: Path, **changes) -> Path:
    """`folder` with `changes` made to its config.json."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


# The message for the embedded tiny T5 with d_ff 128 in its config.json (its weights hold 256), up to the file
MISMATCH = (r"the weights of model '{folder}' do not fit its config.json: encoder.block.0.layer.1.DenseReluDense"
            r".wi.weight is \[256, 64\] in {file}, and \[128, 64\] in the T5ForConditionalGeneration that "
            r"config.json describes. Put back the config.json saved with these weights")  # fmt: skip


def test_weights_that_do_not_fit_their_config_are_one_message_naming_the_first_tensor_and_both_shapes(
    tmp_path, tokenizer
):
    """A config.json that says another d_ff than its weights hold: refused before from_pretrained (whose report
    and RuntimeError came on every rank), and before FSDP1's rank-0-only loading fills the skeleton unit by
    unit; read from the safetensors headers, one file or several with their index. The unedited folders load
    (the control)."""
    single = tmp_path / "single"
    shutil.copytree(EMBEDDED_MODEL_DIR, single)
    sharded = tmp_path / "sharded"
    load_model(str(single)).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    for folder in (single, sharded):
        load_model(str(folder))
        load_model_for_run(str(folder), True, None, {}, tokenizer, rank0_fills=True)
    with_config(single, d_ff=128)
    with pytest.raises(ConfigError, match=MISMATCH.format(folder=single, file="model.safetensors")):
        load_model(str(single))
    with pytest.raises(ConfigError, match=MISMATCH.format(folder=single, file="model.safetensors")):
        load_model_for_run(str(single), True, None, {}, tokenizer, rank0_fills=True)
    with_config(sharded, d_ff=128)
    one_of_several = r"model-\d{5}-of-\d{5}.safetensors"
    with pytest.raises(ConfigError, match=MISMATCH.format(folder=sharded, file=one_of_several)):
        load_model(str(sharded))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_as_unsharded_resumes_exactly_and_exports_what_it_trained(
    family_dirs, family, tmp_path
):
    """FSDP1 and FSDP2 (2 gloo ranks, fp32) against the unsharded model, 4 AdamW steps; a checkpoint after step
    2 (FULL under FSDP1, SHARDED under FSDP2) restored into an empty skeleton continues with the same losses
    and weights; the folder each writes from its shards loads with AutoModelForSeq2SeqLM in the family's
    class, every weight equal to the trained one (tied names tied again, an untied lm_head its own, BART's
    final_logits_bias kept)."""
    from transformers import AutoModelForSeq2SeqLM

    rank0, rank1 = run_ranks(family_worker, family_dirs[family], 4, str(tmp_path), timeout_s=300)
    reference_losses, reference_state = rank0["reference"]
    source = AutoModelForSeq2SeqLM.from_pretrained(family_dirs[family])
    for version in (1, 2):
        result = rank0[version]
        assert result["losses"] == rank1[version]["losses"]
        for step, (got, want) in enumerate(zip(result["losses"], reference_losses, strict=True)):
            assert abs(got - want) <= 1e-5 * abs(want), f"FSDP{version} step {step + 1}: {got} vs {want}"
        assert result["resumed_losses"] == result["losses"][2:], f"FSDP{version} resumed"
        state = result["state"]
        assert state.keys() == reference_state.keys() == result["resumed_state"].keys()
        for name, tensor in reference_state.items():
            # A tenth of one AdamW step (lr 1e-3): Adam divides each update by its gradient's own scale, so a
            # near-zero gradient summed in another order can move a weight by a visible fraction of a step.
            assert (state[name] - tensor).abs().max().item() < 1e-4, f"FSDP{version} {name}"
            assert torch.equal(result["resumed_state"][name], state[name]), f"FSDP{version} resumed {name}"
        exported, info = AutoModelForSeq2SeqLM.from_pretrained(
            tmp_path / f"fsdp{version}" / "hf_model", output_loading_info=True
        )
        assert type(exported) is type(source)
        assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        loaded = exported.state_dict()
        for name, tensor in state.items():
            assert torch.equal(loaded[name], tensor), f"FSDP{version} export {name}"
        head_tied = exported.get_output_embeddings().weight is exported.get_input_embeddings().weight
        assert head_tied == (source.get_output_embeddings().weight is source.get_input_embeddings().weight)
        # The same folder, converted afterwards from the halfway checkpoint, holds the halfway weights.
        converted = tmp_path / f"converted{version}"
        convert_checkpoint(result["checkpoint"], str(converted), 10**9)
        again, info = AutoModelForSeq2SeqLM.from_pretrained(converted, output_loading_info=True)
        assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        assert (again.get_output_embeddings().weight is again.get_input_embeddings().weight) == head_tied


@pytest.mark.parametrize("family", sorted(LAYERS))
def test_weight_decay_spares_every_norm_and_bias_of_each_family(family_dirs, family):
    """With --weight_decay, every matrix decays and every norm weight and bias does not: by dimension, an
    independent description of the same split for these families (BART's layernorm_embedding included, which a
    match on "layer_norm" missed)."""
    model = load_model(family_dirs[family], dropout_rate=0.0)
    decay, spared = parameter_groups(model, 0.01)
    assert (decay["weight_decay"], spared["weight_decay"]) == (0.01, 0.0)
    names = {id(param): name for name, param in model.named_parameters()}
    assert sorted(names[id(p)] for p in spared["params"]) == sorted(
        n for n, p in model.named_parameters() if p.dim() == 1
    )
    assert all(p.dim() >= 2 for p in decay["params"])
    if family == "bart":
        assert "model.encoder.layernorm_embedding.weight" in {names[id(p)] for p in spared["params"]}


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_an_optimizer_saved_under_the_earlier_weight_decay_groups_loads_into_this_runs(family_dirs, full):
    """BART's layernorm_embedding decayed until 01eb195 (a name match on "layer_norm" missed it): an optimizer
    state of that grouping, as checkpoints hold it, loads into this run's groups, each with its
    hyper-parameters, and every moment by name."""
    folder = family_dirs["bart"]
    torch.manual_seed(0)
    saved_model = load_model(folder, dropout_rate=0.0)
    earlier: dict = {"decay": [], "spared": []}
    for name, param in saved_model.named_parameters():
        earlier["spared" if "layer_norm" in name or name.endswith(".bias") else "decay"].append(param)
    groups = [{"params": earlier["decay"], "weight_decay": 0.1}, {"params": earlier["spared"], "weight_decay": 0}]
    saved_optimizer = torch.optim.AdamW(groups, lr=1e-3)
    for param in saved_model.parameters():
        param.grad = torch.randn_like(param)
    saved_optimizer.step()
    optim_state = get_optimizer_state_dict(saved_model, saved_optimizer)
    model = load_model(folder, dropout_rate=0.0)
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-3)
    set_optimizer_state(model, optimizer, optim_state, full=full)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    assert all(group["lr"] == 1e-3 and "betas" in group for group in optimizer.param_groups)
    saved_params = dict(saved_model.named_parameters())
    for name, param in model.named_parameters():
        want = saved_optimizer.state[saved_params[name]]["exp_avg"]
        assert torch.equal(optimizer.state[param]["exp_avg"], want), name
