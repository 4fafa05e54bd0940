"""HF's flag names, as users of `run_summarization.py`, `Seq2SeqTrainer` and the Llama 2 guide's training
script type them, turned into this package's flags before the flags are parsed (configs/cli.py).

A name with a meaning here becomes its flag, with one line saying so (`--learning_rate 3e-4 -> --lr 3e-4`);
HF's boolean spellings (`--bf16`, `--bf16 True`) work. A name with no meaning here (`--do_train`,
`--predict_with_generate`) is left out with one line saying what the package does instead. The same names
work as keys of a --config file. docs/configuration.md's table is `markdown()`.
"""

from collections.abc import Callable
from dataclasses import dataclass

from configs.errors import ConfigError

HF_TRUE = {"true": "true", "1": "true", "yes": "true", "false": "false", "0": "false", "no": "false"}


@dataclass(frozen=True)
class HFName:
    """One HF name: the flags it becomes, from its value (None: it takes no value here and is left out)."""

    becomes: Callable[[str], list[tuple[str, str]]] | None
    takes: str  # "value", "boolean" (alone means true), "values" (one or more) or "nothing"
    meaning: str  # docs/configuration.md's cell: what it became, or what the package does instead


def renamed(field: str) -> HFName:
    return HFName(lambda value: [(field, value)], "value", f"`--{field}`")


def boolean(*fields: str) -> HFName:
    return HFName(lambda value: [(field, value) for field in fields], "boolean",
                  " and ".join(f"`--{field}`" for field in fields))  # fmt: skip


def left_out(instead: str, takes: str = "nothing") -> HFName:
    return HFName(None, takes, instead)


def whole_epochs(value: str) -> list[tuple[str, str]]:
    try:
        epochs = float(value)
    except ValueError:
        raise ConfigError(f"--num_train_epochs {value}: not a number") from None
    if epochs != int(epochs):
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


def fp16(value: str) -> list[tuple[str, str]]:
    return [("mixed_precision", "true"), ("use_fp16", "true")] if value == "true" else [("use_fp16", "false")]


ALWAYS_TRAINS = "none needed: a run trains; --evaluate_only true evaluates a model without training"
HF_NAMES = {
    # TrainingArguments / Seq2SeqTrainingArguments
    "per_device_train_batch_size": renamed("batch_size_training"),
    "per_device_eval_batch_size": renamed("val_batch_size"),
    "learning_rate": renamed("lr"),
    "num_train_epochs": HFName(whole_epochs, "value", "`--epochs` (whole epochs; --max_steps for fewer)"),
    "lr_scheduler_type": HFName(
        scheduler, "value", "`--lr_scheduler` (linear, cosine, constant; constant_with_warmup: constant)"
    ),  # fmt: skip
    "logging_steps": renamed("log_every_n_steps"),
    "eval_steps": renamed("eval_every_n_steps"),
    "save_steps": renamed("save_every_n_steps"),
    "save_total_limit": renamed("keep_last_n"),
    "resume_from_checkpoint": renamed("resume"),
    "dataloader_num_workers": renamed("num_workers_dataloader"),
    "gradient_checkpointing": boolean("fsdp_activation_checkpointing"),
    "bf16": boolean("mixed_precision"),
    "fp16": HFName(fp16, "boolean", "`--mixed_precision` and `--use_fp16` (fp16 with the gradient scaler)"),
    "report_to": HFName(trackers, "values", "`--tensorboard`, `--wandb`, `--mlflow` (each true if named)"),
    "run_name": renamed("tracker_run_name"),
    "generation_num_beams": renamed("num_beams"),
    "do_train": left_out(ALWAYS_TRAINS, "boolean"),
    "do_eval": left_out(
        "none needed: validation runs after every epoch (--run_validation; --eval_every_n_steps N adds more)",
        "boolean",
    ),  # fmt: skip
    "do_predict": left_out("--evaluate_only true --eval_split test scores the test split", "boolean"),
    "predict_with_generate": left_out(
        "none needed: validation generates and scores summaries (--eval_rouge true, the default)", "boolean"
    ),  # fmt: skip
    "overwrite_output_dir": left_out(
        "not done: a run never overwrites one; an --output_dir holding a run resumes it (--resume true, the "
        "default) or is refused: give another --output_dir for a new run",
        "boolean",
    ),
    "eval_strategy": left_out("validation runs every epoch; --eval_every_n_steps N adds step-wise ones", "value"),
    "evaluation_strategy": left_out(
        "validation runs every epoch; --eval_every_n_steps N adds step-wise ones", "value"
    ),  # fmt: skip
    "save_strategy": left_out("a checkpoint every epoch; --save_every_n_steps N adds step-wise ones", "value"),
    "logging_strategy": left_out("a step line every --log_every_n_steps steps", "value"),
    # run_summarization.py's arguments
    "model_name_or_path": renamed("model_name"),
    "max_train_samples": renamed("num_train_samples"),
    "max_eval_samples": renamed("num_val_samples"),
    "overwrite_cache": left_out(
        "none needed: the token cache is rebuilt when the data, tokenizer or lengths change", "boolean"
    ),  # fmt: skip
    # The Llama 2 guide's training script
    "use_gradient_checkpointing": boolean("fsdp_activation_checkpointing"),
}


def canonical(flag: str) -> str:
    """An HF name as the table spells it: HF's parser takes dashes for underscores."""
    return flag.removeprefix("--").replace("-", "_")


def translate(argv: list[str], own_flags: set[str]) -> tuple[list[str], list[str]]:
    """argv with HF's names replaced by this package's flags (`own_flags`, which are left as they are), and
    one line for each name met."""
    out, notes, position = [], [], 0
    while position < len(argv):
        token = argv[position]
        position += 1
        flag, has_value, inline = token.partition("=")
        name = canonical(flag)
        if not token.startswith("--") or flag in own_flags or name not in HF_NAMES:
            out.append(token)
            continue
        hf = HF_NAMES[name]
        given = [inline] if has_value else []
        # Every token up to the next flag is this name's: the package takes no positional arguments.
        while not has_value and position < len(argv) and not argv[position].startswith("--"):
            if hf.takes == "nothing":
                break
            given.append(argv[position])
            position += 1
            if hf.takes != "values":
                break
        value = value_of(flag, hf, given)
        if hf.becomes is None:
            notes.append(f"{flag}: left out ({plain(hf.meaning)})")
            continue
        flags = hf.becomes(value)
        out += [part for field, text in flags for part in (f"--{field}", text)]
        notes.append(f"{flag}{' ' + ' '.join(given) if given else ''} -> " + " ".join(
            f"--{field} {text}" for field, text in flags))  # fmt: skip
    return out, notes


def value_of(flag: str, hf: HFName, given: list[str]) -> str:
    """The value an HF name was given, checked as HF's parser would: a boolean alone is true."""
    if hf.takes == "boolean" and len(given) > 1:
        raise ConfigError(f"{flag} {' '.join(given)}: takes one value, True or False")
    if hf.takes == "boolean":
        text = given[0].lower() if given else "true"
        if text not in HF_TRUE:
            raise ConfigError(f"{flag} {given[0]}: HF's booleans are True or False")
        return HF_TRUE[text]
    if hf.takes in ("value", "values") and not given:
        raise ConfigError(f"{flag} needs a value")
    return " ".join(given)


def translate_key(name: str, value) -> tuple[list[tuple[str, str]], str] | None:
    """A --config file's key that is an HF name: the fields it becomes with their texts, and its line; None for
    any other key."""
    hf = HF_NAMES.get(name)
    if hf is None:
        return None
    text = (str(value).lower() if isinstance(value, bool) else
            " ".join(map(str, value)) if isinstance(value, list) else str(value))  # fmt: skip
    value = value_of(name, hf, [text])
    if hf.becomes is None:
        return [], f"{name}: left out ({plain(hf.meaning)})"
    flags = hf.becomes(value)
    return flags, f"{name}: {text} -> " + " ".join(f"--{field} {flag_text}" for field, flag_text in flags)


def plain(meaning: str) -> str:
    """A table cell as a message says it (no markdown)."""
    return meaning.replace("`", "")


def markdown() -> str:
    """docs/configuration.md's table of the HF names."""
    lines = ["| HF's name | here |", "| --- | --- |"]
    lines += [f"| `--{name}` | {hf.meaning} |" for name, hf in HF_NAMES.items()]
    return "\n".join(lines) + "\n"
