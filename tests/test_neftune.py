"""NEFTune (--neftune_noise_alpha; utils/model/neftune.py): the noise is transformers' own hook's to the bit,
in training only (the validation loss and generation are those of the model without it); T5's encoder and
decoder inputs both get it (HF's hook on the shared module adds nothing in transformers 5); LoRA's base model
gets it; FSDP1 (flat parameters) and FSDP2 noise the sharded model as the unsharded one (2 gloo ranks); a run
resumed from its checkpoint draws the same noise (2 pooled ranks, with --packing_strategy bfd). Tiny random
Llama (scripts/make_tiny_family.py) and the embedded tiny T5; every check beside its control without noise."""

import copy
import json
import shutil

import pytest
import torch
from torch import nn
from transformers.integrations.neftune import activate_neftune, neftune_post_forward_hook

from configs.lora import LoraConfig
from configs.paths import EMBEDDED_MODEL_DIR, REPO_ROOT
from scripts.compare_step_losses import step_losses
from scripts.make_tiny_family import make
from tests.dist_harness import one_process_group, run_ranks
from tests.dist_workers import CPU, FP32, _fsdp_config, causal_batch, make_batch, sharded
from tests.launch import pooled
from tests.reference_run import checkpoint_dir, complete_checkpoint_steps
from utils.eval.generation import generate
from utils.model.loading import load_model
from utils.model.lora import apply_lora
from utils.model.neftune import add_embedding_noise, noisy_embeddings
from utils.spec import CAUSAL, SEQ2SEQ
from utils.train.step import validate

ALPHA = 5.0


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("neftune") / "llama"
    make("llama", str(folder))
    return str(folder)


def mean_loss(spec, model, batch) -> torch.Tensor:
    losses, labels = spec.token_losses(model, batch)
    return losses.sum() / (labels != -100).sum()


def test_the_noise_is_transformers_hooks_to_the_bit_and_none_in_evaluation():
    """For the same generator state, the hook's output equals transformers' neftune_post_forward_hook's, bit for
    bit (fp32 and bf16, several padded lengths); its noise fills [-b, b], b = alpha / sqrt(length x width), and
    shrinks with the padded length. In evaluation the output is the embedding's own (the control: in training it
    is not)."""
    embedding = nn.Embedding(50, 24)
    embedding.neftune_noise_alpha = ALPHA  # what transformers' hook reads
    for length in (7, 100, 1024):
        for dtype in (torch.bfloat16, torch.float32):
            clean = embedding(torch.randint(0, 50, (3, length))).detach().to(dtype)
            torch.manual_seed(length)
            ours = noisy_embeddings(ALPHA, embedding, (), clean)
            torch.manual_seed(length)
            assert torch.equal(ours, neftune_post_forward_hook(embedding, (), clean)), (length, dtype)
        noise = ours - clean  # fp32's
        bound = ALPHA / (length * 24) ** 0.5
        assert 0.99 * bound < noise.abs().max() <= bound * 1.01, (noise.abs().max(), bound)
        assert abs(noise.mean()) < 0.05 * bound
    embedding.eval()
    assert noisy_embeddings(ALPHA, embedding, (), clean) is clean


def test_a_decoder_only_model_trains_on_noisy_embeddings_but_validates_and_generates_as_without(llama):
    """Tiny Llama, the same weights with and without the hook: the training loss differs (the control), the
    package's validation loss and greedy generation are identical; with LoRA the hook sits on the base model's
    embedding (what HF's activate_neftune hooks) and the training loss differs from LoRA's without."""
    clean = load_model(llama, dropout_rate=0.0)
    noisy = copy.deepcopy(clean)
    assert add_embedding_noise(noisy, ALPHA, CAUSAL) == ["model.embed_tokens"]
    batch = causal_batch(0, vocab=clean.config.vocab_size)
    for model in (clean, noisy):
        model.train()
    assert abs(mean_loss(CAUSAL, noisy, batch) - mean_loss(CAUSAL, clean, batch)) > 1e-3

    progress = type("NoBar", (), {"update": lambda self, n: None})()
    with one_process_group():
        val_losses = [validate(model, [batch], device=CPU, num_real_samples=3, progress=progress, spec=CAUSAL)
                      for model in (clean, noisy)]  # fmt: skip
    assert val_losses[0] == val_losses[1]
    prompts = {"input_ids": batch["input_ids"][:, :5], "attention_mask": torch.ones(3, 5, dtype=torch.long)}
    with torch.no_grad():
        outputs = [model.generate(**prompts, max_new_tokens=8, do_sample=False, pad_token_id=0)
                   for model in (clean.eval(), noisy.eval())]  # fmt: skip
    assert torch.equal(*outputs)

    torch.manual_seed(0)
    lora_clean = apply_lora(load_model(llama, dropout_rate=0.0), LoraConfig(peft="lora"), llama, CAUSAL)
    lora_noisy = copy.deepcopy(lora_clean)
    assert add_embedding_noise(lora_noisy, ALPHA, CAUSAL) == ["base_model.model.model.embed_tokens"]
    hf_hooked = copy.deepcopy(lora_clean)
    activate_neftune(hf_hooked, ALPHA)
    assert hf_hooked.base_model.model.model.embed_tokens._forward_hooks  # the module HF hooks is ours
    torch.manual_seed(1)
    noisy_loss = mean_loss(CAUSAL, lora_noisy.train(), batch)
    torch.manual_seed(1)
    assert torch.equal(noisy_loss, mean_loss(CAUSAL, hf_hooked.train(), batch))  # HF's noise, to the bit
    assert abs(noisy_loss - mean_loss(CAUSAL, lora_clean.train(), batch)) > 1e-3


def test_t5s_encoder_and_decoder_inputs_are_both_noised_where_hfs_hook_adds_nothing():
    """The embedded tiny T5: the hooks sit on the encoder's and the decoder's embedding modules (tied to the
    shared one), and each stack's input gets noise of its own padded length's bound. transformers 5 never calls
    the shared module, so HF's hook on it (activate_neftune) leaves the training loss as without noise: the
    control this package's hooks differ from."""
    clean = load_model(str(EMBEDDED_MODEL_DIR), dropout_rate=0.0).train()
    noisy, hf_hooked = copy.deepcopy(clean), copy.deepcopy(clean)
    assert add_embedding_noise(noisy, ALPHA, SEQ2SEQ) == ["encoder.embed_tokens", "decoder.embed_tokens"]
    activate_neftune(hf_hooked, ALPHA)
    seen = {}
    for stack in ("encoder", "decoder"):  # what each stack's embedding module reads and returns, noise included
        module = getattr(noisy, stack).embed_tokens
        module.register_forward_hook(lambda module, inputs, output, stack=stack: seen.update({stack: (
            inputs[0], output)}))  # fmt: skip
    batch = make_batch(0, src_len=12, tgt_len=7)
    with torch.no_grad():
        loss, clean_loss = mean_loss(SEQ2SEQ, noisy, batch), mean_loss(SEQ2SEQ, clean, batch)
        assert abs(loss - clean_loss) > 1e-3
        assert torch.equal(mean_loss(SEQ2SEQ, hf_hooked, batch), clean_loss)  # HF's hook: no noise on T5
        for stack, length in (("encoder", 12), ("decoder", 7)):
            ids, output = seen[stack]
            noise = output - clean.shared(ids)
            bound = ALPHA / (length * clean.config.d_model) ** 0.5
            assert 0.9 * bound < noise.abs().max() <= bound * 1.001, (stack, noise.abs().max(), bound)


def fsdp_noise_worker(rank: int, world_size: int, llama: str) -> dict:
    """Per backend and model (tiny Llama, the embedded T5): this rank's batch through the sharded model with the
    hook, in training, against the unsharded model with the hook from the same generator state, and against the
    unsharded model without it (the control); in evaluation, the sharded model's loss and generation against
    the model's without noise."""
    out = {}
    for name, folder, spec in (("llama", llama, CAUSAL), ("t5", str(EMBEDDED_MODEL_DIR), SEQ2SEQ)):
        for version in (1, 2):
            clean = load_model(folder, dropout_rate=0.0)
            noisy = copy.deepcopy(clean)
            add_embedding_noise(noisy, ALPHA, spec)
            reference = copy.deepcopy(noisy)  # the unsharded model, hook and all
            model, parallelism = sharded(noisy, _fsdp_config({"fsdp_version": version}), FP32)
            vocab = clean.config.vocab_size
            batch = (causal_batch if spec is CAUSAL else make_batch)(100 + rank, vocab=vocab)
            losses = {}
            with torch.no_grad():
                for key, each in (("sharded", model), ("unsharded", reference), ("without", clean)):
                    torch.manual_seed(7 + rank)
                    losses[key] = mean_loss(spec, each.train(), batch).item()
                eval_losses = [mean_loss(spec, each.eval(), batch).item() for each in (model, clean)]
                if spec is CAUSAL:  # each row's first 4 tokens (never padding) as its prompt
                    prompts = {"input_ids": batch["input_ids"][:, :4], "attention_mask": torch.ones(3, 4).long()}
                else:
                    prompts = {"input_ids": batch["source_ids"], "attention_mask": batch["source_mask"]}
                settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
                generated = generate(model, parallelism, prompts, settings)
                clean_generated = clean.generate(**prompts, **settings)
            same_generation = torch.equal(generated, clean_generated)
            out[f"{name} FSDP{version}"] = {**losses, "eval": eval_losses, "generation_equal": same_generation}
    return out


@pytest.mark.slow  # 15 s: both backends and both kinds of model on a spawned group
def test_fsdp1_and_fsdp2_noise_the_sharded_model_as_the_unsharded_one(llama):
    for rank_results in run_ranks(fsdp_noise_worker, llama, timeout_s=300):
        for case, result in rank_results.items():
            assert result["sharded"] == pytest.approx(result["unsharded"], rel=1e-5), case
            assert abs(result["sharded"] - result["without"]) > 1e-3, case  # the control: noise reached it
            assert result["eval"][0] == pytest.approx(result["eval"][1], rel=1e-5), case
            assert result["generation_equal"], case


@pytest.mark.slow
def test_a_resumed_run_draws_the_noise_the_uninterrupted_one_drew(llama, tmp_path):
    """2 pooled ranks, tiny Llama on the embedded chat sample, --packing_strategy bfd, --neftune_noise_alpha 5:
    the run resumed from its step-3 checkpoint has the uninterrupted run's per-step losses from step 4 to its
    end (the noise's generator is in each rank's checkpoint), which differ from a run without the noise."""
    flags = ["--model_name", llama, "--dataset_name", str(REPO_ROOT / "data" / "code_chat"),
             "--dataset_text_field", "content", "--packing", "true", "--packing_strategy", "bfd",
             "--max_seq_len", "256", "--num_train_samples", "48", "--num_val_samples", "8", "--epochs", "1",
             "--batch_size_training", "2", "--mixed_precision", "false", "--save_every_n_steps", "3",
             "--keep_last_n", "4", "--log_every_n_steps", "1", "--lr", "1e-3"]  # fmt: skip
    reference, plain = tmp_path / "reference", tmp_path / "plain"
    run = pooled([*flags, "--neftune_noise_alpha", str(ALPHA), "--output_dir", str(reference)])
    assert run.returncode == 0, run.describe()
    assert "NEFTune: noise of alpha 5 on the input embeddings while training (model.embed_tokens)" in run.output
    assert "rows packed (bfd) into" in run.output, run.describe()
    losses = step_losses(str(reference))
    assert len(losses) >= 5 and 3 in complete_checkpoint_steps(reference), (losses, run.describe())
    run = pooled([*flags, "--output_dir", str(plain)])
    assert run.returncode == 0, run.describe()
    assert all(abs(loss - losses[step]) > 1e-4 for step, loss in step_losses(str(plain)).items())

    resumed = shutil.copytree(reference, tmp_path / "resumed")
    run = pooled(["--output_dir", str(resumed), "--resume", str(checkpoint_dir(resumed, 3))])
    assert run.returncode == 0, run.describe()
    assert json.loads((resumed / "config.json").read_text())["recipe_config"]["neftune_noise_alpha"] == ALPHA
    again = step_losses(str(resumed))
    assert sorted(again) == sorted(losses)
    for step in range(4, max(losses) + 1):
        assert again[step] == losses[step], (step, again[step], losses[step])
