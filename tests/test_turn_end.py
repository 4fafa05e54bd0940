"""--eos_token: where a decoder-only model's turns end, and generation with them (utils/eval/generation.py:
turn_end). The text as one of the tokenizer's own tokens (an id among the stops) or as a stop string; refused
where the tokenizer cannot write it, and for an encoder-decoder; the export's generation_config.json and the
evaluation's generation stop there (a tiny random model made to write a fixed text); a text-format run's
closing line says how generation from its model stops, and a chat run's export keeps its chat template."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

import causal_lm_dataset
from configs.data import DataConfig
from configs.errors import ConfigError
from configs.evaluation import EvalConfig
from configs.fsdp import FSDPConfig
from configs.paths import EMBEDDED_MODEL_DIR, REPO_ROOT
from configs.training import TrainConfig
from scripts.make_tiny_family import make
from tests.dist_harness import one_process_group
from tests.launch import pooled
from tests.test_sources import ONE_CPU_RANK
from utils.checkpoint.hf_export import run_generation_config
from utils.data.loaders import build_loaders
from utils.eval import evaluator as evaluator_module
from utils.eval.evaluator import Evaluator
from utils.eval.generation import NO_TURN_END, TurnEnd, generate, turn_end
from utils.fsdp.parallelism import Unwrapped
from utils.model.loading import load_model, load_model_config
from utils.spec import CAUSAL, SEQ2SEQ

MARKER = "<|endoftext|>"  # the Llama 2 guide's end of a turn: several tokens of Llama's vocabulary
REPLY = " Use a copy." + MARKER + " <|prompter|> And the next turn?" + MARKER  # what the model is made to write


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("turn_end") / "llama"
    make("llama", str(folder))
    return str(folder)


def test_the_turn_end_is_a_token_of_the_tokenizers_own_or_a_stop_string_and_refused_where_it_cannot_be_written(
    llama,
):
    tokenizer = AutoTokenizer.from_pretrained(llama)
    assert turn_end(tokenizer, "") is NO_TURN_END  # the control: the EOS alone
    assert turn_end(tokenizer, MARKER) == TurnEnd(strings=(MARKER,))  # 9 tokens here
    assert len(tokenizer(MARKER, add_special_tokens=False).input_ids) > 1
    assert turn_end(tokenizer, "</s>") == TurnEnd(ids=(tokenizer.eos_token_id,))
    tokenizer.add_tokens(["<|im_end|>"], special_tokens=True)  # a chat model's end of turn: one token
    assert turn_end(tokenizer, "<|im_end|>") == TurnEnd(ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    t5 = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)  # no '<' nor '|' in its vocabulary
    refused = (
        r"--eos_token '<\|endoftext\|>' does not encode to tokens of the tokenizer of 't5': it reads as .*<unk>"
    )
    with pytest.raises(ConfigError, match=refused + ".* its EOS '</s>'"):
        turn_end(t5, MARKER, "t5")
    config, _ = load_model_config(str(EMBEDDED_MODEL_DIR))
    with pytest.raises(ConfigError, match="--eos_token '</s>' names the text that ends a decoder-only model's"):
        SEQ2SEQ.check_data(DataConfig(eos_token="</s>"), config)


class Writes(LogitsProcessor):
    """Makes generate write `ids` after prompts of `start` tokens, whatever the model's logits: a tiny random
    model writes no end of turn of its own."""

    def __init__(self, ids: list[int], start: int):
        self.ids, self.start = ids, start

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        written = input_ids.shape[1] - self.start
        forced = torch.full_like(scores, -math.inf)
        forced[:, self.ids[min(written, len(self.ids) - 1)]] = 0
        return forced


def through_marker(tokenizer, ids: list[int]) -> int:
    """How many of `ids` it takes for their text to hold MARKER."""
    return next(k for k in range(1, len(ids) + 1) if MARKER in tokenizer.decode(ids[:k]))


def test_the_exports_generation_config_stops_generate_at_the_turn_end(llama):
    """run_generation_config (hf_model/'s generation_config.json) with --eos_token: generate stops right after
    the marker, where the same model without it (the control) writes on into the next turn; without the
    tokenizer generate refuses the stop string, as the closing line says."""
    tokenizer = AutoTokenizer.from_pretrained(llama)
    model = AutoModelForCausalLM.from_pretrained(llama).eval()
    reply = tokenizer(REPLY, add_special_tokens=False).input_ids
    prompt = tokenizer("<|prompter|> How do I copy a list?" + MARKER + " <|assistant|>", return_tensors="pt")
    written = {}
    for case, eos_token in (("turn end", MARKER), ("control", "")):
        data = DataConfig(dataset_text_field="content", eos_token=eos_token)
        model.config.task_specific_params = {CAUSAL.params_key: CAUSAL.saved_params(data, EvalConfig(), "plain")}
        generation_config = run_generation_config(model.config, CAUSAL, tokenizer)
        generation_config.max_new_tokens = len(reply)
        processors = LogitsProcessorList([Writes(reply, prompt.input_ids.shape[1])])
        with torch.no_grad():
            out = model.generate(**prompt, generation_config=generation_config, tokenizer=tokenizer,
                                 logits_processor=processors)  # fmt: skip
        written[case] = (generation_config, out[0, prompt.input_ids.shape[1] :].tolist())
    generation_config, ids = written["turn end"]
    assert generation_config.stop_strings == [MARKER] and generation_config.eos_token_id == tokenizer.eos_token_id
    assert ids == reply[: through_marker(tokenizer, reply)] and tokenizer.decode(ids).endswith(MARKER)
    control_config, control_ids = written["control"]
    assert control_config.stop_strings is None and control_ids == reply  # on into the next turn
    with pytest.raises(ValueError, match="pass the model's tokenizer"):
        model.generate(**prompt, generation_config=generation_config)


@pytest.mark.slow  # 9 s: the data cache, and generation twice
def test_evaluation_stops_its_generation_at_the_turn_end(llama, tmp_path, monkeypatch):
    """The evaluator (prompt/completion rows of a decoder-only model) hands generate the stop string and the
    tokenizer: each prediction is the reply before the marker, its gen_len the tokens through the marker (not
    the padding after it, which is the EOS token here); the control runs to max_new_tokens."""
    tokenizer = AutoTokenizer.from_pretrained(llama)
    tokenizer.pad_token = tokenizer.eos_token  # as load_tokenizer does for Llama
    model = load_model(llama).eval()
    reply = tokenizer(REPLY, add_special_tokens=False).input_ids
    data = DataConfig(num_train_samples=4, num_val_samples=2, cache_dir=str(tmp_path / "cache"))
    loaders = build_loaders(tokenizer=tokenizer, data_format=causal_lm_dataset.FORMAT, data=data,
                            train=TrainConfig(), evaluation=EvalConfig(),
                            info=ONE_CPU_RANK)  # fmt: skip
    asked = []

    def writing(model, parallelism, prompts, settings):
        asked.append(settings)
        processors = LogitsProcessorList([Writes(reply, prompts["input_ids"].shape[1])])
        return generate(model, parallelism, prompts, {**settings, "logits_processor": processors})

    monkeypatch.setattr(evaluator_module, "generate", writing)
    rows, unwrapped = {}, Unwrapped(FSDPConfig(single_rank_fsdp=False))
    for case, turn in (("turn end", turn_end(tokenizer, MARKER)), ("control", NO_TURN_END)):
        evaluator = Evaluator(eval_set=loaders.evaluation, parallelism=unwrapped, spec=CAUSAL,
                              generation={"max_new_tokens": len(reply), "num_beams": 1}, metric="rouge",
                              predictions_file=lambda split, step: str(tmp_path / f"{split}-{step}"),
                              info=ONE_CPU_RANK, turn_end=turn)  # fmt: skip
        with one_process_group():
            rows[case] = evaluator._generate_share(model, None)
    assert asked[0]["stop_strings"] == [MARKER] and asked[0]["tokenizer"] is tokenizer
    assert "stop_strings" not in asked[-1]
    assert [row["prediction"] for row in rows["turn end"]] == ["Use a copy."] * 2
    assert [row["gen_len"] for row in rows["turn end"]] == [through_marker(tokenizer, reply)] * 2
    assert [row["prediction"] for row in rows["control"]] == [tokenizer.decode(reply).strip()] * 2
    assert [row["gen_len"] for row in rows["control"]] == [len(reply)] * 2


TEXT_RUN = ("--dataset_name", str(REPO_ROOT / "data" / "code_chat"), "--dataset_text_field", "content",
            "--max_seq_len", "128", "--max_steps", "2", "--num_train_samples", "8", "--num_val_samples", "4",
            "--mixed_precision", "false", "--keep_last_n", "0")  # fmt: skip


@pytest.mark.slow  # three runs of two ranks
def test_a_text_format_runs_closing_line_says_how_generation_stops_and_a_chat_export_keeps_its_template(
    llama, tmp_path
):
    """The guide's text format (the chat sample's content, turns ended by <|endoftext|>) with --eos_token: the
    closing line names the EOS and the stop string and how generate reads it, and hf_model/'s
    generation_config.json holds it; without (the control), the closing line says generation runs on into the
    next turn. A chat run's export carries its tokenizer's chat template, and its closing line the EOS."""
    from tests.test_causal import CHAT_TEMPLATE, chat_folder, conversations

    lines = {}
    for case, extra in (("turn end", ("--eos_token", MARKER)), ("control", ())):
        output_dir = tmp_path / case.replace(" ", "_")
        run = pooled(["--model_name", llama, *TEXT_RUN, "--cache_dir", str(tmp_path / "cache"),
                      "--output_dir", str(output_dir), *extra])  # fmt: skip
        assert run.returncode == 0, run.describe()
        lines[case] = next(line for line in run.stdout.splitlines() if "run finished in" in line)
        saved = json.loads((output_dir / "hf_model" / "generation_config.json").read_text())
        assert saved.get("stop_strings") == ([MARKER] if extra else None), saved
        print(lines[case])
    assert lines["turn end"].endswith(
        "generation from the model stops at '</s>', and at the text '<|endoftext|>' (stop_strings in "
        "generation_config.json, which generate() reads through its tokenizer: give it tokenizer=tokenizer, a "
        "pipeline call tokenizer=pipe.tokenizer)"
    )
    assert lines["control"].endswith(
        "generation from the model stops at '</s>' alone: where the texts end a turn with another text, it writes "
        "on into the next turn (--eos_token names that text: the Llama 2 guide's <|endoftext|>)"
    )

    chat = tmp_path / "chat"
    chats = conversations(tmp_path)
    run = pooled(["--model_name", chat_folder({"llama": llama}, tmp_path), "--train_file", chats.train_file,
                  "--max_steps", "1", "--run_validation", "false", "--mixed_precision", "false", "--keep_last_n",
                  "0", "--cache_dir", str(tmp_path / "cache"), "--output_dir", str(chat)])  # fmt: skip
    assert run.returncode == 0, run.describe()
    assert AutoTokenizer.from_pretrained(chat / "hf_model").chat_template == CHAT_TEMPLATE
    closing = next(line for line in run.stdout.splitlines() if "run finished in" in line)
    assert closing.endswith("generation from the model stops at '</s>'"), closing
