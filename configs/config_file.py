"""`--config FILE`: the settings of a run from a YAML or JSON file, in the sections of configs/run.py.

    train:                      # a section, by its name (configs/run.py) or its config.json key (train_config)
      model_name: t5-base
      epochs: 3
    fsdp:
      sharding_strategy: FULL_SHARD

A field may also stand at the top level (field names are unique across sections). Values are checked as the
flags are, with the same types, choices and bounds; flags given beside the file win. A run's own
output_dir/config.json is such a file: it starts the same run again, except for the fields that belong to
one launch (output_dir, resume, accept_changed_inputs, evaluate_only), which it leaves to the command line.
HF's names (configs/hf_names.py: learning_rate, per_device_train_batch_size, bf16, ...) are keys too, in any
section or at the top level.
"""

import difflib
import json
import os
from collections.abc import Callable

import yaml

from configs import hf_names
from configs.errors import ConfigError
from configs.run import RECORD_KEYS, SECTION_TITLES

SUFFIXES = (".yaml", ".yml", ".json")
# What a run record (output_dir/config.json) holds besides its sections: the setting it ran in, not settings.
RUN_RECORD_KEYS = (
    "from_accelerate",
    "world_size",
    "torchrun_job",
    "backend",
    "device",
    "mixed_precision_policy",
    "tf32_matmuls",
    "mfu_peak_tflops",
    "mfu_peak_source",
    "unknown_tokens",
    "started_at",
    "versions",
    "command",
    "resumed_from",
)
RECORD_SIGNATURE = ("versions", "command")  # keys every run record has, and no hand-written settings file
# {a section's key in a file: the section}: its name (configs/run.py) or its config.json key (train_config)
SECTION_KEYS = {**{name: name for name in SECTION_TITLES}, **{key: name for name, key in RECORD_KEYS.items()}}


def read_config_file(
    path: str,
    section_of: dict[str, str],
    is_launch_field: Callable[[str], bool],
    takes_none: Callable[[str], bool],
) -> dict:
    """{field: its command-line spelling} of every setting in the file at `path`. `section_of`: {field: its
    section}; `is_launch_field(field)`: whether a field belongs to one launch (left out of a run record);
    `takes_none(field)`: whether null is a value of the field. Raises ConfigError naming the file and the fix
    for an unreadable file, an unknown key, a field under another section than its own, or a value that is
    not one. A run record's fields and keys that this version does not know (an older or newer version wrote
    them) are left out, as a resume leaves them out."""
    content = _load(path)
    # A run record (what run_record writes: its versions and command among its keys), not a file of one's own
    # that happens to use one of its keys (backend, world_size).
    is_run_record = all(key in content for key in RECORD_SIGNATURE)
    values, hf_keys = {}, hf_keys_of(path, content)
    given_at: dict[str, str] = {}  # {field: where in the file}
    known = [*SECTION_KEYS, *section_of, *hf_names.HF_NAMES]
    for key, value in content.items():
        if key in hf_keys or (is_run_record and (key in RUN_RECORD_KEYS or _another_versions(key, known))):
            continue
        if key in SECTION_KEYS:
            if value is None:  # a section whose fields are all commented out
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"--config {path}: {key} is a section and takes fields, not {value!r}")
            for name, field_value in value.items():
                if name not in hf_keys and _in_section(path, name, SECTION_KEYS[key], section_of, is_run_record):
                    note_place(path, given_at, name, f"under {key}")
                    values[name] = field_value
        elif key in section_of:
            note_place(path, given_at, key, "at the top level")
            values[key] = value
        else:
            raise ConfigError(_unknown_key(path, key, [*SECTION_KEYS, *section_of]))
    if is_run_record:  # where this command writes and starts from is its own, not the recorded run's
        values = {name: value for name, value in values.items() if not is_launch_field(name)}
    texts = {name: _text(path, name, value, takes_none(name)) for name, value in values.items()}
    translated = _hf_flags(path, hf_keys)[0]
    both = sorted(set(translated) & set(texts))
    if both:
        raise ConfigError(
            f"--config {path}: {', '.join(both)} given twice, by its own key and by an HF name "
            f"({', '.join(hf_keys)}): keep one"
        )
    return {**texts, **translated}


def hf_name_lines(path: str) -> list[str]:
    """One line for each HF name among the file's keys: what it became, or why it was left out."""
    return _hf_flags(path, hf_keys_of(path, _load(path)))[1]


def hf_keys_of(path: str, content: dict) -> dict:
    """{HF name: value} of the keys of a file's top level and sections that are HF's names; one given in two
    places is refused, naming both."""
    places = [("at the top level", content)]
    places += [
        (f"under {key}", value)
        for key, value in content.items()
        if key in SECTION_KEYS and isinstance(value, dict)
    ]
    found, given_at = {}, {}
    for place, mapping in places:
        for name, value in mapping.items():
            if name in hf_names.HF_NAMES:
                note_place(path, given_at, name, place)
                found[name] = value
    return found


def note_place(path: str, given_at: dict[str, str], name: str, place: str) -> None:
    """Record in `given_at` where the file at `path` gives `name`; a second place is refused, naming both (which
    one won would depend on the order of the file alone)."""
    if name in given_at:
        raise ConfigError(f"--config {path}: {name} is given twice, {given_at[name]} and {place}; keep one")
    given_at[name] = place


def _hf_flags(path: str, keys: dict) -> tuple[dict[str, str], list[str]]:
    try:
        return hf_names.translate_keys(keys)
    except ConfigError as err:
        raise ConfigError(f"--config {path}: {err}") from None


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        raise ConfigError(f"--config {path}: a config file is YAML (.yaml, .yml) or JSON (.json)")
    with open(path, encoding="utf-8-sig") as f:  # a byte-order mark, which some editors write, is no content
        try:
            if suffix == ".json":
                content = json.load(f, object_pairs_hook=_one_of_each)
            else:
                content = yaml.load(f, Loader=_UniqueKeyLoader)
        except KeyGivenTwice as err:
            raise ConfigError(
                f"--config {path}: {err}; keep one (a file's later value would win silently)"
            ) from None
        except (json.JSONDecodeError, yaml.YAMLError) as err:
            raise ConfigError(f"--config {path} is not valid {suffix[1:].upper()}: {err}") from None
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"--config {path} is not UTF-8 text (it holds the byte {err.object[err.start]:#04x}): save it as "
                "UTF-8"
            ) from None
    if content is None:  # an empty YAML file
        return {}
    if not isinstance(content, dict):
        raise ConfigError(f"--config {path}: the file must hold a mapping of sections and fields")
    return content


class KeyGivenTwice(ValueError):
    """A mapping of the file names a key twice (the parsers keep the last without a word)."""


def _one_of_each(pairs: list[tuple]) -> dict:
    """A JSON object's pairs as a dict, refusing a key given twice."""
    keys = [key for key, _ in pairs]
    twice = next((key for key in keys if keys.count(key) > 1), None)
    if twice is not None:
        raise KeyGivenTwice(f"{twice!r} is given twice in one object")
    return dict(pairs)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping as written (a merge's `<<` keys may be
    overridden). Checked where PyYAML flattens each mapping's merges, before it rewrites the mapping with the
    merged keys, once per mapping (a merged one is flattened again where it is used)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.checked: set[int] = set()

    def flatten_mapping(self, node):
        if id(node) not in self.checked:
            self.checked.add(id(node))
            lines: dict = {}
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    key, line = self.construct_object(key_node), key_node.start_mark.line + 1
                    if key in lines:
                        where = f"lines {lines[key]} and {line}" if lines[key] != line else f"both on line {line}"
                        raise KeyGivenTwice(f"{key!r} is given twice in one mapping ({where})")
                    lines[key] = line
        super().flatten_mapping(node)


def _in_section(path: str, name: str, section: str, section_of: dict[str, str], is_run_record: bool) -> bool:
    """Whether `name` is a field this version takes (in its own section: else a ConfigError)."""
    if name not in section_of:
        known = [*section_of, *hf_names.HF_NAMES]
        if is_run_record and _another_versions(name, known):
            return False
        raise ConfigError(_unknown_key(path, name, known))
    if section_of[name] != section:
        raise ConfigError(
            f"--config {path}: {name} is a field of section {section_of[name]}, not {section}: move it there "
            "(or to the top level)"
        )
    return True


def _text(path: str, name: str, value, takes_none: bool) -> str:
    """A file value in the spelling of its flag (true/false, NONE for null), so that the command line's own
    parser checks it."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        if not takes_none:
            raise ConfigError(f'--config {path}: {name} takes no null (an empty text is "")')
        return "NONE"
    if isinstance(value, int | float | str):
        return str(value)
    if isinstance(value, list):
        raise ConfigError(
            f"--config {path}: {name} takes one value, not a list (a comma-separated list is one text: q,v)"
        )
    raise ConfigError(
        f"--config {path}: {name} takes one value, not {value!r} (YAML reads some unquoted texts, such as dates, "
        "as other types: quote it)"
    )


CLOSE = 0.8  # how alike a record's unknown key and a key of this version must be to be taken for a typo


def _another_versions(key: str, known: list[str]) -> bool:
    """Whether a run record's `key`, which this version does not know, is an older or newer version's (left
    out, as a resume leaves it out), not a key mistyped in the record (close to one of `known`: refused as in
    any file)."""
    return key not in known and not difflib.get_close_matches(str(key), known, n=1, cutoff=CLOSE)


def _unknown_key(path: str, key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(str(key), valid, n=3)
    hint = f": did you mean {' or '.join(close)}?" if close else " (sections: " + ", ".join(SECTION_TITLES) + ")"
    return f"--config {path}: unknown key {key!r}{hint}"
