"""--loss_chunk_tokens (utils/loss.py): the cross-entropy computed chunk by chunk inside the output head gives
the plain loss's per-token losses and every parameter's gradient, in fp32 on CPU, for the embedded tiny T5
(tied head, decoder output scaled before it) and a tiny Llama (unpacked rows, and rows packed as documents
and bfd pack them), with LoRA and with NEFTune's noise (the same draws on both sides), at a chunk size that
divides no batch's token count; generation is the plain head's; the float32 log-probabilities are no longer
kept for backward and the loss's peak is lower (scripts/loss_memory.py, the plain loss's the control); the
hardware FLOPs count the head's second forward; what it cannot do is refused; FSDP1 and FSDP2 on 2 gloo ranks
train as with the plain loss; and a 2-rank run trains and validates as the plain one (slow)."""

import copy

import pytest
import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from causal_lm_dataset import best_fit_decreasing, causal_collate, rows_in_order
from configs.errors import ConfigError
from configs.lora import LoraConfig
from configs.paths import EMBEDDED_MODEL_DIR, REPO_ROOT
from configs.validate import check_settings
from scripts.make_tiny_family import LLAMA_SHAPE, make
from tests.dist_harness import run_ranks
from tests.dist_workers import CPU, FP32, VOCAB, _fsdp_config, causal_batch, make_batch, sharded
from tests.launch import pooled
from tests.reference_run import read_records
from tests.run_configs import run_config
from utils.data.loaders import IGNORED
from utils.loss import ChunkedLossHead, chunk_the_loss
from utils.model.loading import load_model
from utils.model.lora import apply_lora
from utils.model.neftune import add_embedding_noise
from utils.observe.flops import CausalFlops, Seq2SeqFlops
from utils.observe.memory import SavedTensorCounter
from utils.spec import CAUSAL, SEQ2SEQ
from utils.train.step import LOSS_SUM, StepSettings, train_step

CHUNK = 5  # divides none of the batches' token counts (checked): the last chunk is a short one
LOSS_TOLERANCE = 1e-6  # per-token losses (3-11), relative: measured 1.3e-7 at most (9.5e-7 absolute)
GRADIENT_TOLERANCE = 1e-5  # of each parameter's largest gradient: measured 9.3e-7 at most


def tiny_llama(tied: bool = False, vocab: int = VOCAB) -> LlamaForCausalLM:
    """make_tiny_family's Llama shape, randomly initialised (seeded)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE, vocab_size=vocab, tie_word_embeddings=tied))


def packed_batch(strategy: str, seed: int, block: int = 24) -> dict:
    """Random documents packed into blocks as --packing_strategy documents or bfd places them (the package's
    own placement), each document's positions restarting and its first token no target, collated as a run's."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (8,), generator=gen).tolist()
    documents = [torch.randint(3, VOCAB, (length,), generator=gen) for length in lengths]
    placed = best_fit_decreasing if strategy == "bfd" else rows_in_order
    blocks = []
    for rows in placed(lengths, block):
        ids = torch.cat([documents[row] for row in rows])
        labels = torch.cat([documents[row].clone().index_fill_(0, torch.tensor([0]), IGNORED) for row in rows])
        positions = torch.cat([torch.arange(lengths[row]) for row in rows])
        blocks.append({"input_ids": ids, "labels": labels, "position_ids": positions,
                       "attention_mask": torch.ones_like(ids)})  # fmt: skip
    return causal_collate(blocks, pad_token_id=0)


CASES = {  # rows -> (model, spec, batch)
    "t5": lambda: (load_model(str(EMBEDDED_MODEL_DIR), dropout_rate=0.0), SEQ2SEQ, make_batch(0, tgt_len=9)),
    "llama unpacked": lambda: (tiny_llama(), CAUSAL, causal_batch(0)),
    "llama-tied unpacked": lambda: (tiny_llama(tied=True), CAUSAL, causal_batch(1)),
    "llama packed documents": lambda: (tiny_llama(), CAUSAL, packed_batch("documents", 2)),
    "llama packed bfd": lambda: (tiny_llama(), CAUSAL, packed_batch("bfd", 2)),
}


def with_extra(model, spec, extra: str):
    """`model` as is, with LoRA adapters (their B matrices made non-zero, so that every adapter has a gradient),
    or with NEFTune's noise hooked on."""
    if extra == "lora":
        model = apply_lora(model, LoraConfig(peft="lora"), "base", spec)
        torch.manual_seed(1)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.data.normal_(0, 0.1)
    elif extra == "neftune":
        add_embedding_noise(model, 5.0, spec)
    return model


def losses_and_gradients(model, spec, batch) -> tuple[torch.Tensor, dict]:
    """The per-token losses of one training forward (random draws from seed 7) and every gradient of their sum."""
    torch.manual_seed(7)
    token_losses, _ = spec.token_losses(model.train(), batch)
    token_losses.sum().backward()
    return token_losses.detach(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("extra", ["", "lora", "neftune"])
@pytest.mark.parametrize("rows", list(CASES))
def test_losses_and_gradients_equal_the_plain_ones(rows, extra):
    """The same model twice, the head of one replaced: the same state-dict names and ties; on one batch of
    `rows` (the same random draws: NEFTune's noise, LoRA's dropout), per-token losses and every trained
    parameter's gradient as the plain loss's (the control: the stock path)."""
    model, spec, batch = CASES[rows]()
    plain = with_extra(model, spec, extra)
    chunked = copy.deepcopy(plain)
    chunk_the_loss(chunked, CHUNK)
    head = chunked.get_output_embeddings()
    assert isinstance(head, ChunkedLossHead)
    assert list(chunked.state_dict()) == list(plain.state_dict())  # the same names: checkpoints, exports
    tied = plain.get_output_embeddings().weight is plain.get_input_embeddings().weight
    assert (head.weight is chunked.get_input_embeddings().weight) == tied
    positions = (batch["target_ids"] if spec is SEQ2SEQ else batch["input_ids"]).numel()
    assert positions % CHUNK, positions

    expected, expected_gradients = losses_and_gradients(plain, spec, batch)
    losses, gradients = losses_and_gradients(chunked, spec, batch)
    torch.testing.assert_close(losses, expected, rtol=LOSS_TOLERANCE, atol=LOSS_TOLERANCE)
    assert sorted(gradients) == sorted(expected_gradients)
    for name, gradient in gradients.items():
        scale = expected_gradients[name].abs().max()
        assert scale > 0, name  # every trained parameter has a gradient to compare
        assert (gradient - expected_gradients[name]).abs().max() <= GRADIENT_TOLERANCE * scale, name


def test_generation_is_the_plain_heads():
    """Greedy generation (T5 from its sources, Llama from prompts) writes the same tokens with the head replaced:
    outside a loss it is the plain linear layer."""
    for model, spec, batch in (CASES["t5"](), CASES["llama unpacked"]()):
        chunked = copy.deepcopy(model)
        chunk_the_loss(chunked, CHUNK)
        prompts = spec.prompts(batch) if spec is SEQ2SEQ else {
            "input_ids": batch["input_ids"][:, :4], "attention_mask": torch.ones(3, 4, dtype=torch.long)
        }  # fmt: skip
        settings = {"max_new_tokens": 8, "do_sample": False, "num_beams": 1, "pad_token_id": 0}
        with torch.no_grad():
            expected = model.eval().generate(**prompts, **settings)
            assert torch.equal(chunked.eval().generate(**prompts, **settings), expected)


def test_the_hardware_flops_count_the_heads_second_forward():
    """With the head's recompute, hardware FLOPs add 2 x V x d_model per counted token (target tokens of an
    encoder-decoder, real tokens of a decoder-only model); model FLOPs (MFU) stay."""
    t5, llama = CASES["t5"]()[0], tiny_llama()
    for counter, batch, tokens, config in (
        (Seq2SeqFlops.from_config(t5.config), make_batch(0), "target_mask", t5.config),
        (CausalFlops.from_config(llama.config), causal_batch(0), "attention_mask", llama.config),
    ):
        head = config.vocab_size * (getattr(config, "d_model", None) or config.hidden_size)
        for recompute in (False, True):
            model, hardware = counter.training(batch, recompute)
            chunked_model, chunked_hardware = counter.training(batch, recompute, recompute_head=True)
            assert chunked_model == model
            assert chunked_hardware - hardware == 2 * head * batch[tokens].sum()


def test_what_the_chunked_loss_cannot_do_is_refused():
    """LoRA on the head (before anything loads), a model that changes its logits after its head (BART's bias,
    Gemma 2's soft-capping: found when the head is replaced), and one that does so unannounced (found at its
    first loss); the control, a tiny Llama, is accepted."""
    config = run_config(loss_chunk_tokens=64, peft="lora", lora_target_modules="q_proj,lm_head")
    with pytest.raises(ConfigError, match="leave lm_head out of --lora_target_modules, or give --loss_chunk_tok"):
        check_settings(config, 2, "cpu")
    check_settings(run_config(loss_chunk_tokens=64, peft="lora", lora_target_modules="q_proj,v_proj"), 2, "cpu")

    bart = BartForConditionalGeneration(BartConfig(vocab_size=100, d_model=16, encoder_layers=1, decoder_layers=1,
                                                   encoder_ffn_dim=16, decoder_ffn_dim=16))  # fmt: skip
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=100, hidden_size=16, intermediate_size=16,
                                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                           head_dim=8))  # fmt: skip
    for model, change in ((bart, "final_logits_bias"), (gemma, "final_logit_softcapping")):
        with pytest.raises(ConfigError, match=f"changes its logits after its output head \\({change}\\)"):
            chunk_the_loss(model, CHUNK)

    model, spec, batch = CASES["llama unpacked"]()
    chunk_the_loss(model, CHUNK)
    spec.token_losses(model, batch)  # the control
    forward = model.forward
    model.forward = lambda **inputs: type(out := forward(**inputs))(logits=out.logits * 2)
    with pytest.raises(ConfigError, match="changes its output head's logits before it returns them"):
        spec.token_losses(model, batch)


def fsdp_worker(rank: int, world_size: int) -> dict:
    """Per backend: one training step (SGD, lr 1, so that the step's change is the gradient) of the embedded T5
    and of a tiny Llama on packed bfd rows, this rank's batch, with and without the chunked loss: the losses,
    the bytes kept for backward, the trained models' largest difference (rank 0), and what the head is in the
    wrapped model. FSDP1 with an untied Llama's head a unit of its own (size_based), FSDP2 with activation
    checkpointing of the blocks."""
    out = {}
    for backend, fsdp in (
        ("FSDP1", {"wrap_policy": "size_based", "min_num_params": 20_000}),
        ("FSDP2", {"fsdp_version": 2, "fsdp_activation_checkpointing": True}),
    ):
        for name, (model, spec, _) in (("t5", CASES["t5"]()), ("llama", CASES["llama packed bfd"]())):
            batch = make_batch(10 + rank) if spec is SEQ2SEQ else packed_batch("bfd", 10 + rank)
            result = {}
            for chunk in (0, CHUNK):
                each = copy.deepcopy(model)
                if chunk:
                    chunk_the_loss(each, chunk)
                wrapped, parallelism = sharded(each, _fsdp_config(fsdp), FP32)
                optimizer = torch.optim.SGD(wrapped.parameters(), lr=1.0)
                settings = StepSettings(parallelism, spec=spec, saved_counter=SavedTensorCounter())
                stats = train_step(wrapped, batch, optimizer, None, world_size, settings)
                state = parallelism.full_state_dict(wrapped, CPU)  # rank 0's alone
                head = type(wrapped.get_output_embeddings()).__name__
                result[chunk] = {"loss": stats[LOSS_SUM].item(), "saved": settings.saved_counter.bytes,
                                 "state": state, "head": head}  # fmt: skip
            plain, chunked = result[0], result[CHUNK]
            differences = [
                (chunked["state"][key] - value).abs().max().item() for key, value in plain["state"].items()
            ]
            out[f"{name} {backend}"] = {
                "losses": (plain["loss"], chunked["loss"]), "saved": (plain["saved"], chunked["saved"]),
                "weights": max(differences, default=0.0), "compared": len(differences),
                "names_equal": sorted(chunked["state"]) == sorted(plain["state"]), "head": chunked["head"],
                "logits_bytes": batch["target_ids" if spec is SEQ2SEQ else "input_ids"].numel() * VOCAB * 4,
            }  # fmt: skip
    return out


def test_fsdp1_and_fsdp2_train_as_with_the_plain_loss():
    """2 gloo ranks: under both backends the chunked loss's step has the plain loss's losses and leaves the
    same weights (the weights' change is the gradient), with the head's weight gathered in its unit's forward
    (the root's, or under FSDP1's size_based policy the untied head's own) and again in backward, where each
    chunk is recomputed; and it keeps no float32 log-probabilities for backward (the plain loss does: the
    control)."""
    results = run_ranks(fsdp_worker, timeout_s=120)
    for rank_results in results:
        for case, result in rank_results.items():
            plain, chunked = result["losses"]
            assert chunked == pytest.approx(plain, rel=1e-6), case
            assert result["weights"] < 1e-6 and result["names_equal"], (case, result)
            assert result["saved"][0] - result["saved"][1] >= result["logits_bytes"], (case, result)
            own_unit = case == "llama FSDP1"
            assert result["head"] == ("FullyShardedDataParallel" if own_unit else "ChunkedLossHead"), case
    assert all(result["compared"] for result in results[0].values())  # rank 0 compared the weights


@pytest.mark.slow  # two runs of T5_training.py on 2 pooled ranks (about 15 s each): the flag's wiring
def test_a_run_with_the_chunked_loss_trains_and_validates_as_the_plain_one(tmp_path):
    """A tiny Llama on the embedded chat sample, packed bfd, 2 ranks: with --loss_chunk_tokens 100 the run says
    so, and its per-step and validation losses are the plain run's; its hardware FLOPs (the head's second
    forward) exceed the plain run's for the same model FLOPs."""
    make("llama", str(tmp_path / "llama"))
    flags = ["--model_name", str(tmp_path / "llama"), "--dataset_name", str(REPO_ROOT / "data" / "code_chat"),
             "--dataset_text_field", "content", "--packing", "true", "--packing_strategy", "bfd",
             "--max_seq_len", "256", "--num_train_samples", "32", "--num_val_samples", "8", "--epochs", "1",
             "--batch_size_training", "2", "--mixed_precision", "false", "--log_every_n_steps", "1",
             "--save_model", "false", "--keep_last_n", "0"]  # fmt: skip
    records = {}
    for chunk in (0, 100):
        output_dir = tmp_path / f"chunk{chunk}"
        run = pooled([*flags, "--loss_chunk_tokens", str(chunk), "--output_dir", str(output_dir)])
        assert run.returncode == 0, run.describe()
        said = "the loss: cross-entropy per chunk of 100 tokens inside the output head" in run.output
        assert said == bool(chunk), run.describe()
        records[chunk] = read_records(output_dir)
    steps = {chunk: [r for r in rows if r["type"] == "step"] for chunk, rows in records.items()}
    assert len(steps[0]) == len(steps[100]) >= 3
    for plain, chunked in zip(steps[0], steps[100], strict=True):
        assert chunked["loss"] == pytest.approx(plain["loss"], rel=1e-5), (plain, chunked)
        assert chunked["hardware_tflops_per_s"] / chunked["model_tflops_per_s"] > (
            plain["hardware_tflops_per_s"] / plain["model_tflops_per_s"]
        )
    validation = {chunk: [r["val_loss"] for r in rows if "val_loss" in r] for chunk, rows in records.items()}
    assert validation[0] and validation[100] == pytest.approx(validation[0], rel=1e-5)


def test_the_chunked_loss_keeps_no_log_probabilities_for_backward_and_peaks_lower():
    """scripts/loss_memory.py at a small scale (a tiny Llama, 4,000 tokens of vocabulary, 256 tokens): with
    chunks of 64 tokens the same loss; what is kept for backward loses exactly the tokens x vocabulary float32
    log-probabilities (and a 4-byte scalar); the plain loss's peak holds at least three tensors of that size
    (logits, log-probabilities, their gradient: the control), the chunked one's well under it (measured: 14.1
    and 6.3 MiB)."""
    from scripts import loss_memory

    plain, chunked = loss_memory.main(["--vocab", "4000", "--tokens", "256", "--chunks", "0", "64"])
    logits = 256 * 4000 * 4
    assert chunked["loss_sum"] == pytest.approx(plain["loss_sum"], rel=1e-6)
    assert 0 <= plain["saved_for_backward"] - chunked["saved_for_backward"] - logits < 64
    assert plain["peak_allocated"] >= 3 * logits
    assert plain["peak_allocated"] - chunked["peak_allocated"] >= 1.5 * logits
