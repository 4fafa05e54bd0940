"""The data cache: every source reduced to memory-mapped Arrow files, read once per machine.

Every source (WikiHow, utils/data/wikihow.py; files, a saved dataset or a named one, utils/data/sources.py) is
written once into the text cache, one Arrow file per split with the columns id, source and target; the
token ids of the rows a run uses are cached beside it, keyed by the text cache, the tokenizer, the lengths
and the prefix. From there, sampling, resume and evaluation are one path for every source:

    rows = split_rows(tokenizer, "train", num_samples, input_length, output_length, data)

is what a Dataset (summarization_dataset.SummarizationDataset) reads its items from. The first run's
LOCAL_RANK 0 writes the caches under --cache_dir (default beside the data) and every rank and later run
reads them from there (utils/data/shared_cache.py says how the processes share the build, and what happens
to a damaged or half-built cache).
"""

import bisect
import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
from datasets.fingerprint import Hasher
from jinja2 import TemplateError

from configs.data import DataConfig, seq_len
from configs.errors import ConfigError, DataError
from utils.base.files import writable
from utils.base.log import get_logger
from utils.data import sources
from utils.data.shared_cache import checked_manifest, complete_folders, folder_for, shared_folder
from utils.data.sources import SPLITS, WIKIHOW_CSV, TextSource
from utils.data.wikihow import clean_text, wikihow_source
from utils.distributed.process_group import is_rank0, usable_cpus

# Bump when clean_text or the encoding of a row changes: the token cache is rebuilt.
ENCODING_VERSION = 2
_TOKEN_FEATURES = datasets.Features(
    {"source_ids": datasets.List(datasets.Value("int32")), "target_ids": datasets.List(datasets.Value("int32"))}
)
# Conversations also mark their prompt's earlier assistant replies (1), which the loss is on as on the last.
_CHAT_TOKEN_FEATURES = datasets.Features(
    {**_TOKEN_FEATURES, "source_replies": datasets.List(datasets.Value("int8")),
     "replies_unmarked": datasets.Value("int16"),  # the earlier replies that could not be told apart
     "unknown_roles": datasets.List(datasets.Value("string"))}  # the role of each message not of KNOWN_ROLES
)  # fmt: skip
# A bounded decoder-only row's cuts (_row_cuts): the tokens its prompt lost from its start, its reply from its end.
_CUT_FEATURES = {"prompt_cut": datasets.Value("int32"), "reply_cut": datasets.Value("int32")}
# Bump when _encode_chat_batch changes (3: earlier replies marked by their characters, and counted where not; 4: a
# cut reply keeps the template's whole end of turn; 5: unknown roles listed): the conversations' token caches are
# rebuilt.
CHAT_ENCODING_VERSION = 5
# The roles of TRL's conversational format, and those of OpenAI's (developer, the older function) and Llama 3.1's
# (ipython) chat formats; a message of another is rendered as the template renders it, and said.
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython")

# Starting a tokenising process (a fork, the tokenizer pickled) pays off from about this many rows.
_ROWS_PER_TOKENISING_PROCESS = 10_000
# Each is a fork of a rank (after its process group is set up) holding a tokenizer: a few suffice.
_MAX_TOKENISING_PROCESSES = 8

# Warnings about a cache's content, once per process and folder (not once per split or dataset).
_WARNED: set[tuple[Path, str]] = set()

# How a source's texts are prepared for the tokenizer and for scoring, by the name a TextSource gives: WikiHow's
# cleaning, or the text as it is (surrounding white space aside). Models record the name (scripts/summarize.py).
CLEANINGS: dict[str, Callable[[str], str]] = {"wikihow": clean_text, "plain": str.strip, "chat": str.strip}


def text_source(data: DataConfig) -> TextSource:
    """Where the run's rows come from: files or a dataset the flags name, else what --data_dir holds
    (WikiHow, split files, a save_to_disk folder). Cheap: the files are found, not read."""
    sources.check_data_found(data)  # each missing file or folder said with the way to get it
    named = sources.named_source(data)
    if named is not None:
        return named
    folder = Path(data.data_dir)
    if (folder / WIKIHOW_CSV).is_file():
        if data.dataset_text_field:
            raise ConfigError(
                f"--dataset_text_field {data.dataset_text_field}: {folder} holds WikiHow, whose rows are an "
                "article and its summary (a prompt and a completion); give your files or dataset of whole texts"
            )
        return wikihow_source(folder)
    return sources.folder_source(folder, data)


def cache_root(data: DataConfig, source: TextSource) -> Path:
    """Where the text cache lives: --cache_dir, by default beside the data (TextSource.default_cache)."""
    return Path(data.cache_dir) if data.cache_dir else source.default_cache


def usable_cache_root(root: Path, ready: Callable[[Path], bool]) -> Path:
    """`root`, where this process can write it or `ready(root)` says what is needed is built there already (a
    shared, read-only dataset mount with its cache); else a folder of this user's cache, said once."""
    if ready(root) or writable(root):  # a complete cache is read as it is: no write probe beside the data
        return root
    fallback = user_cache_dir() / hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16]
    if is_rank0():
        warn_once(root, "read-only",
                  "%s cannot be written: the data's cache goes to %s instead (--cache_dir chooses another)",
                  root, fallback)  # fmt: skip
    return fallback


def is_built(root: Path, name: str, key: dict) -> bool:
    """Whether the cache folder of `key` under `root` is complete."""
    return checked_manifest(folder_for(root, name, key), key)[0] is not None


def user_cache_dir() -> Path:
    """This user's cache folder for data caches that cannot go beside their data (XDG_CACHE_HOME's)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "t5_fsdp_data"


@dataclasses.dataclass(frozen=True)
class CachedSplit:
    rows: datasets.Dataset  # id, source, target; memory-mapped
    cache: Path  # the cache folder its rows are read from (the text cache): its name identifies them
    cleaning: str  # how a text is prepared (CLEANINGS)
    what: str  # the source, for messages


# Train with its held-out validation rows put back (--eval_split test), as its cache's key and checkpoints name it.
WHOLE_TRAIN = "train+held_out"


def warn_once(folder: Path, topic: str, message: str, *args) -> None:
    """Log a warning about the data in `folder` once per process (every split and Dataset would repeat it)."""
    if (folder, topic) not in _WARNED:
        _WARNED.add((folder, topic))
        get_logger().warning(message, *args)


def _text_cache(data: DataConfig) -> tuple[TextSource, Path, dict]:
    """The run's source, its text cache folder and the cache's manifest (the cache built first if needed)."""
    source = text_source(data)
    root = cache_root(data, source)
    if not data.cache_dir:  # a --cache_dir is where the user wants it, or a clear error
        root = usable_cache_root(root, lambda root: is_built(root, "text", source.key))
    folder, manifest = shared_folder(root, "text", source.key, source.write, f"the text cache of {source.what}")
    return source, folder, manifest


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """Which splits a run evaluates, from --eval_split and the splits its source has (evaluation_plan)."""

    evaluation: str  # validated and generated on during training; the split --evaluate_only scores
    final: str | None = None  # scored once after training: auto's test split, where validation is held out
    whole_train: bool = False  # train keeps the rows held out for validation (--eval_split test needs none)
    held_out_rows: int = 0  # the validation rows held out of train, where the source has no validation split

    def record(self) -> dict:
        """What a checkpoint records of it (utils/checkpoint/inputs.py): the rows trained on and the split
        evaluated on, which a resume must keep (the final split changes neither)."""
        return {"train": WHOLE_TRAIN if self.whole_train else "train", "evaluation": self.evaluation}


def evaluation_plan(data: DataConfig, asked: str, evaluate_only: bool = False) -> SplitPlan:
    """The splits --eval_split `asked` evaluates on the run's source. --evaluate_only: the split it names, or
    for auto the validation split where the data has one of its own, else its test split (a test file alone
    will do). Training: auto evaluates on validation (the source's, or a share of train held out), and
    where that is held out and the source has a test split, scores the test split once after training;
    test evaluates on the test split, and train keeps every row (nothing is held out for a validation split
    that is not read); validation evaluates on validation alone."""
    source, _, manifest = _text_cache(data)
    origin = manifest["origin"]
    # A validation split held out of train is no better than a test split the data has.
    held_out = "held out" in origin.get("validation", "held out")
    held_rows = manifest["rows"]["validation"] if "validation" in origin and held_out else 0
    if evaluate_only:
        if asked != "auto":
            return SplitPlan(asked)
        return SplitPlan("test" if "test" in origin and held_out else "validation")
    if asked == "test":
        if "test" not in origin:
            raise DataError(
                f"--eval_split test evaluates on the test split, and there is no test split in {source.what}: "
                f"{source.add_split.format(split='test')}; or --eval_split auto (validation)."
            )
        return SplitPlan("test", whole_train=held_rows > 0, held_out_rows=held_rows)
    final = "test" if asked == "auto" and held_out and "test" in origin else None
    return SplitPlan("validation", final=final, held_out_rows=held_rows)


def cached_split(data: DataConfig, split: str, whole_train: bool = False) -> CachedSplit:
    """One split of the run's source, memory-mapped from the text cache (built first if needed); train with
    `whole_train` has the rows held out of it for validation put back in their places (SplitPlan)."""
    if split not in SPLITS:
        raise ConfigError(f"Unknown split {split!r}; valid splits: {', '.join(SPLITS)}.")
    source, folder, manifest = _text_cache(data)
    if manifest.get("truncated"):
        warn_once(folder, "truncated",
                  "%s ends inside a quoted field: it looks truncated (an interrupted download?). Its last row is "
                  "incomplete; download it again.", source.what)  # fmt: skip
    skipped = sum(manifest["skipped"].values())
    if skipped:
        per_split = ", ".join(f"{name} {n}" for name, n in manifest["skipped"].items() if n)
        warn_once(folder, "skipped", "%s: skipped %d rows whose text or target is empty (%s)", source.what,
                  skipped, per_split)  # fmt: skip
    if split not in manifest["origin"]:  # WikiHow has every split
        raise DataError(f"no {split} split in {source.what}: {source.add_split.format(split=split)}.")
    if manifest["rows"][split] == 0:
        if "rows_read" in manifest:  # WikiHow
            raise DataError(
                f"{source.what} yields no usable rows for split {split!r}: {manifest['rows_read']} rows of 3 "
                f"fields, {manifest['rows_clean']} passed the builder's filter, none of them in "
                f"{manifest['origin'][split]}."
            )
        held_out = "held out" in manifest["origin"][split]
        fix = "Give it rows, or train at least 2 rows to hold 1 out." if held_out else "Give it rows."
        raise DataError(
            f"the {split} split of {source.what} is empty ({manifest['origin'][split]}; "
            f"{manifest['skipped'][split]} rows with an empty text or target skipped). {fix}"
        )
    rows = datasets.Dataset.from_file(str(folder / f"{split}.arrow"))
    if whole_train and split == "train" and "held out" in manifest["origin"].get("validation", ""):
        folder = _with_held_out_rows(rows, folder, data, source.what)  # its token ids are keyed by it
        rows = datasets.Dataset.from_file(str(folder / "train.arrow"))
    # Conversations (sources.ChatPrompt) are rendered by the tokenizer's chat template, not cleaned.
    return CachedSplit(rows, folder, "chat" if manifest.get("chat") else source.cleaning, source.what)


def _with_held_out_rows(train: datasets.Dataset, folder: Path, data: DataConfig, what: str) -> Path:
    """The folder of train's rows in the source's order (its train.arrow), those held out for validation
    (sources.held_out_positions: the same draw, from the same count) back in their places: written once per
    machine beside the text cache `folder`, as the token ids are."""
    key = {"text_cache": folder.name, "rows": WHOLE_TRAIN}

    def build(out: Path) -> dict:
        held = datasets.Dataset.from_file(str(folder / "validation.arrow"))
        count = len(train) + len(held)
        is_held = np.zeros(count, dtype=bool)
        held_out = sources.held_out_positions(count, data.validation_split_percentage, data.validation_split_seed)
        is_held[held_out] = True
        order = np.empty(count, dtype=np.int64)
        order[~is_held] = np.arange(len(train))
        order[is_held] = len(train) + np.arange(len(held))
        rows = datasets.concatenate_datasets([train, held]).select(order, keep_in_memory=True)
        rows.flatten_indices(
            cache_file_name=str(out / "train.arrow"), new_fingerprint=out.name.split(".partial")[0]
        )
        return {}

    root = folder.parent
    if not data.cache_dir:  # beside the text cache, unless that cannot be written and lacks these rows
        root = usable_cache_root(root, lambda root: is_built(root, "rows", key))
    return shared_folder(root, "rows", key, build, f"the train rows of {what} with those held out")[0]


def load_wikihow(data_dir: str | os.PathLike, split: str, cache_dir: str | os.PathLike = "") -> datasets.Dataset:
    """One split of WikiHow 'all' as the original builder makes it: columns title, headline, text, in the
    order of the CSV; memory-mapped from the cache under `cache_dir` (default <data_dir>/cache)."""
    cached = cached_split(DataConfig(data_dir=str(data_dir), cache_dir=str(cache_dir)), split)
    builder_names = cached.rows.rename_columns({"id": "title", "source": "text", "target": "headline"})
    return builder_names.select_columns(["title", "headline", "text"])


def tokenizer_fingerprint(tokenizer) -> str:
    """What makes two tokenizers give the same ids: a fast tokenizer's definition (vocabulary, normaliser,
    special tokens; not the truncation and padding state that each call sets), else datasets' hash of it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return Hasher.hash(tokenizer)
    definition = json.loads(backend.to_str())
    for per_call_state in ("truncation", "padding"):
        definition.pop(per_call_state, None)
    text = json.dumps([type(tokenizer).__name__, definition], sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _encode_batch(
    batch: dict, tokenizer, clean: Callable[[str], str], source_prefix: str, input_length: int, output_length: int
) -> dict:
    """Token ids of a batch of rows: the source is the prefix and the cleaned text, the target the cleaned
    target. The tokenizer is called directly: transformers 5 removed batch_encode_plus (docs/pitfalls.md #9).
    T5's tokenizer appends </s> itself, also after truncation."""
    sources = [source_prefix + clean(text) for text in batch["source"]]
    targets = [clean(target) for target in batch["target"]]
    return {
        "source_ids": tokenizer(sources, max_length=input_length, truncation=True)["input_ids"],
        "target_ids": tokenizer(targets, max_length=output_length, truncation=True)["input_ids"],
    }


def _encode_causal_batch(
    batch: dict, tokenizer, clean: Callable[[str], str], source_prefix: str, input_length: int, output_length: int,
    chat: bool = False, row_length: int | None = None,
) -> dict:  # fmt: skip
    """Token ids of a batch of rows for a decoder-only model, which reads the two as one sequence: the prompt
    (the prefix and the cleaned text) as the tokenizer starts a text (Llama: <s> first; GPT-2: nothing), cut
    on the left, the completion (the cleaned target, cut on the right) with no start token and the
    end-of-sequence token after it, also after
    truncation: the model learns where a completion ends. A tokenizer that ends every text with its EOS has
    it taken off the prompt. Conversations (`chat`): _encode_chat_batch. With `row_length` the two together are
    at most that long (_row_cuts), and each row's cuts are kept (prompt_cut, reply_cut); without, each is cut
    alone to its length (the encoding before rows were bounded, CAUSAL_ENCODING_BY_LENGTHS)."""
    if chat:
        return _encode_chat_batch(batch, tokenizer, input_length, output_length, row_length)
    eos = tokenizer.eos_token_id
    if row_length is not None:
        # Whole, then bounded here (verbose: no warning of texts longer than the model's positions, which they
        # are not once cut)
        prompts = tokenizer([source_prefix + clean(text) for text in batch["source"]], verbose=False)["input_ids"]
        targets = [clean(target) for target in batch["target"]]
        completions = tokenizer(targets, add_special_tokens=False, verbose=False)["input_ids"]
        encoded = {"source_ids": [], "target_ids": [], "prompt_cut": [], "reply_cut": []}
        for prompt, completion in zip(prompts, completions, strict=True):
            prompt = prompt[:-1] if len(prompt) > 1 and prompt[-1] == eos else prompt
            head, prompt_cut, reply_cut = _row_cuts(
                tokenizer, prompt, len(completion) + 1, input_length, output_length, row_length
            )
            encoded["source_ids"].append(_cut_start(prompt, head, prompt_cut))
            encoded["target_ids"].append(_cut_end([*completion, eos], reply_cut, 1))
            encoded["prompt_cut"].append(prompt_cut)
            encoded["reply_cut"].append(reply_cut)
        return encoded
    # A long prompt loses its start, not its end, where its cue to the completion is (the start token stays).
    side, tokenizer.truncation_side = tokenizer.truncation_side, "left"
    try:
        prompts = tokenizer([source_prefix + clean(text) for text in batch["source"]], max_length=input_length,
                            truncation=True)["input_ids"]  # fmt: skip
    finally:
        tokenizer.truncation_side = side
    prompts = [ids[:-1] if len(ids) > 1 and ids[-1] == eos else ids for ids in prompts]
    completions = tokenizer([clean(target) for target in batch["target"]], add_special_tokens=False,
                            max_length=output_length - 1, truncation=True)["input_ids"]  # fmt: skip
    return {"source_ids": prompts, "target_ids": [ids + [eos] for ids in completions]}


def _row_cuts(
    tokenizer, prompt: list[int], reply_length: int, prompt_limit: int, reply_limit: int, row_length: int
) -> tuple[int, int, int]:  # fmt: skip
    """(the prompt's start tokens that stay, the prompt tokens cut after them, the reply tokens cut before its
    end of turn) that bound a decoder-only row: its prompt to `prompt_limit` tokens, its reply to
    `reply_limit` (a Dataset's own lengths; a run's are the row's), and the two together to `row_length`. A row
    too long loses its prompt's start first (the latest turns and the cue stay), down to the start token and
    the prompt's last token; then its reply's end. The start token (a text's <s>, where the tokenizer or the
    template writes one) stays."""
    head = int(bool(prompt) and tokenizer.bos_token_id is not None and prompt[0] == tokenizer.bos_token_id)
    prompt_cut = max(len(prompt) - max(prompt_limit, head), 0)
    reply_cut = max(reply_length - reply_limit, 0)
    excess = len(prompt) - prompt_cut + reply_length - reply_cut - row_length
    if excess > 0:
        more = min(excess, max(len(prompt) - prompt_cut - min(len(prompt), head + 1), 0))
        prompt_cut, reply_cut = prompt_cut + more, reply_cut + excess - more
    return head, prompt_cut, min(reply_cut, reply_length)


def _cut_start(ids: list, head: int, cut: int) -> list:
    """`ids` less the `cut` after its first `head` (a prompt's start token stays)."""
    return ids[:head] + ids[head + cut :]


def _cut_end(ids: list, cut: int, closing: int) -> list:
    """`ids` less the `cut` before its last `closing` (a reply's end of turn stays)."""
    if not cut:
        return ids
    closing = min(closing, len(ids) - cut)
    return ids[: len(ids) - cut - closing] + ids[len(ids) - closing :]


def _encode_chat_batch(
    batch: dict, tokenizer, input_length: int, output_length: int, row_length: int | None = None
) -> dict:
    """Token ids of a batch of conversations (sources.ChatPrompt: the messages before the reply, as JSON; the
    reply): the prompt is the conversation rendered by the tokenizer's chat template up to the assistant's turn
    (add_generation_prompt), the completion what the template adds for the reply (its end-of-turn marker
    included, also when the reply is cut): the tokens of the whole conversation after the
    prompt's own tokens, which they must start with (generation continues those). The prompt's earlier
    assistant replies are marked (_earlier_replies). Tokenised without added special tokens (the template
    writes them); the prompt cut on the left. A template that renders nothing of the reply, or renders the
    conversation's start differently with it, is refused: the loss would be on no token, or on the wrong ones.
    With `row_length` the row is bounded as a whole (_row_cuts) and its cuts counted; without, the prompt and
    the reply are each cut to their length."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "the data's rows are conversations (a messages column), and the model's tokenizer has no chat "
            "template to render them: use a chat model's tokenizer (-chat, -Instruct) or set its chat_template"
        )
    prompts, completions, replies, unmarked, unknown_roles, prompt_cuts, reply_cuts = [], [], [], [], [], [], []
    for history, reply in zip(batch["source"], batch["target"], strict=True):
        messages = json.loads(history)
        unknown = [message for message in messages if message["role"] not in KNOWN_ROLES]
        rendered = _rendered_reply(tokenizer, messages, reply)
        if rendered is None:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            raise ConfigError(
                "the tokenizer's chat template renders a conversation's start differently with its reply than "
                f"without, or leaves the reply out (the prompt ends {prompt[-60:]!r}): the reply's tokens, which "
                "the loss is on and generation writes, cannot be told apart. Use a template that renders each "
                "turn the same whatever follows it."
            )
        prompt, added = rendered
        _check_rendered(unknown, prompt)
        # A slow (Python) tokenizer has no character offsets: its earlier replies stay unmarked (_earlier_replies)
        encoded = tokenizer(
            prompt, add_special_tokens=False, return_offsets_mapping=getattr(tokenizer, "is_fast", False)
        )
        prompt_ids = encoded["input_ids"]
        whole_ids = tokenizer(prompt + added, add_special_tokens=False)["input_ids"]
        if whole_ids[: len(prompt_ids)] != prompt_ids:
            raise ConfigError(
                f"the tokenizer reads a conversation's prompt ({prompt[-60:]!r}) into other tokens when its reply "
                "follows: generation, which continues the prompt's own tokens, would not continue what training "
                "saw. Use a chat template that ends the assistant's turn marker with a separator."
            )
        reply_ids = whole_ids[len(prompt_ids) :]
        marks, missed = _earlier_replies(
            tokenizer, messages, prompt, len(prompt_ids), encoded.get("offset_mapping")
        )
        if row_length is not None:
            head, prompt_cut, reply_cut = _row_cuts(
                tokenizer, prompt_ids, len(reply_ids), input_length, output_length, row_length
            )
            # A cut reply keeps what the template ends the turn with (worked out only where one is cut)
            closing = _closing_length(tokenizer, prompt, added, reply, whole_ids) if reply_cut else 0
            prompt_ids, marks = _cut_start(prompt_ids, head, prompt_cut), _cut_start(marks, head, prompt_cut)
            reply_ids = _cut_end(reply_ids, reply_cut, closing)
            prompt_cuts.append(prompt_cut)
            reply_cuts.append(reply_cut)
        else:
            if len(reply_ids) > output_length:  # cut, keeping what the template ends the turn with
                closing = min(_closing_length(tokenizer, prompt, added, reply, whole_ids), output_length)
                reply_ids = reply_ids[: output_length - closing] + reply_ids[len(reply_ids) - closing :]
            prompt_ids, marks = prompt_ids[-input_length:], marks[-input_length:]
        prompts.append(prompt_ids)
        completions.append(reply_ids)
        replies.append(marks)
        unmarked.append(missed)
        unknown_roles.append([message["role"] for message in unknown])
    cuts = {"prompt_cut": prompt_cuts, "reply_cut": reply_cuts} if row_length is not None else {}
    return {
        "source_ids": prompts,
        "target_ids": completions,
        "source_replies": replies,
        "replies_unmarked": unmarked,
        "unknown_roles": unknown_roles,
        **cuts,
    }


def _check_rendered(unknown: list[dict], prompt: str) -> None:
    """Refuse a conversation whose messages of an unknown role the chat template left out of its rendering (a
    template with a rule for each known role, and none for others): the model would not read what the data
    says. A message whose content is no text (a tool call) is not looked for."""
    for message in unknown:
        content = message["content"]
        if isinstance(content, str) and content.strip() not in prompt:
            raise DataError(
                f"the tokenizer's chat template leaves out a message of role {message['role']!r} (its text is not "
                f"in the rendered conversation, which ends {prompt[-60:]!r}). Give it one of the roles the "
                f"template renders (the chat formats' are {', '.join(KNOWN_ROLES)}), or use a template that "
                "renders it."
            )


def _closing_length(tokenizer, prompt: str, added: str, reply: str, whole_ids: list[int]) -> int:
    """How many of the conversation's tokens (`whole_ids`) the template writes after the reply's text: its
    end-of-turn marker and what follows it (ChatML's `<|im_end|>` and a newline). At least 1 (the last token),
    also where the text before the closing reads into other tokens without it."""
    text = reply.strip()
    head = tokenizer(prompt + added[: added.rindex(text) + len(text)], add_special_tokens=False)["input_ids"]
    return max(len(whole_ids) - len(head), 1) if whole_ids[: len(head)] == head else 1


def _rendered_reply(tokenizer, messages: list[dict], reply: str) -> tuple[str, str] | None:
    """(`messages` rendered up to the assistant's turn, the text the template adds for `reply` after them: its
    end-of-turn marker included), or None where the template renders the start differently with the reply
    than without, or leaves the reply out. A template's own refusal (its raise_exception) is refused."""
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        whole = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": reply}], tokenize=False)
    except TemplateError as err:
        unknown = [message["role"] for message in messages if message["role"] not in KNOWN_ROLES]
        roles = f" (its message of role {unknown[0]!r}?)" if unknown else ""
        raise DataError(
            f"the tokenizer's chat template refuses a conversation{roles}: {err}. Give its messages the roles "
            f"the template renders (the chat formats' are {', '.join(KNOWN_ROLES)}), or use a template that "
            "renders them."
        ) from None
    if not whole.startswith(prompt) or reply.strip() not in whole[len(prompt) :]:
        return None
    return prompt, whole[len(prompt) :]


def _earlier_replies(
    tokenizer, messages: list[dict], prompt: str, length: int, offsets: list[tuple[int, int]] | None
) -> tuple[list[int], int]:
    """(1 on each of the prompt's `length` tokens that belongs to an assistant reply before the last, else 0;
    the number of such replies left unmarked). With --completion_only_loss every reply is trained on, as TRL's
    assistant_only_loss does: each found as the last one is (_rendered_reply), its tokens those that start
    inside its characters (`offsets`: each prompt token's, in order; a whitespace token whose offsets are
    trimmed to nothing included). A reply is left unmarked (part of the prompt, not trained on) where the
    template renders it differently once the conversation goes on, a token straddles its edges, its content is
    not a text (a tool call), or the tokenizer gives no offsets (None: a slow one). The conversation's first
    message is no reply to anything, and is not marked."""
    spans, missed = [], 0
    for turn, message in enumerate(messages):
        if turn == 0 or message["role"] != "assistant":
            continue
        content = message["content"]
        rendered = _rendered_reply(tokenizer, messages[:turn], content) if isinstance(content, str) else None
        if rendered is None or not prompt.startswith(rendered[0] + rendered[1]):
            missed += 1
            continue
        spans.append((len(rendered[0]), len(rendered[0]) + len(rendered[1])))
    marked = [0] * length
    if offsets is None:
        return marked, missed + len(spans)
    starts = [start for start, _ in offsets]
    for start, end in spans:
        first, last = bisect.bisect_left(starts, start), bisect.bisect_left(starts, end)
        before, final = offsets[first - 1] if first else (0, 0), offsets[last - 1] if last else (0, 0)
        if first == last or before[1] > start or final[1] > end:  # nothing inside, or a token across an edge
            missed += 1
            continue
        marked[first:last] = [1] * (last - first)
    return marked, missed


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How a row becomes token ids (a Dataset class's `encoding`), and what its token cache's key says of it."""

    name: str
    encode: Callable  # a batch of rows -> their token ids
    version: int | str  # the key's "encoding"
    adds_special_ids: bool = False  # the tokenizer's start and end ids, added by the encoding itself
    renders_chat: bool = False  # conversations, rendered by the tokenizer's chat template (_encode_chat_batch)
    bounds_rows: bool = False  # a row within --max_seq_len as a whole (_row_cuts), each row's cuts kept


# An encoder-decoder's source and target apart (its caches keep the key they had before a second encoding
# existed), or a decoder-only model's prompt and completion: each row within --max_seq_len, or (runs started
# before rows were bounded, which resume with it: resumed_encoding) its prompt within --max_source_length and its
# completion within --max_target_length, apart.
SEQ2SEQ_ENCODING = Encoding("seq2seq", _encode_batch, ENCODING_VERSION)
CAUSAL_ENCODING = Encoding(
    "causal", _encode_causal_batch, f"{ENCODING_VERSION}-causal-rows", adds_special_ids=True, renders_chat=True,
    bounds_rows=True,
)  # fmt: skip
CAUSAL_ENCODING_BY_LENGTHS = Encoding(
    "causal", _encode_causal_batch, f"{ENCODING_VERSION}-causal", adds_special_ids=True, renders_chat=True
)
ENCODINGS = {each.version: each for each in (SEQ2SEQ_ENCODING, CAUSAL_ENCODING, CAUSAL_ENCODING_BY_LENGTHS)}
# What a checkpoint that recorded no encoding (written before checkpoints recorded it) was read with, by kind.
UNRECORDED_ENCODINGS = {"seq2seq": SEQ2SEQ_ENCODING, "causal": CAUSAL_ENCODING_BY_LENGTHS}


def resumed_encoding(recorded: int | str | None, kind: Encoding) -> Encoding:
    """The encoding a run resumed from a checkpoint reads its rows with, so that its data position stays exact:
    the one its checkpoint recorded (`recorded`), or where it recorded none, the one of `kind`'s name that the
    package had then. A version this one does not know is refused."""
    if recorded is None:
        return UNRECORDED_ENCODINGS[kind.name]
    if recorded not in ENCODINGS or ENCODINGS[recorded].name != kind.name:
        raise ConfigError(
            f"the checkpoint's rows were tokenised by the encoding {recorded!r}, which this version of the "
            f"package does not have for a {kind.name} model: resume it with the version that wrote it, or start a "
            "new run"
        )
    return ENCODINGS[recorded]


def _tokenising_processes(rows: int) -> int | None:
    """Worker processes for tokenising `rows` articles: one per _ROWS_PER_TOKENISING_PROCESS, at most one per
    CPU this process may use; None (in this process) below two. The fast tokenizer already encodes a batch
    on several threads, but the cleaning and the Arrow conversion around it are Python, one core each: on
    2 CPUs, two processes tokenise 152k articles in 95 s instead of 113 s."""
    processes = min(usable_cpus(), rows // _ROWS_PER_TOKENISING_PROCESS, _MAX_TOKENISING_PROCESSES)
    return processes if processes >= 2 else None


def _write_token_cache(
    rows: datasets.Dataset, split: str, encode: functools.partial, features: datasets.Features, folder: Path
) -> dict:
    rows.map(
        encode,
        batched=True,
        batch_size=1000,
        num_proc=_tokenising_processes(len(rows)),
        remove_columns=rows.column_names,
        features=features,
        cache_file_name=str(folder / "ids.arrow"),  # with worker processes: ids_0000i_of_0000n.arrow
        load_from_cache_file=False,
        new_fingerprint=folder.name.split(".partial")[0],  # the cache is this folder, not datasets' own
        desc=f"Tokenising {len(rows)} {split} rows",
    )
    return {}


def unknown_token_counts(ids: datasets.Dataset, unk_id: int | None) -> dict:
    """How many source and target tokens of `ids` (a split's token ids, the rows a run reads) are the
    tokenizer's unknown token, how many rows hold one, and the first such row (text the tokenizer cannot read:
    the wrong model for the language, say). Chunk by chunk: a column's chunks stay as the cache holds them."""
    counts = {"source": 0, "target": 0, "source_total": 0, "target_total": 0, "rows": 0, "first_row": None,
              "rows_total": len(ids)}  # fmt: skip
    holding = np.zeros(len(ids), dtype=bool)
    for side in ("source", "target"):
        start = 0
        for chunk in ids.data.column(f"{side}_ids").chunks:
            flat = chunk.flatten().to_numpy(zero_copy_only=False)
            counts[f"{side}_total"] += len(flat)
            if unk_id is not None and len(flat):
                hits = np.flatnonzero(flat == unk_id)
                counts[side] += len(hits)
                offsets = chunk.offsets.to_numpy()  # a slice's start at offsets[0], not 0
                rows_hit = np.searchsorted(offsets - offsets[0], hits, side="right") - 1
                holding[start + rows_hit] = True
            start += len(chunk)
    counts["rows"] = int(holding.sum())
    counts["first_row"] = int(holding.argmax()) if holding.any() else None
    return counts


def _cached_token_ids(
    rows: datasets.Dataset, cached: CachedSplit, split: str, tokenizer, data: DataConfig, input_length: int,
    output_length: int, encoding: Encoding,
) -> datasets.Dataset:  # fmt: skip
    """Token ids (unpadded, int32) of `rows`, the first rows of a split, from the token cache: tokenised once
    per machine, and reused by every epoch, every rank and every later run with the same text cache (the
    source's files, columns and split), tokenizer, lengths and prefix. A cache of more rows (a run that used
    more of them) serves too. Where the text cache's folder cannot be written and lacks these ids, they go to
    this user's cache (usable_cache_root)."""
    key = {
        "text_cache": cached.cache.name,
        "split": split,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "truncation_side": getattr(tokenizer, "truncation_side", "right"),
        "source_prefix": data.source_prefix,
        "input_length": input_length,
        "output_length": output_length,
        "encoding": encoding.version,
    }
    if encoding.adds_special_ids:  # the ids it adds itself, which the tokenizer's definition may not name
        key["special_ids"] = [tokenizer.bos_token_id, tokenizer.eos_token_id]
    bound = {"row_length": seq_len(data)} if encoding.bounds_rows else {}
    key.update(bound)
    if cached.cleaning == "chat":  # conversations are rendered by it (_encode_chat_batch)
        key["chat_template"] = getattr(tokenizer, "chat_template", None)
        key["chat_encoding"] = CHAT_ENCODING_VERSION

    def larger_cache(root: Path) -> tuple[Path, dict] | None:
        for folder, manifest in complete_folders(root, "tokens"):
            saved = dict(manifest["key"])
            # A folder written by another version of this key (no row count) never matches.
            if saved.pop("rows", -1) > len(rows) and saved == key:
                return folder, manifest
        return None

    sized_key = {**key, "rows": len(rows)}
    root = cached.cache.parent
    if not data.cache_dir:  # beside the text cache, unless that cannot be written and lacks these ids
        root = usable_cache_root(
            root, lambda root: is_built(root, "tokens", sized_key) or larger_cache(root) is not None
        )

    encode = functools.partial(
        encoding.encode, tokenizer=tokenizer, clean=CLEANINGS[cached.cleaning],
        source_prefix=data.source_prefix, input_length=input_length, output_length=output_length,
        **({"chat": True} if cached.cleaning == "chat" else {}), **bound,
    )  # fmt: skip
    features = _CHAT_TOKEN_FEATURES if cached.cleaning == "chat" else _TOKEN_FEATURES
    if bound:
        features = datasets.Features({**features, **_CUT_FEATURES})
    build = functools.partial(_write_token_cache, rows, split, encode, features)
    what = f"the token ids of {len(rows)} {split} rows"
    reuse = functools.partial(larger_cache, root)
    folder, manifest = shared_folder(root, "tokens", sized_key, build, what, reuse=reuse)
    parts = [datasets.Dataset.from_file(str(folder / part)) for part in sorted(manifest["files"])]
    return datasets.concatenate_datasets(parts).select(range(len(rows)))


@dataclasses.dataclass(frozen=True)
class SplitRows:
    """The first rows of a split, as a Dataset reads its items: the texts and their token ids, both
    memory-mapped from the caches."""

    split: str
    lengths: tuple[int, int]  # the input and output lengths the ids are truncated to
    encoding: Encoding  # how they were tokenised
    rows: datasets.Dataset  # id, source, target
    token_ids: datasets.Dataset  # source_ids, target_ids: unpadded, int32 (conversations: source_replies)
    split_rows: int  # the whole split's, before the selection
    what: str  # the source, for messages
    cleaning: str  # how a text is prepared (CLEANINGS)


def split_rows(
    tokenizer, split: str, num_samples: int | None, input_length: int, output_length: int, data: DataConfig,
    encoding: Encoding = SEQ2SEQ_ENCODING, whole_train: bool = False,
) -> SplitRows:  # fmt: skip
    """The first `num_samples` rows of `split` (None, or more than it has: all) of the run's source, with
    their token ids tokenised as `encoding` says: each cache built first where it is missing. `whole_train`:
    train with its held-out validation rows (cached_split)."""
    if num_samples is not None and num_samples < 1:
        raise ConfigError(f"num_samples must be None (all) or at least 1, got {num_samples}.")
    for name, length in (("input_length", input_length), ("output_length", output_length)):
        if length < 1:
            raise ConfigError(f"{name} must be at least 1, got {length}.")
    cached = cached_split(data, split, whole_train)
    if cached.cleaning == "chat" and data.source_prefix:
        raise ConfigError(
            f"--source_prefix {data.source_prefix!r}: {cached.what} holds conversations, which the tokenizer's "
            "chat template renders whole; put what the prefix says in a system message, or drop it"
        )
    if cached.cleaning == "chat" and not encoding.renders_chat:
        raise ConfigError(
            f"{cached.what} holds conversations (a messages column), which a decoder-only model's chat template "
            "renders; an encoder-decoder reads a source and a target: give --text_column and --summary_column"
        )
    rows = cached.rows
    if num_samples is not None and num_samples < len(rows):
        rows = rows.select(range(num_samples))  # a slice of the memory-mapped table, not a copy
    token_ids = _cached_token_ids(rows, cached, split, tokenizer, data, input_length, output_length, encoding)
    return SplitRows(
        split=split, lengths=(input_length, output_length), encoding=encoding, rows=rows, token_ids=token_ids,
        split_rows=len(cached.rows), what=cached.what, cleaning=cached.cleaning,
    )  # fmt: skip
