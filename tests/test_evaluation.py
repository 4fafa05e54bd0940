"""ROUGE under FSDP: generation on every rank equals plain single-process `generate`, scores equal
rouge-score's, every article is scored once; and, through torchrun, the eval records, predictions files,
best-by-ROUGE model, --evaluate_only and scripts/summarize.py."""

import dataclasses
import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from peft import PeftModel
from rouge_score import rouge_scorer
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, T5ForConditionalGeneration

from configs.data import DataConfig
from configs.evaluation import EvalConfig
from configs.fsdp import FSDPConfig
from configs.lora import LoraConfig
from configs.paths import EMBEDDED_DATA_DIR, EMBEDDED_MODEL_DIR, REPO_ROOT
from scripts.summarize import main as summarize_main
from summarization_dataset import FORMAT
from tests.dist_harness import one_process_group, run_ranks
from tests.dist_workers import CPU, FP32, _fsdp_config, make_batch, sharded, tiny_t5
from tests.launch import pooled
from tests.test_sources import ONE_CPU_RANK, one_rank_loaders
from utils.base import layout
from utils.base.log import get_logger
from utils.checkpoint.hf_export import run_generation_config, write_adapter_folder
from utils.data.cache import load_wikihow
from utils.eval.evaluator import generated_lengths
from utils.eval.generation import TurnEnd, generation_stops
from utils.eval.rouge import ROUGE_KEYS, rouge_scores
from utils.eval.scores import mean_scores
from utils.fsdp.parallelism import Unwrapped
from utils.model.lora import adapter_base, apply_lora
from utils.spec import SEQ2SEQ

N_SAMPLES = 7  # uneven over 2 ranks: 4 and 3 real samples, one padding repeat
EVAL_KEYS = {"type", "epoch", "step", "split", *ROUGE_KEYS, "gen_len", "num_samples", "seconds", "baselines"}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ------------------------------------------------------------------------- 2-rank gloo group, direct


def generation_worker(rank: int, world_size: int, output_dir: str, n_samples: int, batch_size: int) -> dict:
    """ROUGE evaluation of one fp32 model under FSDP1 and FSDP2 (greedy and 2 beams), plus direct generate
    calls whose lengths differ by rank. Rank 0 also returns plain single-process generate on the same model."""
    from transformers import T5Tokenizer

    from configs.training import TrainConfig
    from utils.data.loaders import build_eval_set
    from utils.distributed.process_group import DistInfo
    from utils.eval.evaluator import Evaluator
    from utils.eval.generation import generate

    info = DistInfo(rank, rank, world_size, CPU, "gloo")
    tokenizer = T5Tokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR))
    data, train = DataConfig(), TrainConfig(val_batch_size=batch_size)
    evaluation = EvalConfig(eval_num_samples=n_samples, max_new_tokens=12)
    eval_set = build_eval_set(tokenizer, FORMAT, data, train, evaluation, info, "validation")

    def settings_with(beams: int) -> dict:
        return SEQ2SEQ.generation_kwargs(dataclasses.replace(evaluation, num_beams=beams), data.max_target_length)

    out = {"records": {}, "uneven": {}}
    for beams in (1, 2):
        settings = settings_with(beams)
        assert settings["num_beams"] == beams and settings["max_new_tokens"] == 12
        for version in (1, 2):
            model, parallelism = sharded(tiny_t5(seed=7), _fsdp_config({"fsdp_version": version}), FP32)
            folder = f"{output_dir}/fsdp{version}-beams{beams}"
            where = functools.partial(layout.predictions_file, folder)
            evaluator = Evaluator(eval_set=eval_set, parallelism=parallelism, spec=SEQ2SEQ, generation=settings,
                                  metric="rouge", predictions_file=where, info=info)  # fmt: skip
            out["records"][(version, beams)] = evaluator.evaluate(model, 1, 5)
            # Lengths that differ by rank: rank r stops after 3 + 6 r new tokens, the others keep stepping.
            uneven = {**settings, "max_new_tokens": 3 + 6 * rank}
            ids = generate(model, parallelism, SEQ2SEQ.prompts(make_batch(rank, rows=2)), uneven)
            out["uneven"][(version, beams)] = ids.shape[1]
    if rank == 0:
        plain = tiny_t5(seed=7).eval()
        dataset = eval_set.dataset
        out["plain"] = {}
        for beams in (1, 2):
            settings = settings_with(beams)
            texts = []
            for index in range(len(dataset)):
                item = dataset[index]
                source, mask = item["source_ids"][None], item["source_mask"][None]
                with torch.no_grad():
                    ids = plain.generate(input_ids=source, attention_mask=mask, use_cache=True,
                                         **settings)  # fmt: skip
                texts.append(tokenizer.decode(ids[0], skip_special_tokens=True).strip())
            out["plain"][beams] = texts
        out["references"] = [dataset.reference(i) for i in range(len(dataset))]
    return out


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("generation")
    return root, run_ranks(generation_worker, str(root), N_SAMPLES, 3, timeout_s=240)


@pytest.mark.parametrize("beams", [1, 2])
def test_fsdp_generation_equals_plain_generate_and_rouge_equals_rouge_score(generated, beams):
    root, (rank0, rank1) = generated
    plain, references = rank0["plain"][beams], rank0["references"]
    expected = mean_scores([rouge_scores(ref, pred) for ref, pred in zip(references, plain, strict=True)], "rouge")
    for version in (1, 2):
        record = rank0["records"][(version, beams)]
        assert record == rank1["records"][(version, beams)], "every rank returns rank 0's record"
        assert set(record) == EVAL_KEYS and record["num_samples"] == N_SAMPLES
        lines = read_jsonl(root / f"fsdp{version}-beams{beams}" / "predictions" / "validation_step_00000005.jsonl")
        # Every article once, in split order, with exactly the text scored as reference.
        assert [line["reference"] for line in lines] == references
        assert [line["prediction"] for line in lines] == plain, f"FSDP{version} differs from plain generate"
        for key in ROUGE_KEYS:
            assert record[key] == pytest.approx(expected[key], abs=1e-6), (version, key)


def test_rouge_is_rouge_scores_with_its_stemmer_and_rougelsum_by_sentence():
    """docs/evaluation.md's setting, against rouge-score itself, on texts where it matters: its Porter stemmer
    ("cats" and "cat", "feeding" and "feed") and rougeLsum's sentences (a summary of two steps). A tiny model's
    generated words rarely differ by a suffix, so the runs' parity checks cannot see a stemmer missing."""
    reference = "Feed the cats every morning. Pick the ripe apples."
    prediction = "Feeding a cat every morning. The apples picked when ripe."
    keys = list(ROUGE_KEYS)
    stemmed = rouge_scorer.RougeScorer(keys, use_stemmer=True)
    plain = stemmed.score(reference, prediction)
    lines = stemmed.score(reference.replace(". ", ".\n"), prediction.replace(". ", ".\n"))
    expected = {key: 100 * plain[key].fmeasure for key in ("rouge1", "rouge2", "rougeL")}
    expected["rougeLsum"] = 100 * lines["rougeLsum"].fmeasure
    scores = rouge_scores(reference, prediction)
    assert scores == pytest.approx(expected, abs=1e-9)
    unstemmed = rouge_scorer.RougeScorer(keys, use_stemmer=False).score(reference, prediction)
    assert scores["rouge1"] > 100 * unstemmed["rouge1"].fmeasure + 1  # the stemmer matters here
    assert scores["rougeLsum"] != pytest.approx(100 * plain["rougeLsum"].fmeasure)  # so do the sentences


def test_gen_len_counts_the_written_tokens_and_the_eos_also_when_it_pads():
    """T5's outputs (decoder start 0 = pad, then tokens, EOS 1, padding), BART's, and a decoder-only model's
    completions padded with its EOS (2): each row's tokens and its stop token, as T5's always were; a row cut
    by max_new_tokens has none to count; a chat model that stops at its end of turn (7) before the EOS."""
    t5 = torch.tensor([[0, 5, 6, 1, 0, 0], [0, 5, 6, 7, 8, 1]])
    written = SEQ2SEQ.completions(t5, {})
    assert generated_lengths(written, pad_id=0, stop_ids=[1]) == [3, 5] == (t5 != 0).sum(dim=1).tolist()
    # BART's decoder starts from its EOS (2; padding 1), then the forced <s> (0): the start is no stop
    bart = torch.tensor([[2, 0, 5, 6, 2, 1], [2, 0, 5, 6, 7, 2]])
    assert generated_lengths(SEQ2SEQ.completions(bart, {}), pad_id=1, stop_ids=[2]) == [4, 5]
    causal = torch.tensor([[5, 6, 2, 2, 2], [5, 6, 7, 8, 9], [2, 2, 2, 2, 2]])
    assert generated_lengths(causal, pad_id=2, stop_ids=[2]) == [3, 5, 1]
    assert (causal != 2).sum(dim=1).tolist() == [2, 5, 0]  # what counting non-padding tokens gave
    chat = torch.tensor([[5, 6, 7, 2, 2]])
    assert generated_lengths(chat, pad_id=2, stop_ids=[2, 7]) == [3]
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[7, 2]))
    unwrapped = Unwrapped(FSDPConfig(single_rank_fsdp=False))
    assert generation_stops(model, unwrapped, SimpleNamespace(eos_token_id=2), TurnEnd()) == TurnEnd((2, 7))
    no_config = SimpleNamespace()
    assert generation_stops(no_config, unwrapped, SimpleNamespace(eos_token_id=1), TurnEnd()) == TurnEnd((1,))


def test_generation_stops_at_the_tokenizers_eos_also_where_the_models_config_names_another(monkeypatch, tmp_path):
    """Every training row ends with the tokenizer's EOS: the evaluator hands `generate` that one and the model's
    generation config's (generation_stops), so a folder whose generation_config.json names another EOS does not
    write past it (text after it that the predictions would score)."""

    from utils.eval import evaluator as evaluation_module
    from utils.eval.evaluator import Evaluator
    from utils.eval.generation import generate

    tokenizer = AutoTokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR))
    model = T5ForConditionalGeneration.from_pretrained(str(EMBEDDED_MODEL_DIR)).eval()
    model.generation_config.eos_token_id = 99  # not the tokenizer's (1)
    eval_set = one_rank_loaders(tokenizer, DataConfig(num_train_samples=4, num_val_samples=2)).evaluation
    asked = []

    def recorded(model, parallelism, prompts, settings):
        asked.append((prompts, settings))
        return generate(model, parallelism, prompts, settings)

    monkeypatch.setattr(evaluation_module, "generate", recorded)
    unwrapped = Unwrapped(FSDPConfig(single_rank_fsdp=False))
    evaluator = Evaluator(eval_set=eval_set, parallelism=unwrapped, spec=SEQ2SEQ,
                          generation={"max_new_tokens": 24, "num_beams": 1},
                          metric="rouge", predictions_file=lambda split, step: str(tmp_path / f"{split}-{step}"),
                          info=ONE_CPU_RANK, gather_for_generation="false",
                          compute_dtype=torch.float32)  # fmt: skip
    with one_process_group():
        rows = evaluator._generate_share(model, None)
    assert [settings["eos_token_id"] for _, settings in asked] == [[1, 99]] and len(rows) == 2
    # The export generates as evaluated: its generation_config.json ends at both where the model's config names
    # another EOS than the tokenizer's; the embedded T5's (the same one) is left as it was.
    assert run_generation_config(model.config, SEQ2SEQ, tokenizer).eos_token_id == 1
    model.config.eos_token_id = 99
    assert run_generation_config(model.config, SEQ2SEQ, tokenizer).eos_token_id == [1, 99]
    assert run_generation_config(model.config, SEQ2SEQ).eos_token_id == 99  # the control: the config's alone


def test_ranks_with_different_generated_lengths_finish(generated):
    _, (rank0, rank1) = generated
    for key, length in rank0["uneven"].items():
        # 1 decoder start token + max_new_tokens (3 on rank 0, 9 on rank 1): nobody waited for the other.
        assert (length, rank1["uneven"][key]) == (4, 10), key


# ------------------------------------------------------------------------------ which rows, one process


def row_ids(dataset) -> list[str]:
    return [dataset.row_id(i) for i in range(len(dataset))]


def test_generation_scores_the_validation_loss_rows_unless_asked_otherwise():
    """A small run's evaluation is as small as the run: by default generation scores exactly the rows whose
    validation loss the run measures; --eval_num_samples N asks for the first N (beyond them too); 0 for all."""
    tokenizer = AutoTokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR))

    def loaders(evaluation: EvalConfig, num_val_samples: int):
        data = DataConfig(num_train_samples=8, num_val_samples=num_val_samples)
        return one_rank_loaders(tokenizer, data, evaluation)

    small = loaders(EvalConfig(), 8)
    val_rows = row_ids(small.val.dataset)
    assert len(val_rows) == 8 and row_ids(small.evaluation.dataset) == val_rows
    asked = loaders(EvalConfig(eval_num_samples=20), 8)
    assert len(asked.evaluation.dataset) == 20 and row_ids(asked.evaluation.dataset)[:8] == val_rows
    fewer = loaders(EvalConfig(eval_num_samples=3), 8)
    assert row_ids(fewer.evaluation.dataset) == val_rows[:3]
    whole = loaders(EvalConfig(), 0)
    split_rows = len(load_wikihow(EMBEDDED_DATA_DIR, "validation"))
    assert len(whole.evaluation.dataset) == len(whole.val.dataset) == split_rows
    # --evaluate_only scores the first --num_val_samples rows of its split.
    test = loaders(EvalConfig(evaluate_only=True, eval_split="test"), 8)
    assert test.evaluation.split == "test" and len(test.evaluation.dataset) == 8


# ------------------------------------------------------------------------------- through torchrun

EVAL_NUM = 12
RUN_ARGS = ["--mixed_precision", "false", "--num_train_samples", "96", "--num_val_samples", "24", "--epochs", "2",
            "--eval_num_samples", str(EVAL_NUM), "--eval_every_n_steps", "5", "--metric_for_best", "rougeL",
            "--no_repeat_ngram_size", "3",
            "--max_new_tokens", "16"]  # fmt: skip  # short summaries: the untrained tiny model writes to the limit
STEPS = [5, 10, 12, 15, 20, 24]  # every 5 steps, and each epoch's end (12 steps per epoch)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("rouge_run") / "out"
    run = pooled([*RUN_ARGS, "--output_dir", str(output_dir)])
    assert run.returncode == 0, run.describe()
    return output_dir


def eval_records(output_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(output_dir / "metrics.jsonl") if r["type"] == "eval"]


def final_model(output_dir: Path) -> Path:
    last = output_dir / "hf_model_last"
    return last if last.is_dir() else output_dir / "hf_model"


@pytest.mark.slow
def test_eval_records_and_predictions_files_agree(trained):
    records = eval_records(trained)
    assert [r["step"] for r in records] == STEPS
    titles = list(load_wikihow(EMBEDDED_DATA_DIR, "validation")["title"])[:EVAL_NUM]
    for record in records:
        assert set(record) == EVAL_KEYS and record["split"] == "validation" and record["num_samples"] == EVAL_NUM
        lines = read_jsonl(trained / "predictions" / f"validation_step_{record['step']:08d}.jsonl")
        assert [line["id"] for line in lines] == titles  # each article once, in split order
        recomputed = mean_scores([rouge_scores(line["reference"], line["prediction"]) for line in lines], "rouge")
        for key in ROUGE_KEYS:
            assert record[key] == pytest.approx(recomputed[key], abs=1e-6), (record["step"], key)


@pytest.mark.slow
def test_validation_loss_is_recorded_every_n_steps_inside_the_epochs(trained):
    records = [r for r in read_jsonl(trained / "metrics.jsonl") if r["type"] == "validation"]
    # Inside the epochs only: at their ends (steps 12, 24) the validation loss is in the epoch record.
    assert [(r["epoch"], r["step"]) for r in records] == [(1, 5), (1, 10), (2, 15), (2, 20)]
    losses = [r["val_loss"] for r in records]
    assert all(0 < loss < 20 for loss in losses) and len(set(losses)) == len(losses), losses


@pytest.mark.slow
def test_best_epoch_by_rouge_is_hf_model_and_survives_in_the_checkpoint(trained):
    at_epoch_end = {r["epoch"]: r["rougeL"] for r in eval_records(trained) if r["step"] in (12, 24)}
    best_epoch = max(at_epoch_end, key=lambda epoch: (at_epoch_end[epoch], -epoch))  # the first of equals
    state = json.loads((trained / "checkpoints" / "step_00000024" / "train_state.json").read_text())
    assert state["progress"]["best_epoch"] == best_epoch
    assert state["progress"]["best_metric"] == pytest.approx(at_epoch_end[best_epoch])
    assert (trained / "hf_model" / "model.safetensors").is_file()
    assert (trained / "hf_model_last").is_dir() == (best_epoch != 2)
    generation = json.loads((trained / "hf_model" / "generation_config.json").read_text())
    assert generation["no_repeat_ngram_size"] == 3 and generation["num_beams"] == 1 and generation["use_cache"]


def summarize_in_a_process(model: Path, args: list[str], stdin: str) -> list[str]:
    """`... | python scripts/summarize.py --model MODEL ARGS`: its stdout's lines."""
    done = subprocess.run([sys.executable, "scripts/summarize.py", "--model", str(model), *args], cwd=REPO_ROOT,
                          input=stdin, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def summarize(model: Path, args: list[str], capsys, stderr: list[str] | None = None) -> list[str]:
    """scripts/summarize.py's main in this process (the script's own process is run once, for stdin); the
    package logger as it was before (main sets it up for the script). What it wrote to stderr is appended to
    `stderr` where given."""
    logger = get_logger()
    handlers, level = list(logger.handlers), logger.level
    capsys.readouterr()
    try:
        assert summarize_main(["--model", str(model), *args]) == 0
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
    captured = capsys.readouterr()
    if stderr is not None:
        stderr.append(captured.err)
    return captured.out.splitlines()


@pytest.mark.slow
def test_summarize_reproduces_the_last_evaluation_from_a_file_and_from_stdin(trained, tmp_path, capsys):
    """fp32: a single process with plain generate on hf_model gives the predictions of the FSDP run."""
    lines = read_jsonl(trained / "predictions" / "validation_step_00000024.jsonl")
    articles = list(load_wikihow(EMBEDDED_DATA_DIR, "validation")["text"])[:EVAL_NUM]
    csv = tmp_path / "articles.csv"
    pd.DataFrame({"text": articles}).to_csv(csv, index=False)
    assert summarize(final_model(trained), ["--input", str(csv)], capsys) == [line["prediction"] for line in lines]
    jsonl = tmp_path / "articles.jsonl"  # a data file as training reads it: its document column
    jsonl.write_text("".join(json.dumps({"id": i, "document": a}) + "\n" for i, a in enumerate(articles[:2])))
    two = [line["prediction"] for line in lines[:2]]
    assert summarize(final_model(trained), ["--input", str(jsonl)], capsys) == two
    one_line_each = "\n".join(article.replace("\n", " ") for article in articles[:2]) + "\n"
    assert summarize_in_a_process(final_model(trained), [], stdin=one_line_each) == two


def file_bytes(folder: Path, leave_out: tuple[str, ...]) -> dict:
    """Every file under folder with its bytes, the top-level entries `leave_out` left out."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.relative_to(folder).parts[0] not in leave_out
    }


@pytest.mark.slow
def test_evaluate_only_scores_a_training_run_on_the_test_split_and_leaves_what_it_wrote(trained, tmp_path):
    """--evaluate_only --resume true on a training run's folder: the run's settings and its newest checkpoint,
    scored on the test split; its record and predictions go to evaluate_only/, and nothing training wrote
    changes (its predictions of the same step and its metrics.jsonl included)."""
    output_dir = shutil.copytree(trained, tmp_path / "run")
    training_files = file_bytes(output_dir, leave_out=("run.lock",))
    args = ["--evaluate_only", "true", "--resume", "true", "--eval_split", "test", "--eval_num_samples", "8",
            "--tensorboard", "true", "--output_dir", str(output_dir)]  # fmt: skip
    run = pooled(args)
    assert run.returncode == 0, run.describe()
    assert "INFO training steps" not in run.output, run.describe()
    assert "--eval_split test (the run had auto)" in run.output, run.describe()
    assert file_bytes(output_dir, leave_out=("run.lock", "evaluate_only")) == training_files
    folder = output_dir / "evaluate_only"
    [record] = eval_records(folder)
    assert record["split"] == "test" and record["num_samples"] == 8 and record["step"] == STEPS[-1]
    assert record["model"] == str(output_dir / "checkpoints" / f"step_{STEPS[-1]:08d}")
    [predictions] = folder.glob(f"test_step_{STEPS[-1]:08d}_*.jsonl")
    lines = read_jsonl(predictions)
    assert [line["id"] for line in lines] == list(load_wikihow(EMBEDDED_DATA_DIR, "test")["title"])[:8]
    recomputed = mean_scores([rouge_scores(line["reference"], line["prediction"]) for line in lines], "rouge")
    assert all(record[key] == pytest.approx(recomputed[key], abs=1e-6) for key in ROUGE_KEYS)
    assert sorted(p.name for p in folder.iterdir()) == sorted(["metrics.jsonl", predictions.name, "tensorboard"])
    from tests.test_tensorboard import read_scalars

    assert read_scalars(folder / "tensorboard")["rouge/test/rougeL"] == [
        (STEPS[-1], pytest.approx(record["rougeL"]))
    ]


@pytest.mark.slow
def test_hf_model_generates_like_the_evaluation(trained):
    model = T5ForConditionalGeneration.from_pretrained(final_model(trained)).eval()
    tokenizer = AutoTokenizer.from_pretrained(final_model(trained))
    assert (
        model.config.use_cache and model.config.task_specific_params["summarization"]["no_repeat_ngram_size"] == 3
    )
    with torch.no_grad():
        ids = model.generate(**tokenizer("Knead the dough. Bake it.", return_tensors="pt"))
    assert ids.shape[1] <= 1 + 150


@pytest.fixture
def adapter_folders(tmp_path) -> tuple[Path, Path]:
    """A --peft lora run's hf_adapter/ (written as the run writes it, with an adapter that changes the model)
    and the same adapter merged by PEFT and saved as a whole model, as a --merge_lora true run writes it."""
    tokenizer = AutoTokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR))
    base = str(EMBEDDED_MODEL_DIR)
    torch.manual_seed(0)
    model = apply_lora(
        AutoModelForSeq2SeqLM.from_pretrained(base), LoraConfig(peft="lora"), adapter_base(base), SEQ2SEQ
    )
    adapters = {}
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data.normal_(0, 0.5)  # B starts at zero: an adapter that changes the model
            adapters[name.replace(".default", "")] = param.detach().clone()
    settings = EvalConfig(max_new_tokens=12)
    model.base_model.model.config.task_specific_params = {
        "summarization": SEQ2SEQ.saved_params(DataConfig(source_prefix="summarize: "), settings, "wikihow")
    }
    folder = tmp_path / "hf_adapter"
    write_adapter_folder(adapters, model.base_model.model.config, SEQ2SEQ, LoraConfig(peft="lora"),
                         adapter_base(base), tokenizer, str(folder))  # fmt: skip
    merged = PeftModel.from_pretrained(AutoModelForSeq2SeqLM.from_pretrained(base), folder).merge_and_unload()
    merged.config.task_specific_params = model.base_model.model.config.task_specific_params
    merged.save_pretrained(tmp_path / "merged")
    run_generation_config(merged.config, SEQ2SEQ).save_pretrained(tmp_path / "merged")
    tokenizer.save_pretrained(tmp_path / "merged")
    return folder, tmp_path / "merged"


def test_summarize_takes_a_lora_adapter_folder_as_its_merged_model(adapter_folders, tmp_path, capsys):
    """scripts/summarize.py merges an adapter folder into the base its config names and summarises with the
    run's settings, as the merged model does."""
    folder, merged = adapter_folders
    articles = list(load_wikihow(EMBEDDED_DATA_DIR, "validation")["text"])[:3]
    csv = tmp_path / "articles.csv"
    pd.DataFrame({"text": articles}).to_csv(csv, index=False)
    got = summarize(folder, ["--input", str(csv)], capsys)
    want = summarize(merged, ["--input", str(csv)], capsys)
    plain = summarize(EMBEDDED_MODEL_DIR, ["--input", str(csv)], capsys)
    assert got == want and got != plain, (got, want, plain)


def test_summarize_writes_whole_summaries_with_a_model_trained_elsewhere(tmp_path, capsys):
    """A model without a run's settings (the embedded base model; a hub checkpoint) summarises up to its
    published summarization length (T5's config.json), else training's default target length, not
    transformers' 20-token default, said once; a model whose generation config sets a length keeps it."""
    articles = tmp_path / "articles.txt"
    articles.write_text(
        "How to bake bread. Mix the flour and water, knead and bake it.\nHow to sow. Sow in spring.\n"
    )
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    model = T5ForConditionalGeneration.from_pretrained(EMBEDDED_MODEL_DIR)
    published, own_length = tmp_path / "published", tmp_path / "own_length"
    model.config.task_specific_params = {"summarization": {"max_length": 40, "num_beams": 2, "prefix": ""}}
    model.save_pretrained(published)
    model.config.task_specific_params = None
    model.generation_config.max_length = 12
    model.save_pretrained(own_length)
    for folder in (published, own_length):
        tokenizer.save_pretrained(folder)
    lengths, said = {}, {}
    for name, folder in (("default", EMBEDDED_MODEL_DIR), ("published", published), ("own", own_length)):
        said[name] = []
        summaries = summarize(folder, ["--input", str(articles), "--batch_size", "1"], capsys, stderr=said[name])
        # The embedded model never ends a summary: it writes up to the limit.
        lengths[name] = max(len(tokenizer(text, add_special_tokens=False).input_ids) for text in summaries)
    assert lengths["own"] < 20 < lengths["published"] < lengths["default"], lengths
    assert said["default"][0].count("summaries of up to 150 new tokens\n") == 1, said
    assert said["published"][0].count("up to 40 new tokens (its published summarization settings)") == 1, said
    assert "summaries of up to" not in said["own"][0], said
    # Their texts are read as they are (WikiHow's cleaning drops a text's quotes), unlike a run's of before the
    # cleaning field, which was a WikiHow run's
    from scripts.summarize import source_cleaning

    published_t5 = {"prefix": "summarize: ", "num_beams": 4, "max_length": 200}
    assert [source_cleaning(params) for params in ({}, published_t5)] == ["plain", "plain"]
    assert source_cleaning({"prefix": "", "max_source_length": 512}) == "wikihow"
    assert source_cleaning({"cleaning": "chat", "max_source_length": 512}) == "chat"


@pytest.mark.slow
def test_evaluate_only_takes_a_lora_adapter_folder_as_its_merged_model(adapter_folders, tmp_path):
    """--evaluate_only --model_name on an adapter folder scores its base with the adapter merged in: the
    merged model's scores and summaries, and the log says which base it read."""
    folder, merged = adapter_folders
    evaluated = {}
    # FSDP2's rank-0-only loading: rank 0 merges, the others' skeletons receive its weights.
    fsdp2_from_rank0 = ["--fsdp_version", "2", "--cpu_ram_efficient_loading", "true"]
    for name, model, flags in (
        ("adapter", folder, []),
        ("merged", merged, []),
        ("FSDP2", folder, fsdp2_from_rank0),
    ):
        output_dir = tmp_path / f"evaluated_{name}"
        run = pooled(["--evaluate_only", "true", "--model_name", str(model), "--eval_num_samples", "6",
                      "--output_dir", str(output_dir), *flags])  # fmt: skip
        assert run.returncode == 0, run.describe()
        [record] = eval_records(output_dir / "evaluate_only")
        [predictions] = (output_dir / "evaluate_only").glob("*_step_*.jsonl")
        evaluated[name] = ({key: record[key] for key in ROUGE_KEYS}, read_jsonl(predictions))
        if name == "adapter":
            assert f"(a LoRA adapter, merged into its base {EMBEDDED_MODEL_DIR})" in run.output, run.describe()
    assert evaluated["adapter"] == evaluated["merged"] == evaluated["FSDP2"]
    # Training from it stays refused, before anything loads.
    run = pooled(["--model_name", str(folder), "--output_dir", str(tmp_path / "trained")])
    assert run.returncode == 2 and "is a LoRA adapter, not a whole model" in run.output, run.describe()
    # FSDP1's rank-0-only loading reads each unit from the model's files, which hold no merged weights.
    run = pooled(["--evaluate_only", "true", "--model_name", str(folder), "--cpu_ram_efficient_loading", "true",
                  "--output_dir", str(tmp_path / "refused")])  # fmt: skip
    assert run.returncode == 2 and "Add --cpu_ram_efficient_loading false, or --fsdp_version 2" in run.output, (
        run.describe()
    )
