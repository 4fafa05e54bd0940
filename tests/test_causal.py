"""Decoder-only models (utils/spec.py: CausalSpec; causal_lm_dataset.py): what the loader takes and refuses,
the units, LoRA's targets and the weight decay of each family, the loss against the model's own, the FLOP count
against torch's counter, the data's tokens and labels, and FSDP1/FSDP2 against the unsharded model with a
resume and rank-0-only loading. Tiny random Llama (untied and tied) and GPT-2 models built offline by
scripts/make_tiny_family.py, once per session."""

import copy
import dataclasses
import json
import logging
import math
import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    BloomConfig,
    GPT2Config,
    LlamaConfig,
    T5Config,
)

import causal_lm_dataset
from causal_lm_dataset import (
    CausalLMDataset,
    PackedCausalDataset,
    best_fit_decreasing,
    causal_collate,
    rows_in_order,
)
from configs.data import DataConfig
from configs.errors import ConfigError
from configs.lora import LoraConfig
from configs.paths import REPO_ROOT
from policies.mixed_precision import Precision
from policies.wrapping import layer_classes
from scripts.make_tiny_family import CAUSAL_FAMILIES, make
from tests.dist_harness import one_process_group, run_ranks
from tests.dist_workers import (
    CPU,
    FP32,
    LR,
    _fsdp_config,
    causal_batch,
    family_worker,
    full_state_against,
    layers_compiled_by,
    reference_run,
    sharded,
    train_wrapped,
)
from tests.hf_folders import parameter_ties
from utils.checkpoint.hf_export import lora_exports, write_model_folder
from utils.checkpoint.state_dicts import sharded_model_state
from utils.data.cache import CAUSAL_ENCODING_BY_LENGTHS, split_rows
from utils.data.loaders import IGNORED
from utils.model.loading import load_model, load_tokenizer
from utils.model.lora import apply_lora, target_modules, transposed_layers
from utils.observe.flops import CausalFlops
from utils.spec import CAUSAL, spec_for
from utils.train.optim import parameter_groups

LAYERS = {"llama": "LlamaDecoderLayer", "llama-tied": "LlamaDecoderLayer", "gpt2": "GPT2Block"}
LORA_DEFAULTS = {"llama": ["q_proj", "v_proj"], "llama-tied": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


@pytest.fixture(scope="session")
def causal_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("causal")
    for family in CAUSAL_FAMILIES:
        make(family, str(root / family))
    return {family: str(root / family) for family in CAUSAL_FAMILIES}


@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_each_decoder_only_family_loads_as_a_causal_model_with_its_units_tokenizer_and_lora_targets(
    causal_dirs, family, caplog
):
    folder = causal_dirs[family]
    model = load_model(folder, dropout_rate=0.0)
    assert spec_for(model.config) is CAUSAL and type(model).__name__ in ("LlamaForCausalLM", "GPT2LMHeadModel")
    assert {cls.__name__ for cls in layer_classes(model)} == {LAYERS[family]}
    assert len([m for m in model.modules() if type(m) in layer_classes(model)]) == 2
    assert model.config.use_cache is False
    dropouts = ["attention_dropout"] if family != "gpt2" else ["resid_pdrop", "embd_pdrop", "attn_pdrop"]
    assert {getattr(model.config, name) for name in dropouts} == {0.0}  # --dropout_rate reaches each
    with caplog.at_level("INFO"):
        tokenizer = load_tokenizer(folder)
    # Neither tokenizer has a padding token: the EOS token pads, said once.
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None
    assert "no padding token: padding with its EOS token" in caplog.text
    assert target_modules(LoraConfig(peft="lora"), model) == LORA_DEFAULTS[family]
    head_tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert head_tied == (family != "llama")


@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_a_skeleton_has_the_models_parameters_and_ties_and_computes_its_rope_buffers(causal_dirs, family):
    """The skeleton a resume or rank-0-only loading fills: no file holds RoPE's inv_freq (a non-persistent
    buffer), so the skeleton computes it, equal to the loaded model's; the weights stay on meta."""
    loaded = load_model(causal_dirs[family])
    skeleton = load_model(causal_dirs[family], on_meta=True)

    assert parameter_ties(skeleton) == parameter_ties(loaded)
    assert all(p.is_meta for p in skeleton.parameters())
    buffers = dict(loaded.named_buffers())
    assert sorted(name for name, _ in skeleton.named_buffers()) == sorted(buffers)
    if family != "gpt2":
        assert "model.rotary_emb.inv_freq" in buffers
    for name, buffer in skeleton.named_buffers():
        assert not buffer.is_meta and torch.equal(buffer, buffers[name]), name


def test_an_encoder_only_model_is_refused_at_start(tmp_path):
    BertForMaskedLM(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                               vocab_size=100)).save_pretrained(tmp_path)  # fmt: skip
    with pytest.raises(ConfigError, match="is a bert model, an encoder only: it writes no text"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_weight_decay_spares_every_norm_and_bias_of_each_decoder_only_family(causal_dirs, family):
    """Llama's input_layernorm, post_attention_layernorm and model.norm (RMSNorm), GPT-2's ln_1, ln_2 and ln_f
    and its Conv1D biases: every 1-D parameter, an independent description of the same split."""
    model = load_model(causal_dirs[family], dropout_rate=0.0)
    decay, spared = parameter_groups(model, 0.01)
    names = {id(param): name for name, param in model.named_parameters()}
    assert sorted(names[id(p)] for p in spared["params"]) == sorted(
        n for n, p in model.named_parameters() if p.dim() == 1
    )
    assert all(p.dim() >= 2 for p in decay["params"])
    if family == "llama":
        spared_names = {names[id(p)] for p in spared["params"]}
        assert {"model.norm.weight", "model.layers.0.input_layernorm.weight"} <= spared_names


@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_the_loss_is_the_models_own_next_token_loss(causal_dirs, family):
    """CausalSpec's per-token losses, summed over their count, equal transformers' own loss of the same labels
    (it shifts them itself), with a prompt and padding left out."""
    model = AutoModelForCausalLM.from_pretrained(causal_dirs[family])
    batch = causal_batch(seed=1, rows=4, length=16, vocab=model.config.vocab_size)
    token_losses, labels = CAUSAL.token_losses(model, batch)
    ours = token_losses.sum() / (labels != IGNORED).sum()
    assert (labels != IGNORED).sum() == CAUSAL.trained_tokens(batch)
    theirs = model(**batch).loss  # input_ids, attention_mask, labels
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_training_flops_of_a_decoder_only_model_are_torchs_flop_counter_less_the_masked_pairs(causal_dirs, family):
    """Every matmul of a forward and backward of the real model (eager attention), on a batch without padding:
    eager attention computes each row's whole square of (query, key) pairs, the count its causal half with the
    diagonal (tests/test_flops.py holds it to the work one token at a time), so the two differ by the pairs the
    causal mask discards, s (s - 1) / 2 a row, at 4 * d_attn FLOPs a pair and layer, 3x for the backward."""
    model = AutoModelForCausalLM.from_pretrained(causal_dirs[family], attn_implementation="eager")
    rows, length = 3, 16
    batch = causal_batch(seed=2, rows=rows, length=length, vocab=model.config.vocab_size)
    batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
    counter = FlopCounterMode(display=False)
    with counter:
        CAUSAL.token_losses(model, batch)[0].sum().backward()
    count = CausalFlops.from_config(model.config)
    model_flops, _ = count.training(batch, recompute=False)
    masked_pairs = rows * length * (length - 1) // 2
    assert (
        counter.get_total_flops()
        == model_flops.item() + 3 * 4 * count.attention_width * count.layers * masked_pairs
    )


def test_a_completion_is_trained_on_to_its_eos_and_generation_reads_left_padded_prompts(causal_dirs):
    """Llama's tokenizer starts the prompt with <s>; the completion has no <s> and ends with </s>, which is
    also the padding token and stays in the labels; the prompt is not trained on (unless
    --completion_only_loss false); batches right-pad the sequences and left-pad the prompts."""
    tokenizer = load_tokenizer(causal_dirs["llama"])
    data = DataConfig(max_source_length=48, max_target_length=12)
    dataset = CausalLMDataset(tokenizer, "train", 4, 48, 12, data)
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    items = [dataset[i] for i in range(4)]
    for index, item in enumerate(items):
        prompt = item["prompt_ids"]
        assert prompt[0] == bos and eos not in prompt.tolist() and len(prompt) <= 48
        completion = item["input_ids"][len(prompt) :]
        assert completion[-1] == eos and bos not in completion.tolist() and len(completion) <= 12
        assert (item["labels"][: len(prompt)] == IGNORED).all()
        assert torch.equal(item["labels"][len(prompt) :], completion)
        expected = tokenizer(dataset.reference(index), add_special_tokens=False).input_ids[:11]
        assert completion[:-1].tolist() == expected
    batch = causal_collate(items, pad_token_id=tokenizer.pad_token_id)
    lengths = [len(item["input_ids"]) for item in items]
    width = max(lengths)
    assert batch["input_ids"].shape == batch["labels"].shape == (4, width)
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths
    short = lengths.index(min(lengths))
    if min(lengths) < width:
        assert (batch["labels"][short, min(lengths) :] == IGNORED).all()
    prompt_lengths = [len(item["prompt_ids"]) for item in items]
    assert batch["prompt_mask"].sum(dim=1).tolist() == prompt_lengths
    for row, length in enumerate(prompt_lengths):
        assert torch.equal(batch["prompt_ids"][row, -length:], items[row]["prompt_ids"])  # at the right end
    everything = CausalLMDataset(tokenizer, "train", 4, 48, 12, DataConfig(completion_only_loss=False))
    assert torch.equal(everything[0]["labels"], everything[0]["input_ids"])


@pytest.mark.slow  # 5-14 s each: the fast subset keeps the single-process checks of the same code
@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_each_decoder_only_family_trains_as_unsharded_resumes_exactly_and_exports_what_it_trained(
    causal_dirs, family, tmp_path
):
    """FSDP1 and FSDP2 (2 gloo ranks, fp32) against the unsharded model, 4 AdamW steps, losses within 1e-5
    relative; a checkpoint after step 2 (FULL under FSDP1, SHARDED under FSDP2) restored into an empty skeleton
    continues with the same losses and weights, its RoPE buffers those of a fresh model; rank-0-only loading
    with activation checkpointing trains as the reference; packed blocks (two documents a row, position ids
    restarting) train as the unsharded model on the same blocks; the folder written from the shards loads with
    AutoModelForCausalLM, every weight the trained one."""
    rank0, rank1 = run_ranks(family_worker, causal_dirs[family], 4, str(tmp_path), timeout_s=300)
    reference_losses, reference_state = rank0["reference"]
    packed_reference = rank0["packed_reference"][0]
    assert all(abs(a - b) > 1e-3 for a, b in zip(packed_reference, reference_losses, strict=True))
    for version in (1, 2):
        result = rank0[version]
        assert result["losses"] == rank1[version]["losses"]
        for name, want_losses in (("losses", reference_losses), ("rank0_loaded_losses", reference_losses),
                                  ("packed_losses", packed_reference)):  # fmt: skip
            for step, (got, want) in enumerate(zip(result[name], want_losses, strict=True)):
                assert abs(got - want) <= 1e-5 * abs(want), f"FSDP{version} {name} {step + 1}: {got} vs {want}"
        assert result["resumed_losses"] == result["losses"][2:], f"FSDP{version} resumed"
        assert result["resumed_buffers_as_fresh"] and rank1[version]["resumed_buffers_as_fresh"]
        assert result["rank0_loaded_buffers_as_fresh"] and rank1[version]["rank0_loaded_buffers_as_fresh"]
        state = result["state"]
        assert state.keys() == reference_state.keys() == result["resumed_state"].keys()
        for name, tensor in reference_state.items():
            assert (state[name] - tensor).abs().max().item() < 1e-4, f"FSDP{version} {name}"
            assert torch.equal(result["resumed_state"][name], state[name]), f"FSDP{version} resumed {name}"
        folder = tmp_path / f"fsdp{version}" / "hf_model"
        exported, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        assert json.loads((folder / "config.json").read_text())["architectures"] == [type(exported).__name__]
        loaded = exported.state_dict()
        for name, tensor in state.items():
            assert torch.equal(loaded[name], tensor), f"FSDP{version} export {name}"


def whole_texts(folder, rows: int = 24) -> str:
    """A train file of whole texts of 6 to 40 words (a --dataset_text_field column, `content`)."""
    words = "rinse the rice boil water add salt stir gently cover and wait until it is soft".split()
    path = folder / "train.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for row in range(rows):
            text = " ".join(words[(row + i) % len(words)] for i in range(6 + (row * 7) % 35))
            f.write(json.dumps({"content": f"{text}.", "id": f"text-{row}"}) + "\n")
    return str(path)


def text_data(tmp_path, **settings) -> DataConfig:
    return DataConfig(train_file=whole_texts(tmp_path), dataset_text_field="content", max_seq_len=96,
                      cache_dir=str(tmp_path / "cache"), **settings)  # fmt: skip


@pytest.mark.parametrize(
    ("family", "attention"),
    [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa"), ("gpt2", "eager"),
     # FlexAttention, the GPU's kernel for packed blocks (GPT-2 has none), compiles its kernel (7 s) and has no
     # backward on a CPU: its forward is compared, with no gradients
     pytest.param("llama", "flex_attention", marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_packed_block_keeps_its_documents_apart_each_with_the_losses_it_has_alone(
    causal_dirs, family, attention, tmp_path
):
    """--packing documents: a block of several rows, read with position ids restarting per row and no
    attention mask, gives each row's per-token losses as the row alone does (within 1e-6 relative), every
    row's tokens in some block exactly once, and the padding of a batch trains nothing. With FlexAttention
    transformers turns the position ids into a block mask of the documents."""
    tokenizer = load_tokenizer(causal_dirs[family])
    data = text_data(tmp_path, packing=True)
    lengths = CausalLMDataset.lengths(data)
    plain = CausalLMDataset(tokenizer, "train", None, *lengths, data)
    packed = PackedCausalDataset(tokenizer, "train", None, *lengths, data)
    assert len(packed) < len(plain)  # several rows per block
    model = AutoModelForCausalLM.from_pretrained(causal_dirs[family], attn_implementation=attention)
    model.requires_grad_(attention != "flex_attention")
    # Each row alone through SDPA where the packed block goes through FlexAttention: torch 2.13's CPU FlexAttention
    # kernel is wrong at some lengths of this tiny model's 16-wide heads (40 tokens: errors of 1 to 2, or NaN;
    # docs/pitfalls.md #52), and the rows alone come in many lengths (the packed blocks in one).
    reference = model if attention != "flex_attention" else AutoModelForCausalLM.from_pretrained(
        causal_dirs[family], attn_implementation="sdpa").requires_grad_(False)  # fmt: skip
    batch = causal_collate([packed[0], packed[1]], pad_token_id=tokenizer.pad_token_id)
    packed_losses, labels = CAUSAL.token_losses(model, batch)
    for block in (0, 1):
        rows = packed.rows_of(block).tolist()
        assert len(rows) >= 2 or block == 1
        alone = []
        for row in rows:
            losses, _ = CAUSAL.token_losses(reference, causal_collate([plain[row]], tokenizer.pad_token_id))
            alone += [torch.zeros(1), losses[0]]  # the row's first token is no target, alone or packed
        expected = torch.cat(alone)[1:]
        got = packed_losses[block, : len(expected)]
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6), (got - expected).abs().max()
        assert (labels[block, len(expected) :] == IGNORED).all()  # the batch's padding
    seen = torch.cat([packed[b]["input_ids"] for b in range(len(packed))])
    every_row = torch.cat([plain[row]["input_ids"] for row in range(len(plain))])
    assert torch.equal(seen, every_row)  # every token once, in order (no row is longer than a block here)


def test_a_row_longer_than_a_block_keeps_its_completion_and_the_prompts_end(causal_dirs):
    """--packing documents with blocks shorter than a row (the embedded WikiHow sample's prompts, 24-token
    blocks), as a run started before rows were bounded by --max_seq_len reads them (the rows of today's encoding
    fit a block: tests/test_causal_rows.py): each row keeps its last 24 tokens, its completion and EOS among
    them, so every block is trained on. Control: cutting the rows' ends instead (the completion first) leaves
    blocks with no trained token."""
    tokenizer = load_tokenizer(causal_dirs["llama"])
    data = DataConfig(packing=True, max_seq_len=24, max_target_length=12)
    lengths = CausalLMDataset.lengths(data, CAUSAL_ENCODING_BY_LENGTHS)
    rows = split_rows(tokenizer, "validation", 8, *lengths, data, encoding=CAUSAL_ENCODING_BY_LENGTHS)
    plain = CausalLMDataset(tokenizer, "validation", 8, *lengths, data, rows=rows)
    packed = PackedCausalDataset(tokenizer, "validation", 8, *lengths, data, rows=rows)
    rows = [plain.sequence(row) for row in range(len(plain))]
    assert all(len(ids) > 24 for ids, _, _ in rows)  # every row is cut: one row per block
    assert len(packed) == len(plain)
    for block, (ids, labels, _) in enumerate(rows):
        item = packed[block]
        assert torch.equal(item["input_ids"], ids[-24:]) and item["input_ids"][-1] == tokenizer.eos_token_id
        assert torch.equal(item["labels"][1:], labels[-23:]) and (item["labels"] != IGNORED).any()
    assert all(
        (labels[:24][1:] == IGNORED).all() for _, labels, _ in rows
    )  # the control: their starts train nothing


def test_a_validation_split_with_no_scored_token_has_no_loss_and_no_best_model(causal_dirs):
    """Rows whose every label is masked score nothing: the validation loss is NaN, not 0 (which, lowest of
    all, would have been taken for the best model, its perplexity 1)."""

    from utils.train.step import validate

    tokenizer = load_tokenizer(causal_dirs["llama"])
    model = AutoModelForCausalLM.from_pretrained(causal_dirs["llama"])
    item = CausalLMDataset(tokenizer, "validation", 2, 48, 12, DataConfig())[0]
    unscored = causal_collate(
        [{**item, "labels": torch.full_like(item["labels"], IGNORED)}], tokenizer.pad_token_id
    )
    progress = type("NoBar", (), {"update": lambda self, n: None})()
    with one_process_group():
        losses = [
            validate(
                model, [batch], device=torch.device("cpu"), num_real_samples=1, progress=progress, spec=CAUSAL
            )
            for batch in (unscored, causal_collate([item], tokenizer.pad_token_id))
        ]
    assert math.isnan(losses[0]) and math.isfinite(losses[1]) and losses[1] > 0
    assert math.isnan(CAUSAL.loss_metrics(losses[0])["val_perplexity"])
    assert not CAUSAL.is_better("val_loss", losses[0], None) and CAUSAL.is_better("val_loss", losses[1], losses[0])


def test_best_fit_decreasing_puts_each_row_where_it_leaves_the_least_room():
    """--packing_strategy bfd's placement: TRL's pack_dataset example (lengths 3, 2, 3, 1 in blocks of 4: the
    1 joins the first 3, equal rooms taken oldest first); a row goes to the block it fills best, not to the
    first with room (the control: first fit would put the 2 beside the 12). On random lengths: every row once,
    no block over capacity, no two blocks that would fit in one, fewer blocks than in order, the same blocks
    on a second call."""
    assert best_fit_decreasing([3, 2, 3, 1], 4) == [[0, 3], [2], [1]]
    assert best_fit_decreasing([12, 9, 9, 2], 20) == [[0], [1, 2, 3]]
    assert best_fit_decreasing([2, 9, 12, 9], 20) == [[2], [1, 3, 0]]  # the same lengths, rows in another order
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 300, (500,), generator=generator).tolist()
    blocks = best_fit_decreasing(lengths, 512)
    assert sorted(row for block in blocks for row in block) == list(range(500))
    totals = [sum(lengths[row] for row in block) for block in blocks]
    assert max(totals) <= 512 and sorted(totals)[0] + sorted(totals)[1] > 512
    assert len(blocks) < len(rows_in_order(lengths, 512)) and blocks == best_fit_decreasing(lengths, 512)


def test_bfd_packing_keeps_each_row_apart_as_documents_does_in_fewer_blocks(causal_dirs, tmp_path):
    """--packing_strategy bfd on the whole texts (24 rows of 14-65 tokens, blocks of 96): 10 blocks where
    documents packing makes 13, every row once; a block's position ids restart at each of its rows, and each
    row's per-token losses in a batch of blocks are those it has alone (the rows out of their order, four in a
    block)."""
    tokenizer = load_tokenizer(causal_dirs["llama"])
    data = text_data(tmp_path, packing=True, packing_strategy="bfd")
    lengths = CausalLMDataset.lengths(data)
    plain = CausalLMDataset(tokenizer, "train", None, *lengths, data)
    packed = PackedCausalDataset(tokenizer, "train", None, *lengths, data)
    documents = PackedCausalDataset(tokenizer, "train", None, *lengths, dataclasses.replace(data,
                                    packing_strategy="documents"))  # fmt: skip
    assert (len(packed), len(documents)) == (10, 13)
    assert sorted(packed.block_rows.tolist()) == list(range(len(plain)))
    assert "(bfd) into 10 blocks of 96 tokens: 0.0% of their tokens dropped, 7.5% of the blocks padding" in (
        packed.packing_note())  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(causal_dirs["llama"])
    blocks = [0, len(packed) - 1]
    batch = causal_collate([packed[b] for b in blocks], pad_token_id=tokenizer.pad_token_id)
    packed_losses, _ = CAUSAL.token_losses(model, batch)
    for index, block in enumerate(blocks):
        rows = packed.rows_of(block).tolist()
        assert rows != sorted(rows) or len(rows) < 2
        alone, positions = [], []
        for row in rows:
            losses, _ = CAUSAL.token_losses(model, causal_collate([plain[row]], tokenizer.pad_token_id))
            alone += [torch.zeros(1), losses[0]]
            positions.append(torch.arange(len(plain[row]["input_ids"])))
        expected = torch.cat(alone)[1:]
        assert torch.equal(batch["position_ids"][index, : len(expected) + 1], torch.cat(positions))
        got = packed_losses[index, : len(expected)]
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6), (got - expected).abs().max()
    assert len(packed.rows_of(blocks[1])) == 4


def test_bfd_blocks_are_the_same_on_any_number_of_ranks_and_a_resume_reads_each_once(causal_dirs, tmp_path):
    """The bfd blocks are a function of the cached rows alone: built for 1 and for 2 ranks, and again from a
    new cache, they are the same blocks, token for token. An epoch dealt to 2 ranks, stopped after a step and
    resumed on 1 rank, reads the uninterrupted 1-rank epoch's blocks, each once, in its order."""
    from utils.data.loaders import build_dataset
    from utils.data.samplers import train_sampler_for

    tokenizer = load_tokenizer(causal_dirs["llama"])
    data = text_data(tmp_path, packing=True, packing_strategy="bfd")
    builds = [build_dataset(tokenizer, causal_lm_dataset.FORMAT, "train", None, data, world_size)
              for world_size in (1, 2)]  # fmt: skip
    again = dataclasses.replace(data, cache_dir=str(tmp_path / "another_cache"))
    builds.append(build_dataset(tokenizer, causal_lm_dataset.FORMAT, "train", None, again, 2))
    items = [[build[b] for b in range(len(build))] for build in builds]
    for other in items[1:]:
        assert len(other) == len(items[0]) == 10
        assert all(torch.equal(a[key], b[key]) for a, b in zip(items[0], other, strict=True) for key in a)
    packed = builds[0]
    uninterrupted = list(train_sampler_for(packed, 0, 1, seed=3))
    batch = 2
    first_step = [list(train_sampler_for(packed, rank, 2, seed=3))[:batch] for rank in range(2)]
    resumed = train_sampler_for(packed, 0, 1, seed=3)
    resumed.set_epoch(0, samples_consumed=batch * 2)
    read = sorted(b for share in first_step for b in share) + list(resumed)
    assert sorted(read) == list(range(len(packed))) and list(resumed) == uninterrupted[batch * 2 :]


def test_wrapped_packing_is_the_rows_tokens_concatenated_and_cut(causal_dirs, tmp_path):
    """--packing_strategy wrapped (the Llama 2 guide's): the blocks are every row's tokens one after the other,
    cut into full blocks of --max_seq_len, token for token, the last part dropped; labels the same tokens."""
    tokenizer = load_tokenizer(causal_dirs["llama"])
    data = text_data(tmp_path, packing=True, packing_strategy="wrapped")
    lengths = CausalLMDataset.lengths(data)
    plain = CausalLMDataset(tokenizer, "train", None, *lengths, data)
    packed = PackedCausalDataset(tokenizer, "train", None, *lengths, data)
    every_row = torch.cat([plain[row]["input_ids"] for row in range(len(plain))])
    assert len(packed) == len(every_row) // 96 >= 2
    blocks = torch.stack([packed[b]["input_ids"] for b in range(len(packed))])
    assert torch.equal(blocks.flatten(), every_row[: len(packed) * 96])
    row_labels = torch.cat([plain[row]["labels"] for row in range(len(plain))])
    assert torch.equal(torch.stack([packed[b]["labels"] for b in range(len(packed))]).flatten(),
                       row_labels[: len(packed) * 96])  # fmt: skip
    assert "dropped" in packed.packing_note()


def test_a_text_field_row_is_trained_on_whole_and_a_seq2seq_model_refuses_it(causal_dirs, tmp_path):
    """--dataset_text_field: each text is the completion of nothing (Llama: its <s> alone before it), every
    token of it trained on, its EOS last, cut to --max_seq_len; an encoder-decoder refuses the setting."""
    tokenizer = load_tokenizer(causal_dirs["llama"])
    data = text_data(tmp_path)
    item = CausalLMDataset(tokenizer, "train", None, *CausalLMDataset.lengths(data), data)[0]
    assert item["prompt_ids"].tolist() == [tokenizer.bos_token_id]
    assert item["input_ids"][-1] == tokenizer.eos_token_id and len(item["input_ids"]) <= 96 + 1
    assert torch.equal(item["labels"][1:], item["input_ids"][1:])
    from utils.spec import SEQ2SEQ

    with pytest.raises(ConfigError, match="--dataset_text_field is for decoder-only models"):
        SEQ2SEQ.check_data(data, T5Config())
    with pytest.raises(ConfigError, match="--packing true is for decoder-only models"):
        SEQ2SEQ.check_data(DataConfig(packing=True), T5Config())


def test_trls_max_length_is_a_decoder_only_models_length_and_an_encoder_decoder_refuses_it():
    """--max_length (TRL's sequence length) becomes --max_seq_len: a decoder-only model takes it; an
    encoder-decoder, whose lengths are two, refuses it in one message naming them, 1024 as any other (the
    controls: its default; a resumed run's record, whose 1024 every run recorded before it became NONE)."""
    from configs.cli import parse_args
    from utils.spec import SEQ2SEQ

    data = parse_args(["--max_length", "512"]).data
    assert data.max_seq_len == 512
    CAUSAL.check_data(data, LlamaConfig())
    with pytest.raises(ConfigError) as refused:
        SEQ2SEQ.fitted_data(data, T5Config(), resumed=False)
    assert str(refused.value) == (
        "--max_seq_len 512 (TRL's --max_length) is a decoder-only model's one length; an encoder-decoder's are "
        "two: --max_source_length (the source's tokens) and --max_target_length (the target's). Give those instead"
    )
    with pytest.raises(ConfigError, match="--max_seq_len 1024 "):
        SEQ2SEQ.fitted_data(parse_args(["--max_length", "1024"]).data, T5Config(), resumed=False)
    assert SEQ2SEQ.fitted_data(parse_args([]).data, T5Config(), resumed=False).max_seq_len is None
    recorded = parse_args(["--max_seq_len", "1024"]).data
    assert SEQ2SEQ.fitted_data(recorded, T5Config(), resumed=True).max_seq_len is None


def test_documents_packing_is_refused_for_a_model_that_takes_no_position_ids():
    """BLOOM's forward takes no position ids, from which transformers keeps a packed block's rows apart: a
    row's losses in a block differ from its losses alone (Llama's, the control, are equal), so documents
    packing (and bfd's, which keeps rows apart alike) is refused for it; wrapped packing and no packing are
    allowed. Llama and GPT-2 take them."""
    from transformers import BloomForCausalLM, LlamaForCausalLM

    torch.manual_seed(0)
    first, second = torch.randint(3, 100, (7,)), torch.randint(3, 100, (5,))
    labels = torch.cat([first, torch.tensor([IGNORED]), second[1:]])
    block = {"input_ids": torch.cat([first, second])[None], "labels": labels[None],
             "position_ids": torch.cat([torch.arange(7), torch.arange(5)])[None]}  # fmt: skip
    alone = {"input_ids": second[None], "labels": second[None], "attention_mask": torch.ones(1, 5)}
    small = {"vocab_size": 100, "hidden_size": 32, "num_attention_heads": 4}
    bloom = BloomForCausalLM(BloomConfig(n_layer=2, **small)).eval()
    llama = LlamaForCausalLM(LlamaConfig(intermediate_size=64, num_hidden_layers=2, **small)).eval()
    with torch.no_grad():
        apart = {name: torch.allclose(CAUSAL.token_losses(model, block)[0][0, 7:],
                                      CAUSAL.token_losses(model, alone)[0][0], atol=1e-6)
                 for name, model in (("bloom", bloom), ("llama", llama))}  # fmt: skip
    assert apart == {"bloom": False, "llama": True}
    documents = DataConfig(packing=True)
    with pytest.raises(ConfigError, match="by their position ids, and BloomForCausalLM takes none"):
        CAUSAL.check_data(documents, BloomConfig())
    with pytest.raises(ConfigError, match="--packing_strategy bfd keeps a block's rows apart"):
        CAUSAL.check_data(dataclasses.replace(documents, packing_strategy="bfd"), BloomConfig())
    CAUSAL.check_data(dataclasses.replace(documents, packing_strategy="wrapped"), BloomConfig())
    CAUSAL.check_data(DataConfig(), BloomConfig())
    for config in (LlamaConfig(), GPT2Config()):
        CAUSAL.check_data(documents, config)


def causal_lora_worker(rank: int, world_size: int, folder: str, targets: str, export_dir: str) -> dict:
    """LoRA on a decoder-only model under FSDP2: 3 steps, then the merged model written from the shards to
    export_dir/hf_model; rank 0 returns the gathered trained PEFT model's state dict (PEFT's names)."""
    torch.manual_seed(0)
    lora = LoraConfig(peft="lora", lora_r=4, lora_alpha=8, lora_target_modules=targets, merge_lora=True)
    model = apply_lora(load_model(folder, dropout_rate=0.0), lora, folder, CAUSAL)
    model_config = model.config
    model, parallelism = sharded(model, _fsdp_config({"fsdp_version": 2}), FP32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_wrapped(model, parallelism, optimizer, rank, world_size, 3, model_config.vocab_size, spec=CAUSAL)
    _, merged = lora_exports(sharded_model_state(model), lora, CPU, transposed_layers(model))
    write_model_folder(
        merged, model_config, CAUSAL, load_tokenizer(folder), f"{export_dir}/hf_model", 10**9, rank == 0
    )
    return {"state": parallelism.full_state_dict(model, CPU)}


@pytest.mark.slow  # two ranks and an export each
@pytest.mark.parametrize(
    ("family", "targets"), [("gpt2", "c_attn,c_proj"), ("llama", "auto"), ("llama", "all-linear")]
)
def test_a_decoder_only_lora_run_exports_the_model_peft_merges(causal_dirs, family, targets, tmp_path):
    """LoRA (CAUSAL_LM) under FSDP2 on 2 ranks, merged into hf_model/ from the shards: every weight is PEFT's
    merge_and_unload of the gathered trained model. GPT-2's Conv1D layers store their weight (in, out), PEFT's
    fan_in_fan_out: c_attn (64 x 192) and c_proj (64 x 64, square, where a missing transpose goes unseen by
    the shapes) included."""
    from peft import PeftModel  # noqa: F401 - PEFT present, as apply_lora needs

    from configs.lora import LoraConfig as Settings

    rank0, _ = run_ranks(causal_lora_worker, causal_dirs[family], targets, str(tmp_path), timeout_s=300)
    torch.manual_seed(0)
    settings = Settings(peft="lora", lora_r=4, lora_alpha=8, lora_target_modules=targets, merge_lora=True)
    reference = apply_lora(
        load_model(causal_dirs[family], dropout_rate=0.0), settings, causal_dirs[family], CAUSAL
    )
    reference.load_state_dict(rank0["state"], strict=True)
    expected = reference.merge_and_unload().state_dict()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model").state_dict()
    assert exported.keys() == expected.keys()
    trained = [name for name in expected if "c_proj" in name or "q_proj" in name]
    assert trained and any(not torch.equal(expected[n], load_model(causal_dirs[family]).state_dict()[n])
                           for n in trained)  # fmt: skip
    for name, tensor in expected.items():
        assert torch.allclose(exported[name], tensor, rtol=0, atol=1e-6), name


@pytest.mark.parametrize("family", [*CAUSAL_FAMILIES, "t5"])
def test_all_linear_adapts_what_peft_adapts_every_linear_layer_but_the_head(causal_dirs, family):
    """--lora_target_modules all-linear (PEFT's shorthand; the guide's LoRA command and TRL give it): the
    layers PEFT's own all-linear adapts, every linear layer but the output head (tied or not), GPT-2's Conv1D
    included; the control: auto adapts the attention's alone."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from configs.paths import EMBEDDED_MODEL_DIR
    from utils.spec import SEQ2SEQ

    folder, spec = (str(EMBEDDED_MODEL_DIR), SEQ2SEQ) if family == "t5" else (causal_dirs[family], CAUSAL)
    adapted = {}
    for targets in ("all-linear", "auto"):
        lora = LoraConfig(peft="lora", lora_target_modules=targets)
        adapted[targets] = set(
            apply_lora(load_model(folder, dropout_rate=0.0), lora, folder, spec).targeted_module_names
        )
    peft_config = PeftLoraConfig(task_type=spec.lora_task_type, target_modules="all-linear")
    with warnings.catch_warnings():  # PEFT's own word on GPT-2's Conv1D (fan_in_fan_out)
        warnings.simplefilter("ignore")
        peft_own = set(get_peft_model(load_model(folder, dropout_rate=0.0), peft_config).targeted_module_names)
    assert adapted["all-linear"] == peft_own and not any("lm_head" in name for name in peft_own)
    assert adapted["auto"] < adapted["all-linear"]


# Seed 004's system (the FSDP guide's Llama 2 fine-tune): its command, HF's names and the guide's own flags as
# the package maps them, on the tiny Llama and the embedded chat-format sample (data/code_chat), with its
# accelerate config (configs/accelerate_llama2_fsdp.yaml). Scaled down: --max_steps 12, shorter blocks, a
# larger learning rate, --eval_on_start for the perplexity before training.
CODE_CHAT = REPO_ROOT / "data" / "code_chat"
LLAMA2_CONFIG = REPO_ROOT / "configs" / "accelerate_llama2_fsdp.yaml"


def seed_004_flags(model: str, output_dir: str, max_steps: int = 12) -> list[str]:
    return ["--model_name", model, "--dataset_name", str(CODE_CHAT), "--max_seq_len", "512",
            "--max_steps", str(max_steps), "--logging_steps", "4", "--eval_steps", "6", "--save_steps", "6",
            "--bf16", "True", "--packing", "True",
            "--output_dir", output_dir, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
            "--dataset_text_field", "content", "--use_gradient_checkpointing", "True", "--learning_rate", "5e-3",
            "--lr_scheduler_type", "cosine", "--weight_decay", "0.01", "--warmup_ratio", "0.03",
            "--use_flash_attn", "True", "--eval_on_start", "true"]  # fmt: skip


@pytest.mark.slow
def test_accelerate_launch_runs_seed_004_with_its_config_and_flags_and_lowers_the_perplexity(
    causal_dirs, tmp_path
):
    """The guide's FSDP settings reach the run (FULL_SHARD over LlamaDecoderLayer, SHARDED_STATE_DICT,
    rank-0-only loading, activation checkpointing, bf16 asked), the chat texts are packed, the perplexity on
    the validation texts falls from the model as it starts (step 0) to the end, and the final model loads with
    AutoModelForCausalLM."""
    from tests.test_accelerate_env import accelerate_launch_run

    output_dir = tmp_path / "run"
    run = accelerate_launch_run(seed_004_flags(causal_dirs["llama"], str(output_dir)), config=LLAMA2_CONFIG)
    assert run.returncode == 0, run.describe()
    for note in ("--use_flash_attn True -> --attn_implementation sdpa", "--bf16 True -> --mixed_precision true",
                 "--use_gradient_checkpointing True -> --fsdp_activation_checkpointing true"):  # fmt: skip
        assert note in run.output, note
    assert "rows packed (documents) into" in run.output
    record = json.loads((output_dir / "config.json").read_text(encoding="utf-8"))
    fsdp = record["fsdp_config"]
    assert (fsdp["fsdp_version"], fsdp["sharding_strategy"], fsdp["checkpoint_type"]) == (
        1, "FULL_SHARD", "SHARDED_STATE_DICT")  # fmt: skip
    assert fsdp["cpu_ram_efficient_loading"] and fsdp["fsdp_activation_checkpointing"] and fsdp["mixed_precision"]
    assert record["from_accelerate"]["checkpoint_type"] == "FSDP_STATE_DICT_TYPE"
    assert record["data_config"]["packing"] and record["data_config"]["dataset_text_field"] == "content"
    validations = [json.loads(line) for line in (output_dir / "metrics.jsonl").open() if '"validation"' in line]
    epochs = [json.loads(line) for line in (output_dir / "metrics.jsonl").open() if '"type": "epoch"' in line]
    first, last = validations[0], epochs[-1]
    assert first["step"] == 0 and first["val_perplexity"] == pytest.approx(math.exp(first["val_loss"]))
    assert last["val_perplexity"] < 0.5 * first["val_perplexity"], (first, last)
    assert (output_dir / "checkpoints" / "step_00000012" / ".metadata").is_file()  # sharded (DCP's)
    model = AutoModelForCausalLM.from_pretrained(output_dir / "hf_model")
    assert type(model).__name__ == "LlamaForCausalLM"


def test_the_embedded_chat_sample_is_what_its_script_writes(tmp_path):
    """data/code_chat is scripts/make_chat_sample.py's output, byte for byte (seeded)."""
    from scripts.make_chat_sample import ROWS, write

    write(tmp_path)
    for split, rows in ROWS.items():
        made = (tmp_path / f"{split}.jsonl").read_bytes()
        assert made == (CODE_CHAT / f"{split}.jsonl").read_bytes() and made.count(b"\n") == rows


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_folder(causal_dirs, tmp_path, template: str | None = CHAT_TEMPLATE) -> str:
    """The tiny Llama with a chat template in its tokenizer (or none)."""
    import shutil

    folder = tmp_path / "chat-llama"
    shutil.copytree(causal_dirs["llama"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def conversations(tmp_path, last_role: str = "assistant") -> DataConfig:
    """A train file of conversations in TRL's conversational format (a messages column)."""
    path = tmp_path / f"chats-{last_role}.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for row in range(8):
            reply = f"Rinse it, then boil it for {row + 10} minutes."
            messages = [{"role": "system", "content": "Answer briefly."},
                        {"role": "user", "content": f"How do I cook rice number {row}?"},
                        {"role": last_role, "content": reply}]  # fmt: skip
            f.write(json.dumps({"messages": messages}) + "\n")
    return DataConfig(train_file=str(path), cache_dir=str(tmp_path / f"cache-{last_role}"), max_source_length=96)


def test_a_conversation_is_rendered_by_the_chat_template_and_trained_on_its_reply_alone(causal_dirs, tmp_path):
    """A messages column: the prompt is the conversation rendered up to the assistant's turn, the completion
    the reply as the template closes it; the loss is on the reply's tokens alone; generation's reference is the
    reply. Refused with one message each: a tokenizer with no chat template, a template that leaves the reply
    out, a prompt whose last token changes when the reply follows, a conversation that does not end with the
    assistant, an encoder-decoder."""
    from summarization_dataset import SummarizationDataset

    tokenizer = load_tokenizer(chat_folder(causal_dirs, tmp_path))
    data = conversations(tmp_path)
    dataset = CausalLMDataset(tokenizer, "train", None, *CausalLMDataset.lengths(data), data)
    assert dataset.cleaning == "chat"
    item = dataset[0]
    messages = json.loads(dataset.article(0))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|assistant|>") and "Answer briefly." in prompt
    assert item["prompt_ids"].tolist() == tokenizer(prompt, add_special_tokens=False).input_ids
    reply = dataset.reference(0)
    assert reply.startswith("Rinse it, then boil it for")
    completion = item["input_ids"][len(item["prompt_ids"]) :]
    assert completion.tolist() == tokenizer(f" {reply}</s>", add_special_tokens=False).input_ids
    assert completion[-1] == tokenizer.eos_token_id
    assert (item["labels"][: len(item["prompt_ids"])] == IGNORED).all()
    assert torch.equal(item["labels"][len(item["prompt_ids"]) :], completion)

    bare = load_tokenizer(chat_folder(causal_dirs, tmp_path / "bare", template=None))
    with pytest.raises(ConfigError, match="has no chat template to render them"):
        CausalLMDataset(bare, "train", None, *CausalLMDataset.lengths(data), data)
    dropping = load_tokenizer(
        chat_folder(causal_dirs, tmp_path / "dropping", "{% for m in messages %}{{ m['role'] }}{% endfor %}")
    )
    with pytest.raises(ConfigError, match="leaves the reply out"):
        CausalLMDataset(dropping, "train", None, *CausalLMDataset.lengths(data), data)
    # A turn marker ending with a space: alone it is a token of its own; before the reply, part of the reply's
    # first token. Training would see other tokens than those generation continues.
    spaced = load_tokenizer(chat_folder(causal_dirs, tmp_path / "spaced", CHAT_TEMPLATE.replace(
        "<|assistant|>{% endif %}", "<|assistant|> {% endif %}")))  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"reads a conversation's prompt \('.*\|assistant\|> '\) into other tokens"
    ):
        CausalLMDataset(spaced, "train", None, *CausalLMDataset.lengths(data), data)
    from configs.errors import DataError

    ending_with_user = conversations(tmp_path, last_role="user")
    with pytest.raises(DataError, match="ends with a 'user' message"):
        CausalLMDataset(tokenizer, "train", None, *CausalLMDataset.lengths(ending_with_user), ending_with_user)
    with pytest.raises(ConfigError, match="holds conversations .* an encoder-decoder"):
        SummarizationDataset(tokenizer, "train", None, 96, 32, data)


def test_every_assistant_reply_of_a_conversation_is_trained_on_and_nothing_else(causal_dirs, tmp_path, caplog):
    """A conversation of several turns: with --completion_only_loss the loss is on each assistant reply as the
    template renders it (end-of-turn marker included), the earlier ones in the prompt too, and on no system or
    user token nor turn marker (TRL's assistant_only_loss); with false on every token. An earlier reply that
    cannot be told apart (a template that shortens the history; a tool call's content, no text) is left out of
    the loss, and rank 0 says how many; the last reply is trained on either way."""
    replies = ["Rinse it first.", "Then boil it for 12 minutes.", "Salt it at the end."]
    messages = [{"role": "system", "content": "Answer briefly."}]
    for turn, reply in enumerate(replies):
        messages += [{"role": "user", "content": f"And step {turn + 1}?"}, {"role": "assistant", "content": reply}]
    tool_call = [*messages[:3], {"role": "assistant", "content": None}, *messages[3:]]
    path = tmp_path / "turns.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n" + json.dumps({"messages": tool_call}) + "\n")
    data = DataConfig(train_file=str(path), validation_file=str(path), cache_dir=str(tmp_path / "cache"),
                      max_source_length=256)  # fmt: skip
    tokenizer = load_tokenizer(chat_folder(causal_dirs, tmp_path))
    dataset = CausalLMDataset(tokenizer, "train", None, *CausalLMDataset.lengths(data), data)

    def trained(item) -> list[int]:
        return item["input_ids"][item["labels"] != IGNORED].tolist()

    def rendered(texts) -> list[int]:
        return tokenizer("".join(f" {text}</s>" for text in texts), add_special_tokens=False).input_ids

    item = dataset[0]
    assert item["input_ids"].tolist() == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert trained(item) == rendered(replies)  # each reply and its end of turn, nothing else
    assert trained(dataset[1]) == rendered(replies)  # the tool call (no text) left out
    assert dataset.notes() == [
        f"earlier assistant replies not trained on: 1 in the train conversations of {dataset.source_description} "
        "(their conversations' last replies are). For each, one of: the chat template renders it differently "
        "once the conversation goes on, its content is not a text (a tool call), a token straddles its edges, or "
        "the tokenizer gives no character offsets (a slow one). --completion_only_loss false trains on every "
        "token."
    ]

    everything = dataclasses.replace(data, completion_only_loss=False, cache_dir=str(tmp_path / "cache-all"))
    dataset = CausalLMDataset(tokenizer, "train", None, *CausalLMDataset.lengths(everything), everything)
    assert torch.equal(dataset[0]["labels"], dataset[0]["input_ids"]) and dataset.notes() == []

    # Earlier replies rendered without their content (as some templates shorten the history): nothing to find
    shortened = "{{ m['content'] if loop.last or m['role'] != 'assistant' else '...' }}"
    shortening = load_tokenizer(
        chat_folder(causal_dirs, tmp_path / "shortening", CHAT_TEMPLATE.replace("{{ m['content'] }}", shortened))
    )
    dataset = CausalLMDataset(shortening, "train", None, *CausalLMDataset.lengths(data), data)
    assert trained(dataset[0]) == rendered(replies[-1:])
    assert dataset.notes()[0].startswith("earlier assistant replies not trained on: 5 in")  # 2 + 3
    from causal_lm_dataset import FORMAT
    from utils.data.loaders import build_dataset

    with caplog.at_level(logging.WARNING):  # rank 0's loaders say it, once
        build_dataset(shortening, FORMAT, "train", 0, data, world_size=1)
    assert caplog.text.count("earlier assistant replies not trained on: 5 in") == 1


def test_a_message_of_an_unknown_role_is_counted_and_said_or_refused(causal_dirs, tmp_path, caplog):
    """Messages of a role the package does not know ('wizard', 'narrator'): rendered by a template that renders
    any role, counted by role and said once by rank 0's loaders; refused with one message by a template that
    raises on them, or leaves them out. The control: conversations of known roles say nothing."""
    from causal_lm_dataset import FORMAT
    from configs.errors import DataError
    from utils.data.loaders import build_dataset

    path = tmp_path / "wizards.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for row in range(6):
            messages = [{"role": "system", "content": "Answer briefly."},
                        {"role": "wizard", "content": f"A spell, number {row}."},
                        {"role": "narrator", "content": "Then the wizard spoke again."},
                        {"role": "wizard", "content": "Another spell."},
                        {"role": "user", "content": "How do I cook rice?"},
                        {"role": "assistant", "content": "Rinse it, then boil it."}]  # fmt: skip
            f.write(json.dumps({"messages": messages}) + "\n")
    data = DataConfig(train_file=str(path), cache_dir=str(tmp_path / "cache"), max_source_length=96)
    tokenizer = load_tokenizer(chat_folder(causal_dirs, tmp_path))
    dataset = CausalLMDataset(tokenizer, "train", None, *CausalLMDataset.lengths(data), data)
    assert "<|wizard|> A spell, number" in tokenizer.decode(dataset[0]["prompt_ids"])
    rows = len(dataset)  # the file's rows less those held out for validation
    said = (
        f"messages of a role the package does not know: {2 * rows} of role 'wizard', {rows} of role 'narrator' in "
        f"the train conversations of {dataset.source_description}. The chat template rendered them as it renders "
        "such a role, and the model reads them before the replies after them (and trains on them with "
        "--completion_only_loss false); give a message one of the roles system, user, assistant, tool, developer, "
        "function, ipython where it is to be read as one."
    )
    assert dataset.notes() == [said]
    with caplog.at_level(logging.WARNING):  # rank 0's loaders say it, once
        build_dataset(tokenizer, FORMAT, "train", 0, data, world_size=1)
    assert caplog.text.count("messages of a role the package does not know") == 1

    known = conversations(tmp_path)  # the control
    assert CausalLMDataset(tokenizer, "train", None, *CausalLMDataset.lengths(known), known).notes() == []

    known_only = "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('no ' + m.role) }}"
    raising = load_tokenizer(chat_folder(causal_dirs, tmp_path / "raising", CHAT_TEMPLATE.replace(
        "{% for m in messages %}", "{% for m in messages %}" + known_only + "{% endif %}")))  # fmt: skip
    with pytest.raises(DataError, match=r"refuses a conversation \(its message of role 'wizard'\?\): no wizard"):
        CausalLMDataset(raising, "train", None, *CausalLMDataset.lengths(data), data)
    dropping = load_tokenizer(chat_folder(causal_dirs, tmp_path / "dropping", CHAT_TEMPLATE.replace(
        "<|{{ m['role'] }}|> {{ m['content'] }}</s>",
        "{% if m.role in ['system', 'user', 'assistant'] %}<|{{ m['role'] }}|> {{ m['content'] }}</s>{% endif %}",
    )))  # fmt: skip
    with pytest.raises(DataError, match="leaves out a message of role 'wizard'"):
        CausalLMDataset(dropping, "train", None, *CausalLMDataset.lengths(data), data)


@pytest.mark.parametrize("trim_offsets", [False, True])
def test_an_earlier_replys_marks_cover_its_whitespace_whatever_the_tokenizers_offsets(causal_dirs, trim_offsets):
    """A code reply's indentation is trained on as its text is: byte-level tokenizers that trim their offsets
    give a whitespace token no characters, and it is still inside the reply."""
    from tokenizers import processors

    from utils.data.cache import _encode_chat_batch

    tokenizer = load_tokenizer(causal_dirs["gpt2"])
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    tokenizer.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
    code = "def f():\n    return  1"
    messages = [{"role": "user", "content": "Code?"}, {"role": "assistant", "content": code},
                {"role": "user", "content": "More."}]  # fmt: skip
    encoded = _encode_chat_batch({"source": [json.dumps(messages)], "target": ["Done."]}, tokenizer, 512, 64)
    ids, marks = encoded["source_ids"][0], encoded["source_replies"][0]
    assert encoded["replies_unmarked"] == [0]
    assert tokenizer.decode([i for i, mark in zip(ids, marks, strict=True) if mark]) == code + "<|endoftext|>"


def test_a_cut_reply_keeps_the_whole_end_of_turn_of_a_chatml_shaped_template(causal_dirs):
    """A template that closes a turn with its marker and a newline (ChatML's `<|im_end|>\n`: Qwen, Phi-3):
    a reply cut by --max_target_length still ends with both, its EOS trained on, the cut taken from the reply's
    text. Control: keeping the last token alone (the newline) loses the marker."""
    from utils.data.cache import _encode_chat_batch

    tokenizer = load_tokenizer(causal_dirs["llama"])
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    batch = {"source": [json.dumps([{"role": "user", "content": "How do I cook rice?"}])],
             "target": ["Rinse it, then boil it for twelve minutes and salt it at the end."]}  # fmt: skip
    whole = _encode_chat_batch(batch, tokenizer, 512, 64)["target_ids"][0]
    closing = tokenizer("</s>\n", add_special_tokens=False)["input_ids"][-2:]
    assert whole[-2:] == closing and closing[0] == tokenizer.eos_token_id and len(whole) > 8
    cut = _encode_chat_batch(batch, tokenizer, 512, 8)["target_ids"][0]
    assert cut == whole[:6] + closing


def rope_precision_worker(rank: int, world_size: int, folder: str) -> dict:
    """A decoder-only model's RoPE frequencies (inv_freq, a computed buffer) after a bf16 forward under each
    backend: their dtype, and whether they equal a fresh model's. The weights compute in bf16 either way."""
    fresh = load_model(folder, dropout_rate=0.0)
    expected = {name: buffer.clone() for name, buffer in fresh.named_buffers() if name.endswith("inv_freq")}
    out = {}
    for version in (1, 2):
        model, parallelism = sharded(load_model(folder, dropout_rate=0.0), _fsdp_config({"fsdp_version": version}),
                            Precision("bfSixteen"))  # fmt: skip
        batch = causal_batch(seed=rank, vocab=fresh.config.vocab_size)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        buffers = {name.replace("_fsdp_wrapped_module.", ""): buffer for name, buffer in model.named_buffers()}
        out[version] = {
            "compute": str(logits.dtype),
            "dtypes": sorted({str(buffers[name].dtype) for name in expected}),
            "as_fresh": all(torch.equal(buffers[name].cpu(), value) for name, value in expected.items()),
        }
    return out


def test_rope_frequencies_stay_fp32_and_exact_under_bf16_mixed_precision(causal_dirs):
    """FSDP1 casts a unit's buffers to the policy's buffer dtype: for a model that computes some (RoPE's
    inv_freq) the policy leaves buffers alone, so the rotary angles come from the fp32 frequencies a fresh model
    has (in bf16 they are off by radians at long positions), while the weights compute in bf16. FSDP2 leaves
    buffers alone by itself."""
    got = run_ranks(rope_precision_worker, causal_dirs["llama"])
    for rank in got:
        for version in (1, 2):
            assert rank[version] == {"compute": "torch.bfloat16", "dtypes": ["torch.float32"], "as_fresh": True}


def unprefixed_rank0_loading_worker(rank: int, world_size: int, folder: str) -> dict:
    """FSDP1's rank-0-only loading (every rank on meta, each unit read by name from the safetensors file) of a
    folder whose file stores names without the model's base prefix, as GPT-2's hub files do (wte.weight, not
    transformer.wte.weight): every rank's full state dict against the model transformers loads from it."""
    config = _fsdp_config({"fsdp_version": 1, "cpu_ram_efficient_loading": True})
    model, parallelism = sharded(
        load_model(folder, on_meta=True, dropout_rate=0.0), config, FP32, weights_source=folder
    )
    return full_state_against(model, load_model(folder, dropout_rate=0.0).state_dict())


def test_rank0_loading_reads_weights_stored_without_the_base_prefix(causal_dirs, tmp_path):
    """GPT-2's hub files name its weights without the base model's prefix (h.0.attn.c_attn.weight, and no
    lm_head: it is tied): FSDP1's rank-0-only loading, reading each unit's tensors by name, finds them there
    and gives every rank the weights transformers loads."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "gpt2-hub-names"
    shutil.copytree(causal_dirs["gpt2"], folder)
    weights = load_file(folder / "model.safetensors")
    assert "transformer.wte.weight" in weights
    renamed = {
        name.removeprefix("transformer."): value for name, value in weights.items() if name != "lm_head.weight"
    }
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(str(folder), dropout_rate=0.0).state_dict()
    original = load_model(causal_dirs["gpt2"], dropout_rate=0.0).state_dict()
    assert all(torch.equal(loaded[name], original[name]) for name in original)  # the same model, other names
    for rank in run_ranks(unprefixed_rank0_loading_worker, str(folder)):
        assert rank == {"keys_equal": True, "max_diff": 0.0}


def causal_compile_worker(rank: int, world_size: int, folder: str, steps: int) -> dict:
    """fp32 per-step losses of a decoder-only model with every decoder layer compiled (aot_eager, through
    utils/fsdp/shard.py's compile_layers), for FSDP1 (original parameters) and FSDP2, on plain rows and on
    packed blocks, and the graphs compiled for each; the unsharded, uncompiled reference's on rank 0."""
    import torch._dynamo

    fresh = load_model(folder, dropout_rate=0.0)
    vocab = fresh.config.vocab_size
    out: dict = {}
    graphs: list = []
    with layers_compiled_by("aot_eager", lambda: graphs.append(1)):
        for packed in (False, True):
            if rank == 0:
                out[("reference", packed)] = reference_run(steps, world_size, copy.deepcopy(fresh), vocab, CAUSAL,
                                                           packed=packed)[0]  # fmt: skip
            for version, overrides in ((1, {"use_orig_params": True}), (2, {"fsdp_version": 2})):
                torch._dynamo.reset()
                graphs.clear()
                model, parallelism = sharded(
                    copy.deepcopy(fresh), _fsdp_config({**overrides, "compile": True}), FP32
                )
                optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
                losses = train_wrapped(
                    model, parallelism, optimizer, rank, world_size, steps, vocab, spec=CAUSAL, packed=packed
                )
                out[(version, packed)] = {"losses": losses, "graphs": len(graphs)}
    return out


@pytest.mark.slow
def test_compiled_decoder_layers_train_like_the_unsharded_model_plain_and_packed(causal_dirs):
    """--compile on a decoder-only model: every LlamaDecoderLayer compiled before sharding (aot_eager: the
    tracing, FSDP's hooks and the backward graph inductor would see) trains as the unsharded, uncompiled model,
    FSDP1 and FSDP2, on plain rows and on packed blocks (position ids restarting per document)."""
    got = run_ranks(causal_compile_worker, causal_dirs["llama"], 4, timeout_s=600)[0]
    for packed in (False, True):
        reference = got[("reference", packed)]
        for version in (1, 2):
            losses = got[(version, packed)]["losses"]
            assert got[(version, packed)]["graphs"] > 0, (version, packed)  # the layers ran compiled
            assert len(losses) == len(reference) == 4
            for step, (loss, want) in enumerate(zip(losses, reference, strict=True)):
                assert loss == pytest.approx(want, rel=1e-5), (version, packed, step, loss, want)


def test_summarize_refuses_a_decoder_only_model_with_one_message(causal_dirs, capsys):
    from scripts import summarize

    assert summarize.main(["--model", causal_dirs["gpt2"], "--input", "/dev/null"]) == 1
    assert "is a decoder-only model: this script summarises with encoder-decoders" in capsys.readouterr().err


def test_a_tokenizer_with_tokens_added_past_the_embedding_is_refused_with_the_resize(causal_dirs, tmp_path):
    """Chat markers added to the tokenizer without resizing the model's embedding: refused at start, naming
    the fix, before any data is read (their ids would index past the embedding)."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "grown"
    shutil.copytree(causal_dirs["llama"], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    tokenizer.save_pretrained(folder)
    with pytest.raises(ConfigError, match=r"ids 1000 to 1001 would index past .*resize_token_embeddings"):
        load_tokenizer(str(folder))


def test_the_edges_of_decoder_only_data_each_said_once(causal_dirs, tmp_path):
    """GPT-2's EOS (also its unknown token) is not counted as text it cannot read; --pad_to_max_length pads a
    documents block to --max_seq_len; whole texts refuse a score they cannot have; a CSV `messages` column
    (texts, no conversations) is refused naming the flags to use; so is a --source_prefix of whole texts (it
    went past --max_seq_len, untrained)."""
    from configs.errors import DataError
    from configs.evaluation import EvalConfig
    from configs.validate import check_data_source

    gpt2 = load_tokenizer(causal_dirs["gpt2"])
    assert gpt2.unk_token_id == gpt2.eos_token_id
    data = text_data(tmp_path, packing=True, pad_to_max_length=True)
    lengths = CausalLMDataset.lengths(data)
    assert CausalLMDataset(gpt2, "train", None, *lengths, data).unknown_tokens["target"] == 0
    block = PackedCausalDataset(gpt2, "train", None, *lengths, data)[0]
    assert {len(tensor) for tensor in block.values()} == {96} and block["attention_mask"].sum() < 96
    for evaluation in (EvalConfig(evaluate_only=True), EvalConfig(metric_for_best="rougeL")):
        with pytest.raises(ConfigError, match="whole texts have no reference"):
            check_data_source(DataConfig(dataset_text_field="content"), evaluation)
    with pytest.raises(ConfigError, match="whole texts, which have no prompt for --source_prefix 'Recipe: '"):
        check_data_source(DataConfig(dataset_text_field="content", source_prefix="Recipe: "))
    csv = tmp_path / "chats.csv"
    csv.write_text("messages\nhello there\n")
    with pytest.raises(DataError, match="column 'messages' holds a str, not a conversation"):
        CausalLMDataset(gpt2, "train", None, 32, 32, DataConfig(train_file=str(csv)))


def test_a_model_saved_in_bf16_loads_in_fp32_and_so_does_its_skeleton(causal_dirs, tmp_path):
    """Llama's published configs say bf16 (Llama 2's fp16), which transformers 5 loads in: the package loads
    fp32 master weights (and builds the skeleton a resume fills in fp32), --mixed_precision computing in bf16."""
    import shutil

    folder = tmp_path / "bf16"
    shutil.copytree(causal_dirs["llama"], folder)
    AutoModelForCausalLM.from_pretrained(folder).to(torch.bfloat16).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(folder).dtype == torch.bfloat16  # what transformers 5 does
    for on_meta in (False, True):
        model = load_model(str(folder), on_meta=on_meta)
        assert {p.dtype for p in model.parameters()} == {torch.float32}, on_meta
