"""HF's flag names, as users of `run_summarization.py`, `Seq2SeqTrainer`, the Llama 2 guide's training script and
TRL's `SFTTrainer` type them, turned into this package's flags before the flags are parsed (configs/cli.py).

A name with a meaning here becomes its flag, with one line saying so (`--learning_rate 3e-4 -> --lr 3e-4`);
HF's boolean spellings (`--bf16`, `--bf16 True`) work. A name with no meaning here (`--do_train`,
`--predict_with_generate`) is left out with one line saying what the package does instead. The same names
work as keys of a --config file. docs/configuration.md's table is `markdown()`.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from configs.errors import ConfigError

HF_BOOLEANS = {"true": "true", "1": "true", "yes": "true", "false": "false", "0": "false", "no": "false"}


@dataclass(frozen=True)
class HFName:
    """One HF name: the flags it becomes, from its value (None: it takes no value here and is left out)."""

    becomes: Callable[[str], list[tuple[str, str]]] | None
    takes: str  # "value", "boolean" (alone means true) or "values" (one or more)
    meaning: str  # docs/configuration.md's cell: what it became, or what the package does instead
    why: str = ""  # said after what it became, where the flag is not the same thing under another name


def renamed(field: str, note: str = "") -> HFName:
    return HFName(lambda value: [(field, value)], "value", f"`--{field}`{note}")


def is_a_share(text: str) -> bool:
    """Whether a step count's text is HF 5's share of the run's steps (a number below 1). Text that is no number
    is not: the flag's own parser says what is wrong with it."""
    try:
        return 0 < float(text) < 1
    except ValueError:
        return False


def step_count(name: str, field: str, note: str = "") -> HFName:
    """An HF name for a number of steps, which HF 5 also takes as a share of the run (a number below 1): refused
    as such, naming the flag that counts steps here."""

    def becomes(value: str) -> list[tuple[str, str]]:
        if is_a_share(value):
            raise ConfigError(
                f"--{name} {value}: HF reads a number below 1 as a share of the run's steps; this package counts "
                f"steps: give --{field} N"
            )
        return [(field, value)]

    return HFName(becomes, "value", f"`--{field}`{note}")


def boolean(*fields: str) -> HFName:
    return HFName(lambda value: [(field, value) for field in fields], "boolean",
                  " and ".join(f"`--{field}`" for field in fields))  # fmt: skip


def left_out(instead: str, takes: str) -> HFName:
    return HFName(None, takes, instead)


def whole_epochs(value: str) -> list[tuple[str, str]]:
    try:
        epochs = float(value)
    except ValueError:
        raise ConfigError(f"--num_train_epochs {value}: not a number") from None
    if not math.isfinite(epochs) or epochs != int(epochs):
        raise ConfigError(
            f"--num_train_epochs {value}: this package trains whole epochs (--epochs); for part of one give "
            "--max_steps (optimizer steps)"
        )
    return [("epochs", str(int(epochs)))]


SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}


def scheduler(value: str) -> list[tuple[str, str]]:
    if value not in SCHEDULERS:
        raise ConfigError(
            f"--lr_scheduler_type {value}: this package's schedules are linear, cosine and constant (with "
            "--warmup_steps or --warmup_ratio), and the tutorial's step (--lr_scheduler step, --gamma)"
        )
    return [("lr_scheduler", SCHEDULERS[value])]


TRACKERS = ("tensorboard", "wandb", "mlflow")


def trackers(values: str) -> list[tuple[str, str]]:
    chosen = set(values.replace(",", " ").split())
    unknown = chosen - {*TRACKERS, "none"}
    if unknown:
        raise ConfigError(
            f"--report_to {values}: this package reports to {', '.join(TRACKERS)} (or none); "
            f"{', '.join(sorted(unknown))} is not one"
        )
    return [(tracker, "true" if tracker in chosen else "false") for tracker in TRACKERS]


def whole_number_limit(value: str) -> list[tuple[str, str]]:
    if value.strip() in ("0", "None"):
        raise ConfigError(
            f"--save_total_limit {value}: HF keeps every checkpoint then; this package keeps the newest "
            "--keep_last_n (0 writes none): give the number to keep"
        )
    return [("keep_last_n", value)]


def flash_attention(value: str) -> list[tuple[str, str]]:
    """The guide's --use_flash_attn patched Llama's attention with flash-attention 2; torch's SDPA holds the same
    kernel (and runs on a CPU too)."""
    return [("attn_implementation", "sdpa" if value == "true" else "eager")]


def strategy(name: str, field: str, off: str) -> Callable[[str], list[tuple[str, str]]]:
    """HF's --*_strategy: `no` switches the package's own off (`field` `off`); epoch and steps are its ways
    already (every epoch; with steps, --eval_steps/--save_steps add step-wise ones, which epoch and no leave
    out: steps_a_strategy_ignores)."""

    def becomes(value: str) -> list[tuple[str, str]]:
        if value == "no":
            return [(field, off)]
        if value in ("epoch", "steps"):
            return []
        raise ConfigError(f"--{name} {value}: HF's strategies are no, steps and epoch")

    return becomes


def switch(field: str, on: str, off: str) -> Callable[[str], list[tuple[str, str]]]:
    """An HF boolean that chooses between two values of one of this package's flags (--use_peft_lora: --peft)."""
    return lambda value: [(field, on if value == "true" else off)]


def padding_free(value: str) -> list[tuple[str, str]]:
    """TRL's padding-free batches (rows end to end, kept apart by their position ids) are documents packing here;
    false, TRL's default, asks for nothing."""
    return [("packing", "true")] if value == "true" else []


def assistant_only_loss(value: str) -> list[tuple[str, str]]:
    """TRL's --assistant_only_loss: true is --completion_only_loss true; false, its default, still trains a
    prompt's completion alone in TRL (its own --completion_only_loss), so it asks for nothing."""
    return [("completion_only_loss", "true")] if value == "true" else []


SPLIT_NAMES = ("train", "validation", "test")  # the splits a source has here (utils/data/sources.py)


def trained_split(value: str) -> list[tuple[str, str]]:
    """TRL's --dataset_train_split: train is the split trained on here; no other can be chosen by name."""
    if value != "train":
        raise ConfigError(
            f"--dataset_train_split {value}: this package trains on the split named train and cannot choose "
            "another by name: give that split's file as --train_file"
        )
    return []


def evaluated_split(value: str) -> list[tuple[str, str]]:
    """TRL's --dataset_test_split: the split evaluated, by the names the splits have here."""
    if value not in SPLIT_NAMES:
        raise ConfigError(
            f"--dataset_test_split {value}: the splits here are named {', '.join(SPLIT_NAMES)}; give that "
            "split's file as --test_file and --dataset_test_split test"
        )
    return [("eval_split", value)]


# QLoRA's switches (the Llama 2 guide's, then TRL's) and the settings only read beside one at true.
QUANTIZATION_SWITCHES = ("use_4bit_quantization", "use_8bit_quantization", "load_in_4bit", "load_in_8bit")
QUANTIZATION_SETTINGS = (
    "use_nested_quant", "bnb_4bit_compute_dtype", "bnb_4bit_quant_type", "bnb_4bit_quant_storage_dtype",
    "use_bnb_nested_quant",
)  # fmt: skip
NOT_QUANTIZED = "false: as here (the model is not quantized); true: refused (no QLoRA here)"
ONLY_QUANTIZED = "read beside a quantization switch at true only, which is refused here"
NON_REENTRANT = (
    "activation checkpointing here (`--fsdp_activation_checkpointing`) is always non-reentrant, the form that "
    "works with FSDP's hooks"
)


HF_NAMES = {
    # TrainingArguments / Seq2SeqTrainingArguments
    "per_device_train_batch_size": renamed("batch_size_training"),
    "per_device_eval_batch_size": renamed("val_batch_size"),
    "learning_rate": renamed("lr"),
    "num_train_epochs": HFName(whole_epochs, "value", "`--epochs` (whole epochs; --max_steps for fewer)"),
    "lr_scheduler_type": HFName(
        scheduler, "value", "`--lr_scheduler` (linear, cosine, constant; constant_with_warmup: constant)"
    ),  # fmt: skip
    "logging_steps": step_count("logging_steps", "log_every_n_steps"),
    "eval_steps": step_count(
        "eval_steps", "eval_every_n_steps", " (left out beside --eval_strategy epoch or no, as HF leaves it)"
    ),
    "save_steps": step_count(
        "save_steps", "save_every_n_steps", " (left out beside --save_strategy epoch or no, as HF leaves it)"
    ),
    "save_total_limit": HFName(whole_number_limit, "value", "`--keep_last_n` (0 here writes no checkpoints)"),
    "resume_from_checkpoint": renamed("resume"),
    "dataloader_num_workers": renamed("num_workers_dataloader"),
    "gradient_checkpointing": boolean("fsdp_activation_checkpointing"),
    "bf16": HFName(None, "boolean", "`--mixed_precision` (with --fp16: one of the two)"),
    "fp16": HFName(None, "boolean", "`--mixed_precision` and `--use_fp16` (fp16 with the gradient scaler)"),
    "report_to": HFName(trackers, "values", "`--tensorboard`, `--wandb`, `--mlflow`: true if named, false if not"),
    "run_name": renamed("tracker_run_name"),
    "generation_num_beams": renamed("num_beams"),
    "generation_max_length": renamed(
        "max_new_tokens",
        " (the tokens generated; HF's length also counts an encoder-decoder's start token, a decoder-only "
        "model's prompt)",
    ),
    "do_train": HFName(
        None,
        "boolean",
        "none needed: a run trains (False, with --do_eval or --do_predict: `--evaluate_only true`)",
    ),  # fmt: skip
    "do_eval": HFName(
        None,
        "boolean",
        "none needed: validation runs after every epoch; without --do_train: `--evaluate_only true`",
    ),  # fmt: skip
    "do_predict": HFName(None, "boolean", "without --do_train: `--evaluate_only true --eval_split test`"),
    "predict_with_generate": left_out(
        "none needed: validation generates and scores summaries (--eval_rouge true, the default)", "boolean"
    ),  # fmt: skip
    "overwrite_output_dir": left_out(
        "not done: a run never overwrites one; an --output_dir holding a run is refused: continue it with "
        "--resume true, or give another --output_dir for a new run",
        "boolean",
    ),
    "eval_strategy": HFName(
        strategy("eval_strategy", "run_validation", "false"),
        "value",
        "no: `--run_validation false`; epoch: as here (every epoch; --eval_steps left out); steps: as here, "
        "--eval_steps N adds steps",
    ),
    "evaluation_strategy": HFName(
        strategy("evaluation_strategy", "run_validation", "false"), "value", "as --eval_strategy"
    ),
    "save_strategy": HFName(
        strategy("save_strategy", "keep_last_n", "0"),
        "value",
        "no: `--keep_last_n 0`; epoch: as here (every epoch; --save_steps left out); steps: as here, "
        "--save_steps N adds steps",
    ),
    "logging_strategy": left_out("a step line every --log_every_n_steps steps", "value"),
    "save_only_model": HFName(
        switch("save_optimizer", "false", "true"),
        "boolean",
        "true: `--save_optimizer false` (checkpoints without the optimizer's state, which an exact resume needs)",
    ),
    "eval_accumulation_steps": left_out(
        "none needed: evaluation holds no logits past their batch (losses summed as they come; generation keeps "
        "its outputs' text)",
        "value",
    ),
    # run_summarization.py's arguments
    "model_name_or_path": renamed("model_name"),
    "max_train_samples": renamed("num_train_samples"),
    "max_eval_samples": renamed("num_val_samples"),
    "val_max_target_length": renamed(
        "max_new_tokens",
        " (evaluation's generated length; validation's targets are cut at --max_target_length, as training's)",
    ),
    "overwrite_cache": left_out(
        "none needed: the token cache is rebuilt when the data, tokenizer or lengths change", "boolean"
    ),  # fmt: skip
    # The Llama 2 guide's training script (its --max_seq_len, --packing and --dataset_text_field are this
    # package's own flags)
    "use_gradient_checkpointing": boolean("fsdp_activation_checkpointing"),
    "use_flash_attn": HFName(
        flash_attention,
        "boolean",
        "true: `--attn_implementation sdpa` (torch's fused attention, its flash kernel on a GPU where no mask is "
        "needed; `--attn_implementation flex_attention` keeps packed rows apart on a GPU without a dense mask); "
        "false: `--attn_implementation eager`",
    ),
    "use_peft_lora": HFName(
        switch("peft", "lora", "none"), "boolean", "true: `--peft lora`; false: `--peft none`"
    ),
    "max_seq_length": renamed("max_seq_len", " (the guide's script's earlier name, and TRL's)"),
    "use_reentrant": left_out(NON_REENTRANT, "boolean"),
    "use_4bit_quantization": left_out(NOT_QUANTIZED, "boolean"),
    "use_8bit_quantization": left_out(NOT_QUANTIZED, "boolean"),
    "use_nested_quant": left_out(ONLY_QUANTIZED, "boolean"),
    "bnb_4bit_compute_dtype": left_out(ONLY_QUANTIZED, "value"),
    "bnb_4bit_quant_type": left_out(ONLY_QUANTIZED, "value"),
    "bnb_4bit_quant_storage_dtype": left_out(ONLY_QUANTIZED, "value"),
    # TRL's SFTConfig, ScriptArguments and ModelConfig (its --dataset_text_field, --packing and
    # --completion_only_loss are this package's own flags)
    "max_length": renamed(
        "max_seq_len",
        " (TRL's sequence length; an encoder-decoder refuses it: its lengths are two, `--max_source_length` and "
        "`--max_target_length`)",
    ),
    "assistant_only_loss": HFName(
        assistant_only_loss,
        "boolean",
        "true: `--completion_only_loss true` (the loss on a conversation's assistant replies alone, and on a "
        "prompt's completion; true by default here); false, TRL's default: as `--completion_only_loss` says",
    ),
    "padding_free": HFName(
        padding_free,
        "boolean",
        "true: `--packing true` (documents packing, the nearest equivalent); false: as here",
        why="documents packing, the nearest equivalent: rows fill a block one after another, each attending to "
        "itself alone with its own position ids",
    ),
    "dataset_num_proc": left_out(
        "none needed: the data cache tokenises a split of 20,000 rows or more in worker processes of its own (one "
        "per 10,000 rows, at most 8 and the CPUs it may use), once per machine",
        "value",
    ),
    "dataset_train_split": HFName(
        trained_split,
        "value",
        "train: as here (the split trained on); another name is refused: give its file as `--train_file`",
    ),
    "dataset_test_split": HFName(
        evaluated_split, "value", "`--eval_split` (test, validation; train with --evaluate_only)"
    ),
    "dataset_config": renamed("dataset_config_name"),
    "use_peft": HFName(switch("peft", "lora", "none"), "boolean", "as --use_peft_lora"),
    "gradient_checkpointing_use_reentrant": left_out(NON_REENTRANT, "boolean"),
    "load_in_4bit": left_out(NOT_QUANTIZED, "boolean"),
    "load_in_8bit": left_out(NOT_QUANTIZED, "boolean"),
    "use_bnb_nested_quant": left_out(ONLY_QUANTIZED, "boolean"),
}


def canonical(flag: str) -> str:
    """An HF name as the table spells it: HF's parser takes dashes for underscores."""
    return flag.removeprefix("--").replace("-", "_")


def translate(argv: list[str], own_flags: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """argv with HF's names replaced by this package's flags (`own_flags`: {flag: the field it sets}, which are
    left as they are), and one line for each name met. A field set both by its own flag and by an HF name is
    refused (which one wins would depend on nothing the user sees), as in a --config file."""
    out, used, position = [], [], 0
    while position < len(argv):
        token = argv[position]
        position += 1
        flag, has_value, inline = token.partition("=")
        name = canonical(flag)
        if not token.startswith("--") or flag in own_flags or name not in HF_NAMES:
            out.append(token)
            continue
        given = [inline] if has_value else []
        # Every token up to the next flag is this name's: the package takes no positional arguments.
        while not has_value and position < len(argv) and not argv[position].startswith("--"):
            given.append(argv[position])
            position += 1
            if HF_NAMES[name].takes != "values":
                break
        used.append((flag, name, given))
    flags, notes = resolve(used)
    own = {own_flags[flag]: flag for flag in (token.partition("=")[0] for token in out) if flag in own_flags}
    both = sorted({field for field, _ in flags if field in own})
    if both:
        names = ", ".join(label for label, _, _ in used)
        raise ConfigError(
            f"{', '.join(own[field] for field in both)} given twice, by its own flag and by an HF name ({names}): "
            "keep one"
        )
    return out + [part for field, text in flags for part in (f"--{field}", text)], notes


def translate_keys(keys: dict) -> tuple[dict[str, str], list[str]]:
    """A --config file's keys that are HF names ({name: value}): {field: text} and one line each."""
    used = []
    for name, value in keys.items():
        text = (str(value).lower() if isinstance(value, bool) else
                " ".join(map(str, value)) if isinstance(value, list) else str(value))  # fmt: skip
        used.append((name, name, [text]))
    flags, notes = resolve(used)
    return dict(flags), notes


def resolve(used: list[tuple[str, str, list[str]]]) -> tuple[list[tuple[str, str]], list[str]]:
    """The flags HF's names become ((label, name, the texts given) each), and one line each. Precision and the
    do_* names are read together, as HF reads them."""
    values = {name: value_of(label, HF_NAMES[name], given) for label, name, given in used}
    refuse_quantization(values)
    joint = {**precision(values), **tasks(values)}
    ignored = steps_a_strategy_ignores(values)
    flags, notes = [], []
    for label, name, given in used:
        hf = HF_NAMES[name]
        said = f"{label}{' ' + ' '.join(given) if given else ''}"
        if name in ignored:
            notes.append(f"{said}: left out ({ignored[name]})")
            continue
        became = joint[name] if name in joint else hf.becomes(values[name]) if hf.becomes else None
        if not became:
            notes.append(f"{said}: left out ({plain(hf.meaning)})")
            continue
        flags += became
        why = f" ({hf.why})" if hf.why else ""
        notes.append(f"{said} -> " + " ".join(f"--{field} {text}" for field, text in became) + why)
    values_of: dict[str, set[str]] = {}
    for field, text in flags:
        values_of.setdefault(field, set()).add(text)
    clashing = sorted(field for field, texts in values_of.items() if len(texts) > 1)
    if clashing:  # which would win depends on the order alone (--generation_max_length, --val_max_target_length)
        names = ", ".join(label for label, _, _ in used)
        raise ConfigError(f"HF's names ({names}) give --{clashing[0]} two values: keep one")
    return flags, notes


def refuse_quantization(values: dict[str, str]) -> None:
    """QLoRA's flags read together: a switch at true is refused once, naming every QLoRA flag given; at false (the
    guide's command gives --use_4bit_quantization False) they are left out, with the settings they govern."""
    if any(values.get(name) == "true" for name in QUANTIZATION_SWITCHES):
        given = " ".join(f"--{name} {values[name]}" for name in values
                         if name in QUANTIZATION_SWITCHES + QUANTIZATION_SETTINGS)  # fmt: skip
        raise ConfigError(
            f"{given}: QLoRA (a base model quantized to 4 or 8 bits by bitsandbytes) is not done here: the frozen "
            "model keeps its bf16 or fp32 weights, which FSDP shards over the ranks. Drop the quantization flags "
            "and train LoRA on the model as it is (--peft lora)"
        )


def precision(values: dict[str, str]) -> dict[str, list[tuple[str, str]]]:
    """--bf16 and --fp16 as HF reads them together: both true is refused; fp16's own false keeps bf16's."""
    bf16, fp16 = values.get("bf16"), values.get("fp16")
    if bf16 == fp16 == "true":
        raise ConfigError("--bf16 and --fp16 are both true: choose one (HF refuses both too)")
    joint = {}
    if fp16 is not None:
        joint["fp16"] = [("mixed_precision", "true"), ("use_fp16", "true")] if fp16 == "true" else [
            ("use_fp16", "false")]  # fmt: skip
    if bf16 is not None:
        joint["bf16"] = [] if bf16 == "false" and fp16 == "true" else [("mixed_precision", bf16)]
    return joint


def steps_a_strategy_ignores(values: dict[str, str]) -> dict[str, str]:
    """{--eval_steps or --save_steps: why it is left out} where HF's strategy beside it ignores it (epoch, no),
    as HF does: a template's --eval_steps 500 would otherwise add a generation pass every 500 steps."""
    ignored = {}
    for steps, strategies in (
        ("eval_steps", ("eval_strategy", "evaluation_strategy")),
        ("save_steps", ("save_strategy",)),
    ):
        strategy_name = next((name for name in strategies if name in values), None)
        if steps in values and strategy_name and values[strategy_name] in ("epoch", "no"):
            ignored[steps] = f"--{strategy_name} {values[strategy_name]}: HF ignores it then, and so does this run"
    return ignored


def tasks(values: dict[str, str]) -> dict[str, list[tuple[str, str]]]:
    """--do_train, --do_eval and --do_predict as HF reads them together: evaluation without training is
    --evaluate_only (of the test split for --do_predict alone); no task at all is refused."""
    given = {name: values[name] for name in ("do_train", "do_eval", "do_predict") if name in values}
    if not given:
        return {}
    trains = given.get("do_train") == "true"
    evaluates = given.get("do_eval") == "true"
    predicts = given.get("do_predict") == "true"
    if not (trains or evaluates or predicts):
        raise ConfigError(
            f"{' '.join(f'--{name} {text}' for name, text in given.items())}: nothing to do. A run trains (and "
            "validates); --evaluate_only true scores a model without training"
        )
    if trains:
        return {name: [] for name in given}
    name = "do_eval" if evaluates else "do_predict"
    only = [("evaluate_only", "true")] + ([] if evaluates else [("eval_split", "test")])
    return {**{other: [] for other in given}, name: only}


def value_of(flag: str, hf: HFName, given: list[str]) -> str:
    """The value an HF name was given, checked as HF's parser would: a boolean alone is true."""
    if hf.takes == "boolean" and len(given) > 1:
        raise ConfigError(f"{flag} {' '.join(given)}: takes one value, True or False")
    if hf.takes == "boolean":
        text = given[0].lower() if given else "true"
        if text not in HF_BOOLEANS:
            raise ConfigError(f"{flag} {given[0]}: HF's booleans are True or False")
        return HF_BOOLEANS[text]
    if not given:
        raise ConfigError(f"{flag} needs a value")
    return " ".join(given)


def plain(meaning: str) -> str:
    """A table cell as a message says it (no markdown)."""
    return meaning.replace("`", "")


def markdown() -> str:
    """docs/configuration.md's table of the HF names."""
    lines = ["| HF's name | here |", "| --- | --- |"]
    lines += [f"| `--{name}` | {hf.meaning} |" for name, hf in HF_NAMES.items()]
    return "\n".join(lines) + "\n"
