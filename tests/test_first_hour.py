"""A new user's first hour offline (issue 32): a hub name that cannot be reached fails in seconds with the
offline fixes, a mistyped folder says "no such folder", the HF cache's copy of a model is read without the
network, and a tokenizer that does not fit the model stops the run before any data is cached.

The hub is simulated: a closed port on 127.0.0.1 (nothing answers: what no network looks like), or a local
server that answers with an HTTP status, so the tests neither depend on the network nor wait on it."""

import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub import constants as hub_constants
from transformers import AutoConfig, AutoTokenizer

from configs.errors import ConfigError
from configs.paths import EMBEDDED_MODEL_DIR, REPO_ROOT
from tests.launch import offline_env, program_tracebacks, torchrun_command
from utils.distributed.process_group import free_port
from utils.model import loading, source
from utils.spec import SEQ2SEQ

FAIL_FAST_S = 5  # in one process, the lookup alone (huggingface_hub's retries would take 23 s per file)
RUN_FAIL_FAST_S = 60  # a whole run, imports included (about 15 s on 2 loaded cores)
TOKENIZER_FILES = ("spiece.model", "tokenizer.json", "tokenizer_config.json")


def hub_at(monkeypatch, endpoint: str) -> None:
    """The hub at `endpoint`, as HF_ENDPOINT would set it (the URL template is built from it at import)."""
    monkeypatch.setattr(hub_constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """No hub (a closed port), HF_HUB_OFFLINE unset, an empty HF cache; every lookup made afresh."""
    hub_at(monkeypatch, f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    loading.hub_source.cache_clear()
    yield cache
    loading.hub_source.cache_clear()


def fill_hf_cache(cache: Path, model_id: str, files: list[str]) -> Path:
    """The HF cache's layout for `model_id` at one revision, holding these files of the embedded tiny T5."""
    repo = cache / f"models--{model_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in files:
        shutil.copy(EMBEDDED_MODEL_DIR / name, snapshot / name)
    return snapshot


def refusal(load, name) -> str:
    """The message of the ConfigError that load(name) raises."""
    with pytest.raises(ConfigError) as refused:
        load(name)
    return str(refused.value)


def model_folder(folder: Path, with_tokenizer: bool = True) -> Path:
    """A copy of the embedded tiny T5, with or without its tokenizer's files."""
    shutil.copytree(EMBEDDED_MODEL_DIR, folder, ignore=None if with_tokenizer else lambda *_: TOKENIZER_FILES)
    return folder


def test_a_hub_name_is_told_from_a_path():
    """A hub id has at most one '/' (huggingface_hub's rule); anything else is a path, which must exist."""
    for hub_id in ("t5-base", "google/flan-t5-base", "output/hf_model"):
        assert not source.looks_like_local_path(hub_id), hub_id
    for path in (
        "/abs/model",
        "./hf_model",
        "../hf_model",
        "~/hf_model",
        "outputs/run1/hf_model",
        "outputs/hf_model/",
    ):
        assert source.looks_like_local_path(path), path


def test_an_unreachable_hub_name_fails_in_seconds_with_the_offline_fixes(offline_hub):
    start = time.monotonic()
    message = refusal(loading.load_tokenizer, "t5-base")
    assert time.monotonic() - start < FAIL_FAST_S
    assert message.startswith("model 't5-base' is not a folder here, and as a hub name it cannot be read: ")
    assert "cannot be reached (ConnectError" in message
    fixes = (
        "save_pretrained",
        "data/tiny-t5",
        f"HF cache ({offline_hub})",
        "hf download t5-base",
        "HF_HUB_OFFLINE=1",
    )
    for fix in fixes:
        assert fix in message, fix


def test_offline_mode_without_the_model_in_the_hf_cache_says_so(offline_hub, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ConfigError, match=r"cannot be read: HF_HUB_OFFLINE=1 is set, and the HF cache .* does not"
    ):
        loading.resolved_name("t5-base")


def test_an_unreachable_hub_reads_the_hf_cache_copy_without_the_network(offline_hub, monkeypatch, log_records):
    snapshot = fill_hf_cache(offline_hub, "org/tiny", ["config.json", *TOKENIZER_FILES])
    start = time.monotonic()
    tokenizer = loading.load_tokenizer("org/tiny")
    assert time.monotonic() - start < FAIL_FAST_S
    assert len(tokenizer) == 1100
    assert loading.resolved_name("org/tiny") == str(snapshot)  # every later read: the same folder, no lookup
    [warning] = [record.getMessage() for record in log_records]
    assert "cannot be reached" in warning and f"reading org/tiny from the HF cache ({snapshot})" in warning
    # With HF_HUB_OFFLINE=1, transformers reads the HF cache itself: the id stays as it is.
    loading.hub_source.cache_clear()
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    assert loading.resolved_name("org/tiny") == "org/tiny"


def test_a_hf_cache_copy_without_its_tokenizer_is_refused(offline_hub):
    """The issue's case: transformers builds T5's tokenizer of special tokens alone (104) from a config.json
    without the vocabulary, and every word becomes <unk>."""
    fill_hf_cache(offline_hub, "org/half", ["config.json"])
    with pytest.raises(ConfigError) as refused:
        loading.load_tokenizer("org/half")
    message = str(refused.value)
    assert message.startswith("the tokenizer of ") and "(T5Tokenizer, 104 tokens)" in message
    assert "(t5, vocab_size 1100): it knows no word of 'hello world how are you' (▁ <unk> ▁ <unk>" in message
    assert "tokenizer.save_pretrained(folder) writes spiece.model, tokenizer.json" in message


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(self.server.status)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def hub_answering(monkeypatch, offline_hub):
    """A local hub server: call the fixture's value with a status, and it answers every request with it."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    hub_at(monkeypatch, f"http://127.0.0.1:{server.server_address[1]}")
    yield lambda status: setattr(server, "status", status)
    server.shutdown()
    server.server_close()


def test_the_hubs_answer_decides(hub_answering, tmp_path, monkeypatch):
    """A server error is no answer (the HF cache, or the offline fixes); a refusal is one, which transformers
    words itself, unless a model folder with a close path exists."""
    hub_answering(503)
    assert source.hub_unreachable("t5-base") == f"{source.hub_host()} answers HTTP 503"
    hub_answering(404)
    assert source.hub_unreachable("t5-base") is None
    monkeypatch.chdir(tmp_path)
    model_folder(tmp_path / "outputs" / "hf_model")
    message = refusal(loading.resolved_name, "output/hf_model")
    assert message.startswith(
        "no such folder: 'output/hf_model' does not exist here (did you mean 'outputs/hf_model'?)"
    )
    assert message.endswith(f", and {source.hub_host()} has no such model (HTTP 404).")


def test_a_mistyped_folder_says_no_such_folder_and_what_was_meant(offline_hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model_folder(tmp_path / "outputs" / "hf_model")
    start = time.monotonic()
    # The case: a hub id by its spelling, so the hub is asked too.
    message = refusal(loading.load_tokenizer, "output/hf_model")
    assert message.startswith(
        "no such folder: 'output/hf_model' does not exist here (did you mean 'outputs/hf_model'?)"
    )
    assert "and as a hub name it cannot be read either: " in message and "cannot be reached" in message
    # Paths no hub id is spelled like: the folder alone, at once.
    for typed in ("./output/hf_model", "outputs/hf_modl/", "outputs/../output/hf_model"):
        message = refusal(loading.load_tokenizer, typed)
        assert message.startswith(
            f"no such folder: model path '{typed}' does not exist (did you mean 'outputs/hf_model'?)"
        )
    message = refusal(loading.load_tokenizer, "elsewhere/run1/hf_model")
    assert message.startswith("no such folder: model path 'elsewhere/run1/hf_model' does not exist. ")  # no guess
    assert time.monotonic() - start < FAIL_FAST_S
    # A --peft lora run's adapter folder given as a model: what to use instead.
    (tmp_path / "outputs" / "hf_adapter").mkdir()
    (tmp_path / "outputs" / "hf_adapter" / "adapter_config.json").write_text("{}")
    message = refusal(loading.load_tokenizer, "./outputs/hf_adapter")
    assert "is a LoRA adapter, not a whole model" in message and "--merge_lora true" in message, message


def test_a_tokenizer_that_does_not_fit_the_model_is_refused():
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    embedded = AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR)
    loading.check_tokenizer("tiny", tokenizer, embedded, SEQ2SEQ)  # the embedded pair
    smaller = AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR, vocab_size=1000)
    message = refusal(lambda config: loading.check_tokenizer("tiny", tokenizer, config, SEQ2SEQ), smaller)
    assert message.startswith(
        "the tokenizer of 'tiny' (T5Tokenizer, 1100 tokens) does not fit the model (t5, "
        "vocab_size 1000): it has more tokens than the model has embeddings: ids 1000 to 1099"
    )
    other = AutoConfig.from_pretrained(EMBEDDED_MODEL_DIR, eos_token_id=5, decoder_start_token_id=1100)
    message = refusal(lambda config: loading.check_tokenizer("tiny", tokenizer, config, SEQ2SEQ), other)
    assert (
        ": its end-of-sequence token is id 1, the model's eos_token_id is 5; the model's decoder_start_token_id "
        "1100 is not one of its ids. Put the tokenizer" in message
    )


@pytest.mark.slow  # a whole `python T5_training.py` process: 12-13 s in the fast subset
def test_a_broken_tokenizer_stops_the_run_before_the_data_cache_is_written(tmp_path):
    """One process (`python T5_training.py`): the run ends with the message, and --cache_dir never appears."""
    folder = model_folder(tmp_path / "no_tokenizer", with_tokenizer=False)
    cache = tmp_path / "cache"
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "T5_training.py", "--model_name", str(folder), "--cache_dir", str(cache),
         "--output_dir", str(tmp_path / "out")],
        cwd=REPO_ROOT, env=offline_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 2 and time.monotonic() - start < RUN_FAIL_FAST_S, output
    assert "ERROR the tokenizer of " in output and "(T5Tokenizer, 104 tokens) does not fit the model" in output
    assert not cache.exists() and not program_tracebacks(output), output


@pytest.mark.slow  # a real torchrun launch of 2 ranks (5 s)
def test_an_unreachable_hub_name_ends_every_rank_in_seconds_with_one_message(tmp_path):
    """The issue's command, through torchrun on 2 ranks, with HF_HUB_OFFLINE unset and nothing on the hub's
    port: before, 263 s and 539 lines (220 of them retries); now rank 0 asks once and says it once."""
    env = offline_env()
    env.pop("TRANSFORMERS_OFFLINE", None)  # huggingface_hub reads it as HF_HUB_OFFLINE
    env.update(HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{free_port()}", HF_HOME=str(tmp_path / "hf"))
    start = time.monotonic()
    done = subprocess.run(
        torchrun_command(["--model_name", "t5-base", "--output_dir", str(tmp_path / "out")]),
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    seconds, output = time.monotonic() - start, done.stdout + done.stderr
    assert done.returncode != 0 and seconds < RUN_FAIL_FAST_S, output
    [error] = [line for line in output.splitlines() if line.startswith("[rank") and " ERROR " in line]
    assert error.startswith("[rank 0] ERROR model 't5-base' is not a folder here"), output
    assert "HF_HUB_OFFLINE=1" in error and f"HF cache ({tmp_path / 'hf' / 'hub'})" in error
    assert "Retrying" not in output and not program_tracebacks(output), output
    assert not os.path.exists(tmp_path / "out" / "config.json")
