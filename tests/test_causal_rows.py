"""A decoder-only row within --max_seq_len (issue 66): prompt and completion bounded together, not by an
encoder-decoder's --max_source_length and --max_target_length; a row too long loses its prompt's start, then its
reply's end, keeping its end of turn; the cuts counted in the start line; a run started before resumes with the
bounds it was cached with (the encoding its checkpoint records). And --max_seq_len within the model's positions:
refused past a table of learned positions (GPT-2, OPT), warned past rotary ones, NONE capped at them. Tiny
random Llama and GPT-2 (scripts/make_tiny_family.py), each behaviour beside its control."""

import dataclasses
import json
import logging
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, OPTConfig, T5Config

from causal_lm_dataset import CausalLMDataset, causal_collate
from configs.data import DataConfig
from configs.errors import ConfigError
from scripts.make_tiny_family import make
from tests.dist_harness import one_process_group
from tests.launch import pooled, program_tracebacks
from tests.reference_run import checkpoint_dir, read_records
from utils.base import layout
from utils.checkpoint.inputs import recorded_encoding
from utils.checkpoint.start import StartPoint
from utils.data.cache import (
    CAUSAL_ENCODING,
    CAUSAL_ENCODING_BY_LENGTHS,
    SEQ2SEQ_ENCODING,
    _encode_chat_batch,
    resumed_encoding,
    split_rows,
)
from utils.data.loaders import IGNORED
from utils.data.shared_cache import complete_folders
from utils.model.loading import load_tokenizer
from utils.spec import CAUSAL, SEQ2SEQ

WORDS = (
    "rinse the rice boil water add salt stir gently cover and wait until it is soft then drain it serve warm with "
    "butter or oil keep the lid on for ten minutes more before you lift it"
).split()
# A template whose assistant turns HF's apply_chat_template can mask ({% generation %}), closed ChatML-style by a
# marker and a newline: a cut reply must keep both.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>\n{% generation %}{{ m['content'] }}"
    "</s>\n{% endgeneration %}{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, str]:
    """The tiny Llama (512 positions), GPT-2 (512), and the Llama with a chat template and 2048 positions (its
    rotary positions are computed: only its config says how many it was trained on)."""
    root = tmp_path_factory.mktemp("rows")
    folders = {family: str(root / family) for family in ("llama", "gpt2")}
    for family, folder in folders.items():
        make(family, folder)
    chat = root / "chat-llama"
    shutil.copytree(folders["llama"], chat)
    for name, changes in (("config.json", {"max_position_embeddings": 2048}),
                          ("tokenizer_config.json", {"chat_template": CHAT_TEMPLATE})):  # fmt: skip
        path = chat / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return {**folders, "chat": str(chat)}


def text_of(tokenizer, tokens: int, seed: int) -> str:
    """Words of the sample's kind, at least `tokens` tokens long for `tokenizer` (counted word by word, as a
    byte-level BPE reads them apart, then checked whole)."""
    each = {word: len(tokenizer(f" {word}", add_special_tokens=False).input_ids) for word in set(WORDS)}
    words, index = [], seed
    while sum(each[word] for word in words) < tokens or (
        len(tokenizer(" ".join(words), add_special_tokens=False).input_ids) < tokens
    ):
        words.append(WORDS[index % len(WORDS)])
        index = index * 7 + 3
    return " ".join(words)


def prompt_rows(tmp_path, tokenizer, rows: int = 4, completion_tokens: int = 204) -> DataConfig:
    """Prompt/completion rows (TRL's format): prompts of about 40 tokens, completions of `completion_tokens`."""
    path = tmp_path / "pairs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for row in range(rows):
            prompt = f"Question {row}: {text_of(tokenizer, 40, row)}\nAnswer:"
            f.write(
                json.dumps({"source": prompt, "target": text_of(tokenizer, completion_tokens, row + 50)}) + "\n"
            )
    return DataConfig(train_file=str(path), validation_file=str(path), cache_dir=str(tmp_path / "cache"))


def conversation(tokenizer, turns: int, reply_tokens: int, seed: int) -> list[dict]:
    messages = [{"role": "system", "content": "Answer in full."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"And step {turn + 1} of recipe {seed}?"})
        messages.append({"role": "assistant", "content": text_of(tokenizer, reply_tokens, seed * 10 + turn)})
    return messages


def chat_rows(tmp_path, tokenizer, train_turns: int = 4, reply_tokens: int = 300, **settings) -> DataConfig:
    """Conversations (a messages column) with replies of `reply_tokens`: train's of `train_turns` turns (longer
    than 1024 tokens at 4), validation's of 2 (about 650 tokens)."""
    for split, turns, rows in (("train", train_turns, 8), ("validation", 2, 4)):
        with open(tmp_path / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for row in range(rows):
                f.write(json.dumps({"messages": conversation(tokenizer, turns, reply_tokens, row)}) + "\n")
    return DataConfig(train_file=str(tmp_path / "train.jsonl"), validation_file=str(tmp_path / "validation.jsonl"),
                      cache_dir=str(tmp_path / "cache"), **settings)  # fmt: skip


def dataset_of(tokenizer, data: DataConfig, split: str = "train", encoding=CAUSAL_ENCODING) -> CausalLMDataset:
    """The split as a run reads it, tokenised as `encoding` (a resumed run's may be the older one)."""
    lengths = CausalLMDataset.lengths(data, encoding)
    rows = split_rows(tokenizer, split, None, *lengths, data, encoding=encoding)
    return CausalLMDataset(tokenizer, split, None, *lengths, data, rows=rows)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_completion_is_bounded_by_max_seq_len_not_by_max_target_length(tiny, family, tmp_path):
    """A 204-token completion with --max_seq_len 1024: cached whole, its EOS after it, and the start line says
    no row was cut. Control: the encoding before rows were bounded (a run started then) cuts it to
    --max_target_length's 150 tokens, and said nothing of it."""
    tokenizer = load_tokenizer(tiny[family])
    data = dataclasses.replace(prompt_rows(tmp_path, tokenizer), max_seq_len=1024)
    dataset = dataset_of(tokenizer, data)
    for index in range(len(dataset)):
        input_ids, labels, prompt_length = dataset.sequence(index)
        completion = input_ids[prompt_length:].tolist()
        whole = tokenizer(dataset.reference(index), add_special_tokens=False).input_ids
        assert completion == [*whole, tokenizer.eos_token_id] and len(whole) >= 204
        assert labels[prompt_length:].tolist() == completion and (labels[:prompt_length] == IGNORED).all()
    assert dataset.cut_note() == "0 rows cut to 1024 tokens: 0.0% of their tokens dropped"

    before = dataset_of(tokenizer, data, encoding=CAUSAL_ENCODING_BY_LENGTHS)
    completions = [len(before.sequence(index)[0]) - before.sequence(index)[2] for index in range(len(before))]
    assert completions == [150] * len(before) and before.cut_note() == ""


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_row_too_long_loses_its_prompts_start_then_its_replys_end_and_keeps_its_eos(tiny, family, tmp_path):
    """--max_seq_len 200 on rows of a 40-token prompt and a 204-token completion: the prompt loses its start
    down to its last token (and Llama's <s>, which stays first), then the completion its end; the EOS stays
    last, and every row is 200 tokens. The start line counts the rows and their dropped share, which the
    control (--max_seq_len 1024, above) keeps whole. At 240 only the prompts are cut."""
    tokenizer = load_tokenizer(tiny[family])
    pairs = prompt_rows(tmp_path, tokenizer)
    whole = dataset_of(tokenizer, dataclasses.replace(pairs, max_seq_len=1024))
    for length, replies_cut in ((240, 0), (200, 4)):
        data = dataclasses.replace(pairs, max_seq_len=length, cache_dir=str(tmp_path / f"cache-{length}"))
        dataset = dataset_of(tokenizer, data)
        total, kept = 0, 0
        for index in range(len(dataset)):
            full_ids, _, full_prompt = whole.sequence(index)
            input_ids, labels, prompt_length = dataset.sequence(index)
            prompt, full = input_ids[:prompt_length].tolist(), full_ids[:full_prompt].tolist()
            completion, full_completion = input_ids[prompt_length:].tolist(), full_ids[full_prompt:].tolist()
            assert len(input_ids) == min(length, len(full_ids))
            start = 1 if family == "llama" else 0  # <s> first, kept
            assert prompt[:start] == full[:start] and prompt[start:] == full[len(full) - len(prompt) + start :]
            assert completion == full_completion[: len(completion) - 1] + [tokenizer.eos_token_id]
            if length == 200:
                assert len(prompt) == start + 1  # the prompt down to its last token (the cue's end)
            else:
                assert completion == full_completion
            assert (labels[prompt_length:] != IGNORED).all()
            total, kept = total + len(full_ids), kept + len(input_ids)
        share = 100 * (total - kept) / total
        assert dataset.cut_note() == (
            f"4 rows cut to {length} tokens, 4 at the prompt's start and {replies_cut} at the reply's end: "
            f"{share:.1f}% of their tokens dropped"
        )


def test_a_conversation_too_long_keeps_its_latest_turns_and_a_cut_reply_its_end_of_turn(tiny, tmp_path):
    """Conversations of three 300-token replies (over 1000 tokens) at --max_seq_len 700: each loses its earliest
    turns (the system message first), its last reply whole; the earlier replies still in it stay trained on,
    and no token of a turn cut away. At 250 the reply too is cut, keeping the template's end of turn whole
    (`</s>` and the newline). Control: the encoding before rows were bounded cuts the last reply at 150 tokens
    whatever --max_seq_len says, and keeps the prompt's last 512."""
    tokenizer = load_tokenizer(tiny["chat"])
    data = chat_rows(tmp_path, tokenizer, max_seq_len=2048)
    whole = dataset_of(tokenizer, data)
    closing = tokenizer("</s>\n", add_special_tokens=False).input_ids[-2:]
    for length in (700, 250):
        bounded = dataset_of(
            tokenizer, dataclasses.replace(data, max_seq_len=length, cache_dir=str(tmp_path / f"cache-{length}"))
        )
        for index in range(len(bounded)):
            full_ids, full_labels, full_prompt = whole.sequence(index)
            input_ids, labels, prompt_length = bounded.sequence(index)
            assert len(full_ids) > 1000 and len(input_ids) == length
            if length == 700:  # the latest turns, as they were, with their labels: the earlier replies trained
                assert torch.equal(input_ids, full_ids[-length:]) and torch.equal(labels, full_labels[-length:])
                assert prompt_length < full_prompt
            else:  # the prompt down to its last token, the reply's start and its end of turn
                completion = input_ids[prompt_length:].tolist()
                assert prompt_length == 1 and input_ids[0] == full_ids[full_prompt - 1]
                assert completion == full_ids[full_prompt : full_prompt + length - 3].tolist() + closing
                assert completion[-2] == tokenizer.eos_token_id and (labels[1:] != IGNORED).all()

    before = dataset_of(tokenizer, data, encoding=CAUSAL_ENCODING_BY_LENGTHS)
    for index in range(len(before)):
        input_ids, _, prompt_length = before.sequence(index)
        assert (prompt_length, len(input_ids) - prompt_length) == (512, 150)  # 2048 or not
        assert input_ids[-2:].tolist() == closing


def test_a_replys_cut_keeps_a_chatml_end_of_turn_at_the_batch_level(tiny):
    """The encoder itself (_encode_chat_batch) with a row length: what --max_target_length's cut kept before
    (the reply's start and the template's `</s>` and newline), now from --max_seq_len, and the cuts counted.
    Control: the same row within its length is whole, nothing counted."""
    tokenizer = load_tokenizer(tiny["chat"])
    batch = {"source": [json.dumps([{"role": "user", "content": "How do I cook rice?"}])],
             "target": ["Rinse it, then boil it for twelve minutes and salt it at the end."]}  # fmt: skip
    whole = _encode_chat_batch(batch, tokenizer, 2048, 2048, row_length=2048)
    prompt, reply = whole["source_ids"][0], whole["target_ids"][0]
    assert (whole["prompt_cut"], whole["reply_cut"]) == ([0], [0]) and len(reply) > 8
    cut = _encode_chat_batch(batch, tokenizer, 2048, 2048, row_length=8)
    closing = tokenizer("</s>\n", add_special_tokens=False).input_ids[-2:]
    assert cut["source_ids"][0] == prompt[-1:] and cut["target_ids"][0] == reply[:5] + closing
    assert cut["prompt_cut"] == [len(prompt) - 1] and cut["reply_cut"] == [len(reply) - 7]


def hf_assistant_loss(model, tokenizer, conversations: list[list[dict]]) -> tuple[float, int]:
    """A plain HF model's mean next-token loss over every assistant token of the conversations, as
    apply_chat_template's assistant mask ({% generation %}) marks them, and the count of those tokens."""
    total, count = 0.0, 0
    for messages in conversations:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = torch.tensor([rendered["input_ids"]])
        labels = torch.where(torch.tensor([rendered["assistant_masks"]]) == 1, ids, IGNORED)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        losses = F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=IGNORED, reduction="sum")
        total, count = total + losses.item(), count + int((labels[0, 1:] != IGNORED).sum())
    return total / count, count


def test_the_validation_loss_on_chat_rows_is_hfs_over_every_assistant_token(tiny, tmp_path):
    """Two conversations of two 300-token replies at --max_seq_len 1024, fp32 on the CPU: the package's validation
    loss (utils/train/step.py: validate, on causal_collate's batches) equals a plain HF model's mean loss over
    the assistant tokens that apply_chat_template(return_assistant_tokens_mask=True) marks, over as many tokens.
    Control: the encoding before rows were bounded cuts each last reply at 150 tokens, and its loss is over
    fewer tokens and differs."""
    from utils.train.step import validate

    tokenizer = load_tokenizer(tiny["chat"])
    data = chat_rows(tmp_path, tokenizer, max_seq_len=1024)
    model = AutoModelForCausalLM.from_pretrained(tiny["chat"], dtype=torch.float32).eval()
    lines = (tmp_path / "validation.jsonl").read_text(encoding="utf-8").splitlines()[:2]
    conversations = [json.loads(line)["messages"] for line in lines]
    expected, tokens = hf_assistant_loss(model, tokenizer, conversations)
    progress = type("NoBar", (), {"update": lambda self, n: None})()

    def package_loss(dataset) -> tuple[float, int]:
        batch = causal_collate([dataset[0], dataset[1]], tokenizer.pad_token_id)  # one padded to the other
        with one_process_group():
            loss = validate(model, [batch], device=torch.device("cpu"), num_real_samples=2, progress=progress,
                            spec=CAUSAL)  # fmt: skip
        return loss, int(CAUSAL.trained_tokens(batch))

    dataset = dataset_of(tokenizer, data, "validation")
    assert [dataset[i]["input_ids"].tolist() for i in range(2)] == [
        tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"] for messages in conversations
    ]
    loss, trained = package_loss(dataset)
    assert trained == tokens and tokens > 2 * 600
    assert loss == pytest.approx(expected, rel=1e-6, abs=0), (loss, expected)

    before, before_trained = package_loss(dataset_of(tokenizer, data, "validation", CAUSAL_ENCODING_BY_LENGTHS))
    assert before_trained < tokens - 2 * 140 and abs(before - expected) > 1e-4, (before, expected)


def test_max_seq_len_within_the_models_positions(caplog):
    """Given past a table of learned positions (GPT-2's n_positions, OPT's embed_positions with its offset of 2):
    refused, naming the field and the fix. Past rotary positions (Llama) without rope_scaling: taken, with one
    warning; with rope_scaling: taken silently. NONE: 1024, or the model's positions where it has fewer, said
    once. A resume keeps its run's value unchecked (a run started before the check, on GPT-2's 512 positions
    with the 1024 it recorded). Controls: a value within the positions, and an encoder-decoder, are taken as
    they are."""
    gpt2, llama = (
        GPT2Config(n_positions=512, n_layer=1),
        LlamaConfig(max_position_embeddings=512, num_hidden_layers=1),
    )
    opt = OPTConfig(max_position_embeddings=512, num_hidden_layers=1)
    for config, field in ((gpt2, "gpt2's n_positions"), (opt, "opt's max_position_embeddings")):
        with pytest.raises(
            ConfigError, match=rf"--max_seq_len 1024 is past the model's 512 positions \({field}\), which it holds"
        ):
            CAUSAL.fitted_data(DataConfig(max_seq_len=1024), config, resumed=False)
        assert CAUSAL.fitted_data(DataConfig(max_seq_len=512), config, resumed=False).max_seq_len == 512
    assert CAUSAL.fitted_data(DataConfig(max_seq_len=1024), gpt2, resumed=True).max_seq_len == 1024
    with caplog.at_level(logging.INFO, logger="t5_fsdp"):
        caplog.clear()
        assert CAUSAL.fitted_data(DataConfig(max_seq_len=4096), llama, resumed=False).max_seq_len == 4096
        warned = [record for record in caplog.records if record.levelno == logging.WARNING]
        assert len(warned) == 1 and "--max_seq_len 4096 is past the 512 positions" in warned[0].getMessage()
        assert "rope_scaling" in warned[0].getMessage()
        caplog.clear()
        stretched = {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}
        scaled = LlamaConfig(max_position_embeddings=512, num_hidden_layers=1, rope_parameters=stretched)
        assert CAUSAL.fitted_data(DataConfig(max_seq_len=4096), scaled, resumed=False).max_seq_len == 4096
        assert CAUSAL.fitted_data(DataConfig(max_seq_len=512), llama, resumed=False).max_seq_len == 512
        assert caplog.records == []
        for config in (gpt2, llama):
            assert CAUSAL.fitted_data(DataConfig(), config, resumed=False).max_seq_len == 512
        said = [record.getMessage() for record in caplog.records]
        assert said == [
            "--max_seq_len 512: the model's positions (gpt2's n_positions), fewer than the default 1024",
            "--max_seq_len 512: the model's positions (llama's max_position_embeddings), fewer than the default "
            "1024",
        ]
        caplog.clear()
        roomy = LlamaConfig(max_position_embeddings=4096, num_hidden_layers=1)
        assert CAUSAL.fitted_data(DataConfig(), roomy, resumed=False).max_seq_len == 1024 and caplog.records == []
    assert SEQ2SEQ.fitted_data(DataConfig(), T5Config(), resumed=False) == DataConfig()


def test_an_encoder_decoders_lengths_given_to_a_decoder_only_model_are_said_not_to_bound_its_rows(caplog):
    """--max_source_length and --max_target_length set for a decoder-only model: one line each saying what
    bounds its rows instead; the control, their defaults, says nothing."""
    llama = LlamaConfig(max_position_embeddings=4096, num_hidden_layers=1)
    with caplog.at_level(logging.INFO, logger="t5_fsdp"):
        CAUSAL.fitted_data(DataConfig(max_seq_len=2048), llama, resumed=False)
        assert caplog.records == []
        CAUSAL.fitted_data(
            DataConfig(max_seq_len=2048, max_source_length=384, max_target_length=128), llama, False
        )
    assert [record.getMessage() for record in caplog.records] == [
        "--max_source_length 384 does not cut a decoder-only model's prompts: its rows are bounded by "
        "--max_seq_len 2048, prompt and completion together",
        "--max_target_length 128 does not cut a decoder-only model's completions (its rows are bounded by "
        "--max_seq_len 2048, prompt and completion together): it is only the length generation writes, "
        "--max_new_tokens unset",
    ]


def test_a_resumed_run_reads_its_rows_with_the_encoding_its_checkpoint_recorded(tiny, tmp_path):
    """A checkpoint's recorded encoding is the resume's; one that recorded none (written before issue 66) is
    read with the encoding of then, whose token cache key is what it was (an old run's cache is found and read
    as it is); an encoding this version does not have is refused. Controls: a new run's, and an
    encoder-decoder's, which has had one encoding all along."""
    folder = tmp_path / "checkpoints" / "step_00000004"
    folder.mkdir(parents=True)
    state = {"format_version": layout.FORMAT_VERSION, "checkpoint_type": layout.FULL, "has_optimizer": True,
             "world_size": 2, "progress": {"epoch": 1, "samples_consumed": 32, "global_step": 4}}  # fmt: skip
    start = StartPoint(str(folder), layout.FULL)
    for inputs, recorded in ((None, None), ({"data": {}}, None), ({"encoding": "2-causal-rows"}, "2-causal-rows")):
        (folder / layout.STATE_FILE).write_text(json.dumps({**state, **({"inputs": inputs} if inputs else {})}))
        assert recorded_encoding(start) == recorded
    assert resumed_encoding(None, CAUSAL_ENCODING) is CAUSAL_ENCODING_BY_LENGTHS
    assert resumed_encoding("2-causal-rows", CAUSAL_ENCODING) is CAUSAL_ENCODING
    assert resumed_encoding("2-causal", CAUSAL_ENCODING) is CAUSAL_ENCODING_BY_LENGTHS
    assert resumed_encoding(None, SEQ2SEQ_ENCODING) is resumed_encoding(2, SEQ2SEQ_ENCODING) is SEQ2SEQ_ENCODING
    for unknown in ("9-causal", 2):
        with pytest.raises(ConfigError, match="does not have for a causal model"):
            resumed_encoding(unknown, CAUSAL_ENCODING)

    tokenizer = load_tokenizer(tiny["llama"])
    data = prompt_rows(tmp_path, tokenizer)
    before, now = (dataset_of(tokenizer, data, encoding=encoding) for encoding in (CAUSAL_ENCODING_BY_LENGTHS,
                                                                                 CAUSAL_ENCODING))  # fmt: skip
    folders = complete_folders(tmp_path / "cache", "tokens")
    keys = {manifest["key"]["encoding"]: manifest["key"] for _, manifest in folders}
    new_key = keys["2-causal-rows"]
    assert keys["2-causal"] == {  # the key a decoder-only run's token cache had before rows were bounded
        "text_cache": new_key["text_cache"], "split": "train", "tokenizer": new_key["tokenizer"],
        "truncation_side": "right", "source_prefix": "", "input_length": 512, "output_length": 150,
        "encoding": "2-causal", "special_ids": [tokenizer.bos_token_id, tokenizer.eos_token_id],
        "rows": len(before),
    }  # fmt: skip
    assert {**new_key, "input_length": 512, "output_length": 150, "encoding": "2-causal"} == {
        **keys["2-causal"],
        "row_length": 1024,
    }  # the new one: another encoding, the row's length, both lengths the row's
    assert before.sequence(0)[0].tolist() != now.sequence(0)[0].tolist()  # the completion cut at 150, or not


def step_losses(output_dir) -> dict[int, float]:
    """Each step's loss in metrics.jsonl, the last one written for it (a rollback trains its steps again)."""
    return {record["step"]: record["loss"] for record in read_records(output_dir) if record["type"] == "step"}


def one_line(run, phrase: str) -> str:
    lines = [line for line in run.output.splitlines() if phrase in line]
    assert len(lines) == 1, f"{phrase!r} printed {len(lines)} times, expected once\n{run.describe()}"
    return lines[0]


@pytest.mark.slow  # three runs of 2 pooled ranks, 8 conversations of 1024 tokens each
def test_a_run_counts_its_cuts_at_start_and_its_resume_keeps_the_encoding_its_checkpoint_recorded(tiny, tmp_path):
    """A 1024-token run on conversations of 300-token replies, 2 ranks: the start line counts the train rows cut
    (4 turns each: their earliest turns) and their dropped share, the validation rows whole; its checkpoints
    record the encoding. Resumed from epoch 1's checkpoint it trains epoch 2 as it did (the control); from the
    same checkpoint recording no encoding (a run started before rows were bounded) it reads the rows as such a
    run cached them (each reply cut at 150 tokens, nothing counted), other losses, and its checkpoints keep
    saying so."""
    tokenizer = load_tokenizer(tiny["chat"])
    data = chat_rows(tmp_path, tokenizer)
    whole = dataset_of(tokenizer, dataclasses.replace(data, max_seq_len=2048, cache_dir=str(tmp_path / "whole")))
    total = sum(len(whole.sequence(index)[0]) for index in range(len(whole)))
    assert all(len(whole.sequence(index)[0]) > 1024 for index in range(len(whole)))
    out = tmp_path / "run"
    args = ["--model_name", tiny["chat"], "--train_file", data.train_file, "--validation_file",
            data.validation_file, "--max_seq_len", "1024", "--epochs", "2", "--batch_size_training", "2",
            "--val_batch_size", "2", "--eval_rouge", "false", "--mixed_precision", "false"]  # fmt: skip
    run = pooled([*args, "--output_dir", str(out)])
    assert run.returncode == 0, run.describe()
    assert one_line(run, "rows: train").endswith(
        f"rows: train 8 (all, 8 rows cut to 1024 tokens, 8 at the prompt's start and 0 at the reply's end: "
        f"{100 * (total - 8 * 1024) / total:.1f}% of their tokens dropped), validation 4 (all, 0 rows cut to 1024 "
        "tokens: 0.0% of their tokens dropped)"
    )
    losses = step_losses(out)
    assert sorted(losses) == [1, 2, 3, 4]

    def state(folder, step: int) -> dict:
        return json.loads((checkpoint_dir(folder, step) / layout.STATE_FILE).read_text())

    assert state(out, 2)["inputs"]["encoding"] == state(out, 4)["inputs"]["encoding"] == "2-causal-rows"
    for name, recorded in (("same", True), ("before", False)):
        folder = tmp_path / name
        shutil.copytree(out, folder)
        shutil.rmtree(checkpoint_dir(folder, 4))
        if not recorded:
            saved = state(folder, 2)
            del saved["inputs"]["encoding"]
            (checkpoint_dir(folder, 2) / layout.STATE_FILE).write_text(json.dumps(saved))
        resumed = pooled(["--output_dir", str(folder), "--resume", "true"])
        assert resumed.returncode == 0, resumed.describe()
        again = step_losses(folder)
        if recorded:
            assert [again[3], again[4]] == [losses[3], losses[4]]
            assert "rows: train 8 (all, 8 rows cut to 1024 tokens" in resumed.output
        else:
            assert abs(again[3] - losses[3]) > 1e-3 and abs(again[4] - losses[4]) > 1e-3
            assert "rows: train 8 (all), validation 4 (all)" in resumed.output, resumed.describe()
        assert state(folder, 4)["inputs"]["encoding"] == ("2-causal-rows" if recorded else "2-causal")


@pytest.mark.slow  # two runs of 2 pooled ranks
def test_max_seq_len_past_the_positions_is_refused_for_gpt2_and_warned_once_for_llama(tiny, tmp_path):
    """--max_seq_len 1024 on the tiny GPT-2 (512 learned positions): both ranks end with one message before the
    data is cached. On the tiny Llama (512 rotary positions): the run trains, with one warning line. Control: the
    Llama run's default, said once as the model's 512 positions."""
    args = ["--num_train_samples", "8", "--num_val_samples", "4", "--max_steps", "1", "--eval_rouge", "false",
            "--cache_dir", str(tmp_path / "cache")]  # fmt: skip
    refused = pooled(["--model_name", tiny["gpt2"], *args, "--max_seq_len", "1024", "--output_dir",
                      str(tmp_path / "gpt2")], timeout=120)  # fmt: skip
    assert refused.returncode == 2, refused.describe()
    line = one_line(refused, "--max_seq_len 1024 is past the model's 512 positions (gpt2's n_positions)")
    assert "Give --max_seq_len 512 or less (or leave it out: 512)" in line
    assert not program_tracebacks(refused.output) and not (tmp_path / "cache").exists()
    warned = pooled(["--model_name", tiny["llama"], *args, "--max_seq_len", "1024", "--output_dir",
                     str(tmp_path / "llama")])  # fmt: skip
    assert warned.returncode == 0, warned.describe()
    assert "WARNING" in one_line(warned, "--max_seq_len 1024 is past the 512 positions the model was trained on")
    default = pooled(["--model_name", tiny["llama"], *args, "--output_dir", str(tmp_path / "default")])
    assert default.returncode == 0, default.describe()
    one_line(default, "--max_seq_len 512: the model's positions (llama's max_position_embeddings)")
    assert "past the" not in default.output
    record = json.loads((tmp_path / "default" / layout.CONFIG_FILE).read_text())
    assert record["data_config"]["max_seq_len"] == 512  # what a resume keeps


def test_generation_reads_a_prompts_end_where_the_models_learned_positions_hold_no_more():
    """A row's prompt may fill --max_seq_len, the model's positions; generation writes --max_new_tokens after it.
    On learned positions (GPT-2) the prompt keeps its last positions - max_new_tokens tokens, and generate writes
    its tokens after the same end of the prompt (the control: the whole prompt runs past the table and fails).
    Rotary positions (Llama) have no such end: the prompt is read whole."""
    from utils.eval.evaluator import prompts_within

    torch.manual_seed(0)
    config = GPT2Config(n_positions=64, n_embd=32, n_layer=1, n_head=2, vocab_size=100)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompts = {"input_ids": torch.randint(1, 100, (2, 60)), "attention_mask": torch.ones(2, 60, dtype=torch.long)}
    prompts["attention_mask"][1, :20] = 0  # left padding: the second row's prompt is 40 tokens
    room = CAUSAL.prompt_room(config, max_new_tokens=10)
    assert room == 54
    with pytest.raises(IndexError):
        model.generate(**prompts, max_new_tokens=10, do_sample=False, pad_token_id=0)
    fitted, cut = prompts_within(prompts, room)
    assert cut == 1 and fitted["input_ids"].shape == (2, 54)
    assert torch.equal(fitted["input_ids"], prompts["input_ids"][:, -54:])
    outputs = model.generate(**fitted, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert outputs.shape == (2, 64)
    assert prompts_within(prompts, None) == (prompts, 0)
    llama = LlamaConfig(max_position_embeddings=64, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                        num_attention_heads=2, num_key_value_heads=2, vocab_size=100)  # fmt: skip
    assert CAUSAL.prompt_room(llama, max_new_tokens=10) is None
