"""Command-line overrides of the config dataclasses: every field is `--field value`, strictly typed.

Booleans take true/false (given alone, a boolean flag means true), choices take a name, an
unknown flag or a bad value is a ConfigError that names the closest flags. The tutorial's flags are aliases,
and HF's names (configs/hf_names.py: --learning_rate, --per_device_train_batch_size, --bf16, ...) become this
package's flags.
`--config FILE` gives the same fields from a YAML or JSON file (configs/config_file.py), under the flags.
There is no other config system: the dataclasses are the single source of defaults and documentation.
"""

import argparse
import difflib
import math
import os
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from configs import hf_names
from configs.accelerate_env import settings_from_accelerate
from configs.config_file import hf_name_lines, read_config_file
from configs.errors import ConfigError
from configs.run import RECORD_KEYS, SECTION_TITLES, RunConfig
from configs.validate import implied_settings

# The tutorial's flags (seed 000/002), kept working. Flags whose name equals a field (--epochs, --lr,
# --gamma, --seed, --track_memory, --run_validation) need no alias. Unlike the tutorial, where
# `--save-model`, `--track_memory` and `--run_validation` were store_false flags that turned the feature
# OFF when given, here a boolean flag given alone turns it ON.
ALIASES = {
    "batch_size_training": ["--batch-size"],
    "val_batch_size": ["--test-batch-size"],
    "save_model": ["--save-model"],
}
NO_CUDA_FLAG = "--no-cuda"  # the tutorial's flag: same as --device cpu
CONFIG_FLAG = "--config"

BOOL_WORDS = {"true": True, "false": False}
NONE_WORD = "NONE"


@dataclass(frozen=True)
class FieldSpec:
    """One config field as the CLI sees it."""

    section: str  # the RunConfig attribute of its section: "train", "fsdp", "data", ...
    name: str
    type_hint: object
    help: str
    minimum: float | None
    above: float | None
    maximum: float | None
    on_resume: str  # configs/options.py: keep, fixed or launch
    path: str | None  # configs/options.py: path, path_or_name, or None (not a path)


def field_specs() -> list[FieldSpec]:
    specs = []
    for section in fields(RunConfig):
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            specs.append(
                FieldSpec(
                    section.name,
                    f.name,
                    hints[f.name],
                    f.metadata["help"],
                    f.metadata["minimum"],
                    f.metadata["above"],
                    f.metadata["maximum"],
                    f.metadata["on_resume"],
                    f.metadata["path"],
                )
            )
    return specs


def _optional_inner(type_hint):
    """`X | None` -> X, else None."""
    if isinstance(type_hint, types.UnionType) or typing.get_origin(type_hint) is typing.Union:
        args = [a for a in typing.get_args(type_hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return None


def choices_of(type_hint) -> list[str] | None:
    """The valid spellings of a Literal or optional-Literal field, or None for free values (an optional number
    takes NONE or a number)."""
    inner = _optional_inner(type_hint)
    if inner is not None:
        inner_choices = choices_of(inner)
        return None if inner_choices is None else inner_choices + [NONE_WORD]
    if typing.get_origin(type_hint) is typing.Literal:
        return [str(a) for a in typing.get_args(type_hint)]
    return None


def parse_value(spec: FieldSpec, text: str):
    """Convert the command-line text of one field to its typed value, or raise ConfigError."""
    type_hint = spec.type_hint
    flag = f"--{spec.name}"
    choices = choices_of(type_hint)
    inner = _optional_inner(type_hint)
    if inner is not None and choices is None:  # an optional number: NONE, or the number with its bounds
        return None if text == NONE_WORD else parse_value(replace(spec, type_hint=inner), text)
    if type_hint is bool:
        value = BOOL_WORDS.get(text.strip().lower())
        if value is None:
            raise ConfigError(f"{flag} takes true or false, not {text!r}")
        return value
    if choices is not None:
        if text not in choices:
            raise ConfigError(f"{flag} must be one of {', '.join(choices)}; got {text!r}")
        return None if inner is not None and text == NONE_WORD else text
    if type_hint in (int, float):
        return _parse_number(spec, text)
    return text


# A count of steps whose share of the run is another flag: HF 5 takes a number below 1 as that share.
SHARE_OF_THE_RUN = {"warmup_steps": "warmup_ratio"}


def _parse_number(spec: FieldSpec, text: str) -> int | float:
    type_hint, flag = spec.type_hint, f"--{spec.name}"
    try:
        value = type_hint(text)
    except ValueError:
        share = SHARE_OF_THE_RUN.get(spec.name) if hf_names.is_a_share(text) else None  # HF 5 reads 0.05 so
        hint = f" (a share of the run's steps is --{share} {text})" if share else ""
        raise ConfigError(
            f"{flag} takes {'an integer' if type_hint is int else 'a number'}, not {text!r}{hint}"
        ) from None
    if not math.isfinite(value):  # nan compares False with every bound
        raise ConfigError(f"{flag} takes a finite number, not {text!r}")
    _check_bounds(spec, value)
    return value


def _check_bounds(spec: FieldSpec, value) -> None:
    if spec.minimum is not None and value < spec.minimum:
        raise ConfigError(f"--{spec.name} must be >= {spec.minimum:g}; got {value}")
    if spec.maximum is not None and value > spec.maximum:
        raise ConfigError(f"--{spec.name} must be <= {spec.maximum:g}; got {value}")
    if spec.above is not None and value <= spec.above:
        raise ConfigError(f"--{spec.name} must be > {spec.above:g}; got {value}")


def format_value(value) -> str:
    """The command-line spelling of a config value (inverse of parse_value)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return NONE_WORD
    return str(value)


class _RaisingParser(argparse.ArgumentParser):
    """argparse prints usage and calls sys.exit on error; we raise so every rank fails the same way."""

    def error(self, message):
        raise ConfigError(message)


def help_text(spec: FieldSpec) -> str:
    """A field's documentation, as --help and docs/configuration.md show it."""
    if spec.on_resume == "fixed" and spec.path:
        return (
            f"{spec.help} Made absolute at start. Fixed for a run: a resume keeps the run's value and refuses "
            "another, but for the same file or folder at another path (another spelling, moved, copied), taken "
            "where its content is what the run's checkpoint recorded."
        )
    if spec.on_resume == "fixed":
        return f"{spec.help} Fixed for a run: a resume keeps the run's value and refuses another."
    return spec.help


def type_label(spec: FieldSpec) -> str:
    choices = choices_of(spec.type_hint)
    if spec.type_hint is bool:
        return "true|false"
    if choices is not None:
        return "{" + ",".join(choices) + "}"
    inner = _optional_inner(spec.type_hint)
    if inner is not None:
        return f"{inner.__name__.upper()}|{NONE_WORD}"
    return getattr(spec.type_hint, "__name__", str(spec.type_hint)).upper()


def build_parser() -> argparse.ArgumentParser:
    defaults = RunConfig()
    parser = _RaisingParser(
        prog="torchrun --nproc_per_node N T5_training.py",
        description=(
            "Fine-tune T5 on WikiHow with FSDP. Every config field is a flag: --field value. HF's names "
            "(--learning_rate, --per_device_train_batch_size, --bf16, ...) are taken too, each said as its flag "
            "at start (docs/configuration.md)."
        ),
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    groups = {name: parser.add_argument_group(title.replace("`", "")) for name, title in SECTION_TITLES.items()}
    for spec in field_specs():
        default = format_value(getattr(getattr(defaults, spec.section), spec.name))
        aliases = ALIASES.get(spec.name, [])
        alias_note = f" Alias: {', '.join(aliases)} (the tutorial's flag)." if aliases else ""
        bool_note = " Given alone: true." if spec.type_hint is bool else ""
        # A field whose help explains its default in words (the embedded model, <data_dir>/cache) keeps those.
        default_note = "" if "Default:" in spec.help else f" Default: {default}."
        groups[spec.section].add_argument(
            f"--{spec.name}",
            *aliases,
            dest=f"{spec.section}.{spec.name}",
            metavar=type_label(spec),
            nargs="?" if spec.type_hint is bool else None,
            const="true" if spec.type_hint is bool else None,
            default=argparse.SUPPRESS,
            # argparse %-formats help strings: escape the literal % signs of the field docs.
            help=f"{help_text(spec)}{alias_note}{bool_note}{default_note}".replace("%", "%%"),
        )
    groups["train"].add_argument(
        NO_CUDA_FLAG,
        dest="train.device",
        action="store_const",
        const="cpu",
        default=argparse.SUPPRESS,
        help="The tutorial's flag: train on CPU with gloo (same as --device cpu).",
    )
    parser.add_argument(
        CONFIG_FLAG,
        dest="config_file",
        metavar="FILE",
        default=None,
        help=(
            "A YAML or JSON file of settings, in the sections below (train, fsdp, data, ...; or config.json's "
            "keys) or at its top level: e.g. configs/examples/t5_3b_8gpu.yaml, or a run's config.json, which "
            "starts the same run again. Flags given beside it win. Default: none."
        ),
    )
    return parser


# How alike an unknown flag and a flag must be (difflib's ratio) for a hint: a misspelling of it (--learning_rat,
# --batch_size), not another name that shares some letters (--use_reentrant with --save_strategy: 0.6, difflib's
# own cutoff). A name that means one of the flags is mapped in configs/hf_names.py instead.
HINT_CUTOFF = 0.8


def _unknown_flag_message(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """One line per unknown flag with the closest ones: this package's flags, and HF's names (with what they
    become) where one is closer."""
    own = sorted(flag for flag in own_flags(parser) if flag.startswith("--"))
    hf = {f"--{name}": name for name in hf_names.HF_NAMES}
    lines = [f"unknown argument(s): {' '.join(unknown)} (--help lists every flag)"]
    for arg in unknown:
        close = difflib.get_close_matches(arg.split("=")[0], [*own, *hf], n=3, cutoff=HINT_CUTOFF)
        close.sort(key=lambda flag: flag not in hf)  # a known HF name first, then the closest spellings
        named = [f"{flag} (HF's name: {hf_names.plain(hf_names.HF_NAMES[hf[flag]].meaning)})" if flag in hf
                 else flag for flag in close]  # fmt: skip
        if named:
            lines.append(f"  {arg}: did you mean {' or '.join(named)}?")
    return "\n".join(lines)


def own_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """{each option string of the parser (aliases too): the field it sets}."""
    return {opt: action.dest.rsplit(".", 1)[-1] for action in parser._actions for opt in action.option_strings}


def hf_name_notes(argv: list[str] | None = None) -> list[str]:
    """One line for each HF name among the flags and the --config file's keys: what it became, or why it was
    left out (read_settings logs them)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    translated, notes = hf_names.translate(argv, own_flags(parser))
    config_file = parser.parse_known_args(translated)[0].config_file
    return notes + (hf_name_lines(config_file) if config_file else [])


def parse_args(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> RunConfig:
    """Defaults of the dataclasses, overridden by the settings `accelerate launch` passed in the environment
    (configs/accelerate_env.py), overridden by a --config file's, overridden by argv's flags. Raises ConfigError
    on any bad flag, key or value."""
    overrides, _, _ = _resolve(argv, environ)
    defaults = RunConfig()
    return RunConfig(
        **{section: replace(getattr(defaults, section), **values) for section, values in overrides.items()}
    )


def given_fields(argv: list[str] | None = None) -> set[str]:
    """The fields the flags and the --config file give (not the defaults, a resume's record or accelerate
    launch's environment)."""
    overrides, _, _ = _resolve(argv, {}, imply=False)  # an empty environment: accelerate launch's gives nothing
    return {name for values in overrides.values() for name in values}


def continue_run(
    argv: list[str] | None,
    recorded: Mapping[str, Mapping],
    record_path: str,
    environ: Mapping[str, str] | None = None,
    *,
    inputs_recorded: bool = False,
) -> tuple[RunConfig, list[str]]:
    """The settings of a resume: the run's recorded ones (`recorded`: the sections of its config.json, at
    `record_path`) wherever the command line (or accelerate launch's environment) gives none; a value given
    that differs from the record is taken, noted in the returned list ("keep" fields), or refused with a
    ConfigError naming both values ("fixed" fields: what the run's checkpoints cannot honour). "launch" fields
    (output_dir, resume, accept_changed_inputs, evaluate_only) are this command's alone.

    Paths are compared as paths: a recorded one is read as the path it names (records written before paths were
    made absolute hold them as typed, read from this working directory), another spelling of it is no change, and
    another path of a "fixed" field is taken where the checkpoint resumed from records its inputs
    (`inputs_recorded`), its content checked against them later (utils/checkpoint/inputs.py); a checkpoint
    written before that holds the run to its own paths, as it did."""
    given, _, _ = _resolve(argv, environ, imply=False)  # the record decides what the run's settings imply
    given_values = {name: value for section in given.values() for name, value in section.items()}
    recorded_texts = _recorded_texts(recorded)
    overrides = {section: {} for section in SECTION_TITLES}
    changes = []
    defaults = RunConfig()
    for spec in field_specs():
        text = recorded_texts.get(spec.name)
        if text is None and spec.on_resume == "fixed" and recorded:  # a field newer than the record: the default
            text = format_value(getattr(getattr(defaults, spec.section), spec.name))
        if spec.on_resume == "launch" or text is None:
            if spec.name in given_values:
                overrides[spec.section][spec.name] = given_values[spec.name]
            continue
        if spec.path:
            text = _recorded_path(spec, text, record_path, spec.name not in given_values, inputs_recorded)
        if spec.name not in given_values:  # the run's value
            overrides[spec.section][spec.name] = _parse_recorded(spec, text, record_path)
            continue
        value = given_values[spec.name]
        overrides[spec.section][spec.name] = value
        if format_value(value) == text or (spec.path and _same_location(value, text)):
            continue
        held = "its checkpoints hold to it" if spec.on_resume == "fixed" else _held_by(spec.name, recorded_texts)
        if spec.path and spec.on_resume == "fixed" and os.path.isabs(value) and text:
            if inputs_recorded:  # its content is checked against the checkpoint's record before loading
                changes.append(f"--{spec.name} {value} (the run had {text})")
                continue
            held = f"{held}: {UNRECORDED_INPUTS}"
        if held:
            raise ConfigError(
                f"--{spec.name} {format_value(value)}: the run being resumed was trained with --{spec.name} "
                f"{text} ({record_path}), and {held}. Leave it out (the flag, or the --config file's key) to "
                "keep the run's value, or start a new run in another --output_dir."
            )
        changes.append(f"--{spec.name} {format_value(value)} (the run had {text})")
    config = RunConfig(
        **{section: replace(getattr(defaults, section), **values) for section, values in overrides.items()}
    )
    return config, changes


# "keep" fields that the run's checkpoints cannot honour a change of while another recorded field has a value:
# {field: (that field, its recorded spelling, why)}.
HELD_BY = {
    "batch_size_training": ("group_by_length", "true", "--group_by_length cut its epochs' order by this size"),
}


def _held_by(name: str, recorded_texts: dict[str, str]) -> str | None:
    """Why the run's record holds a "keep" field to its value (HELD_BY), or None."""
    other, spelling, why = HELD_BY.get(name, (None, None, None))
    return why if other is not None and recorded_texts.get(other) == spelling else None


def _recorded_texts(recorded: Mapping[str, Mapping]) -> dict[str, str]:
    """{field: its command-line spelling} of a run record's sections (config_to_dict's); fields this version
    does not know are left out."""
    names = {spec.name for spec in field_specs()}
    return {
        name: format_value(raw) if isinstance(raw, bool) or raw is None else str(raw)
        for section_key in RECORD_KEYS.values()
        for name, raw in (recorded.get(section_key) or {}).items()
        if name in names
    }


def absolute_path(value: str, kind: str) -> str:
    """A path setting as the run reads it, resolved once when the settings are read: absolute (~ expanded), so that
    a resume from another working directory (a SLURM job's submit folder) reads the same file. Empty stays empty;
    a "path_or_name" value that names nothing here stays as given (a hub name)."""
    expanded = os.path.expanduser(value)
    if not value or (kind == "path_or_name" and not os.path.exists(expanded)):
        return value
    return os.path.abspath(expanded)


def _same_location(a: str, b: str) -> bool:
    """Whether two paths name one file or folder that exists (a symlink, or a path through one, is its target)."""
    return os.path.exists(a) and os.path.realpath(a) == os.path.realpath(b)


UNRECORDED_INPUTS = (
    "its checkpoint was written before checkpoints recorded what their run read, so another path cannot be "
    "checked against it"
)


def _recorded_path(spec: FieldSpec, text: str, record_path: str, required: bool, inputs_recorded: bool) -> str:
    """A path field's recorded value, as the path it names from here. `required` (the resume takes it): a path of
    the run's inputs ("fixed") that is not there is a ConfigError saying how to name it anew (where the checkpoint
    records its inputs) or to put it back."""
    path = absolute_path(text, spec.path)
    if not (required and spec.on_resume == "fixed" and os.path.isabs(path)) or os.path.exists(path):
        return path
    relative = "" if os.path.isabs(text) else (
        f" (the record holds it as typed, relative to the folder the run started in, not to this one, "
        f"{os.getcwd()}: resume from that folder, or name it by its absolute path)"
    )  # fmt: skip
    fix = (
        f"If it moved, name it anew: --{spec.name} NEW_PATH is taken where its content is what the run's "
        "checkpoint recorded (docs/checkpoints.md)"
        if inputs_recorded
        else f"If it moved, put it back there ({UNRECORDED_INPUTS})"
    )
    raise ConfigError(
        f"--{spec.name} {path}: the run being resumed read it ({record_path}), and it is not there{relative}. "
        f"{fix}; or start a new run in another --output_dir."
    )


def _parse_recorded(spec: FieldSpec, text: str, record_path: str):
    fix = f"This version does not take the run's value: give --{spec.name} on the command line."
    return _parse_from(spec, text, f"the run record {record_path}", fix)


def fields_from_accelerate(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> dict:
    """{field: the accelerate launch variable(s) it was taken from} for the run that parse_args(argv, environ)
    configures (flags given in argv win, so their fields are not listed): the run record's "from_accelerate"."""
    return _resolve(argv, environ)[1]


def implied_notes(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> list[str]:
    """One line for each setting that the others decided for the run parse_args(argv, environ) configures, where
    none was given (configs/validate.py: implied_settings; read_settings logs them)."""
    return list(_resolve(argv, environ)[2].values())


def _resolve(
    argv: list[str] | None, environ: Mapping[str, str] | None, *, imply: bool = True
) -> tuple[dict, dict[str, str], dict[str, str]]:
    """{"train": {field: value}, "fsdp": {...}, ...}: the typed values that the environment (accelerate launch's
    settings), a --config file or argv give, argv winning over the file, the file over the environment, and
    (`imply`) those the others imply where none of them gives one; {field: variables} of those taken from the
    environment; and {field: why} of those implied."""
    parser = build_parser()
    argv, _ = hf_names.translate(sys.argv[1:] if argv is None else argv, own_flags(parser))
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ConfigError(_unknown_flag_message(unknown, parser))
    specs = {s.name: s for s in field_specs()}
    flags = vars(namespace)
    config_file = flags.pop("config_file")
    from_file = _settings_from_file(config_file, specs) if config_file else {}
    explicit = {dest.split(".", 1)[1]: text for dest, text in flags.items()}
    settings = settings_from_accelerate(os.environ if environ is None else environ, {**from_file, **explicit})
    overrides = {section: {} for section in SECTION_TITLES}
    for name, (text, variables) in settings.items():  # first: the file's and the flags' values below win
        overrides[specs[name].section][name] = _parse_from_environment(specs[name], text, variables)
    for name, text in from_file.items():
        overrides[specs[name].section][name] = _parse_from(
            specs[name], text, f"--config {config_file}", f"Fix the file, or give --{name} on the command line."
        )
    for name, text in explicit.items():
        overrides[specs[name].section][name] = parse_value(specs[name], text)
    for values in overrides.values():  # paths resolved once, here: the run and its record read them so
        values.update(
            {name: absolute_path(value, specs[name].path) for name, value in values.items() if specs[name].path}
        )
    defaults = RunConfig()
    given = RunConfig(
        **{section: replace(getattr(defaults, section), **values) for section, values in overrides.items()}
    )
    implied = implied_settings(given, {name for values in overrides.values() for name in values}) if imply else {}
    for name, (value, _) in implied.items():
        overrides[specs[name].section][name] = value
    from_accelerate = {name: variables for name, (_, variables) in settings.items()}
    return overrides, from_accelerate, {name: why for name, (_, why) in implied.items()}


def _settings_from_file(path: str, specs: dict[str, FieldSpec]) -> dict[str, str]:
    """{field: text} of a --config file (configs/config_file.py)."""
    section_of = {name: spec.section for name, spec in specs.items()}
    return read_config_file(
        path,
        section_of,
        is_launch_field=lambda name: specs[name].on_resume == "launch",
        takes_none=lambda name: _optional_inner(specs[name].type_hint) is not None,
    )


def _parse_from_environment(spec: FieldSpec, text: str, variables: str):
    fix = f"Fix the config file, or give --{spec.name} on the command line."
    return _parse_from(spec, text, f"{variables} (set by accelerate launch)", fix)


def _parse_from(spec: FieldSpec, text: str, source: str, fix: str):
    """parse_value, with where the value came from and the fix named in the error."""
    try:
        return parse_value(spec, text)
    except ConfigError as err:
        raise ConfigError(f"{source} gives --{spec.name} {text}: {err}. {fix}") from None


def config_to_dict(config: RunConfig) -> dict:
    """A JSON-ready dict of every section under its config.json key, None as NONE (the spelling the CLI
    takes): feeding the values back as flags reproduces the run."""
    return {
        RECORD_KEYS[section.name]: {
            f.name: (format_value(v) if v is None else v)
            for f in fields(getattr(config, section.name))
            for v in [getattr(getattr(config, section.name), f.name)]
        }
        for section in fields(RunConfig)
    }
