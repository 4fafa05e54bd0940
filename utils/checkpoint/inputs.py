"""What a run reads, fingerprinted, so that a resume reads what its checkpoint was trained on (docs/checkpoints.md:
a resume reads what the run trained on).

    inputs = checked_inputs(start, data=..., model_name=..., lora=..., accept_changed=...)   # collective
    inputs = checked_splits(start, inputs, plan.record())   # collective, once the data's splits are known

A fingerprint is content, not a path or a modification time, so that a copied or moved file is the same file:
a data file's size and XXH3-128 digest (at memory speed; sha256 is several times slower); of a model folder,
what a resume reads from it, and with LoRA each weight file's size and safetensors header, never its weights.
A checkpoint also records how its rows were tokenised ("encoding": a resume reads them so, recorded_encoding)
and the splits the run trains and evaluates on (utils/data/cache.py: SplitPlan, from --eval_split): a resume
on other splits is refused (no --accept_changed_inputs: the fix is the --eval_split that resumes).
"""

import os
from pathlib import Path

import xxhash

from configs.data import DataConfig
from configs.errors import ConfigError
from utils.base.log import get_logger
from utils.checkpoint.start import StartPoint, read_train_state
from utils.data.cache import text_source
from utils.distributed.process_group import is_rank0, rank0_decides
from utils.distributed.progress_bounded import progress_bounded

DIGEST = "xxh3_128"  # of a file's every byte
HEADER_DIGEST = "header_xxh3_128"  # of a safetensors file's header (its tensors' names, dtypes, shapes, offsets)
READ_BYTES = 16 * 2**20
# What a resume reads of a model folder: its configs and the tokenizer's files (vocabularies, merges, templates).
READ_SUFFIXES = (".json", ".model", ".spm", ".txt", ".jinja", ".tiktoken")
WEIGHT_SUFFIXES = (".safetensors", ".bin")  # the weights' files, which LoRA's adapter takes from its base


def checked_inputs(
    start: StartPoint, *, data: DataConfig, model_name: str, lora: bool, accept_changed: bool
) -> dict:
    """The fingerprints of the run's inputs, for its checkpoints to record; at a resume from a checkpoint, checked
    against what that checkpoint recorded (a change refused unless `accept_changed`). Collective: rank 0 reads,
    while the others wait for as long as it progresses (a large dataset on cold storage takes what it takes)."""
    with progress_bounded("the fingerprints of the run's inputs"):
        current = (
            {"data": data_fingerprint(data), "model": model_fingerprint(model_name, lora)} if is_rank0() else None
        )
    return rank0_decides(lambda: _checked(start, current, accept_changed))


def _checked(start: StartPoint, current: dict, accept_changed: bool) -> dict:
    if not start.is_checkpoint:
        return current
    state = read_train_state(start.path)
    recorded = state.get("inputs")
    if recorded is None:
        get_logger().warning(
            "checkpoint %s was written before checkpoints recorded what their run read: this resume's data and "
            "model were not checked against what it trained on", start.path,
        )  # fmt: skip
        return current
    data_changes, data_moved = data_differences(recorded.get("data", {}), current["data"])
    model_changes, model_moved = model_differences(recorded.get("model", {}), current["model"])
    changed, moved = data_changes + model_changes, data_moved + model_moved
    if moved:
        get_logger().info("read at other paths, with the content checkpoint %s recorded: %s", start.path,
                          "; ".join(moved))  # fmt: skip
    if not changed:
        return current
    progress = state["progress"]
    epoch, consumed, step = progress["epoch"], progress["samples_consumed"], progress["global_step"]
    position = f"epoch {epoch}, {consumed} samples into it, step {step}"
    if not accept_changed:
        other = "in other rows" if data_changes else "with other model files than it trained with"
        raise ConfigError(
            f"checkpoint {start.path} was trained on other inputs than this resume reads: {'; '.join(changed)}. "
            f"Resumed, the run would go on from its position ({position}) {other}. Put the run's files back "
            "(or name where they are now), start a new run in another --output_dir, or add "
            "--accept_changed_inputs true to continue on these deliberately."
        )
    get_logger().warning(
        "--accept_changed_inputs true: continuing on other inputs than checkpoint %s was trained on: %s. Its "
        "position (%s) now counts in the new data: the epoch goes on after the first %d samples of the new rows' "
        "shuffled order (the same seed and epoch), and the checkpoints from here record these inputs",
        start.path, "; ".join(changed), position, consumed,
    )  # fmt: skip
    return current


def recorded_encoding(start: StartPoint) -> int | str | None:
    """How the rows of the run a checkpoint continues were tokenised (utils/data/cache.py: an Encoding's
    version, train_state.json's "inputs"' "encoding"), which its resume reads them with, so that its data
    position stays exact; None where the checkpoint recorded none (written before checkpoints recorded it:
    utils/data/cache.py's resumed_encoding says what that was)."""
    return (read_train_state(start.path).get("inputs") or {}).get("encoding")


# What a checkpoint written before checkpoints recorded their splits trained and evaluated on, whatever
# --eval_split said (utils/data/cache.py: SplitPlan.record).
SPLITS_BEFORE_RECORDED = {"train": "train", "evaluation": "validation"}


def checked_splits(start: StartPoint, inputs: dict, splits: dict) -> dict:
    """`inputs` with the splits the run trains and evaluates on (SplitPlan.record: --eval_split on the source's
    splits), for its checkpoints to record; at a resume from a checkpoint, refused where they differ from the
    checkpoint's: its rows and its choice of the best model would change mid-run. Collective."""
    return rank0_decides(lambda: _checked_splits(start, inputs, splits))


def _checked_splits(start: StartPoint, inputs: dict, splits: dict) -> dict:
    if start.is_checkpoint:
        recorded = read_train_state(start.path).get("inputs") or {}
        then = recorded.get("splits", SPLITS_BEFORE_RECORDED)
        if then != splits:
            keep = "test" if then["evaluation"] == "test" else "auto"
            raise ConfigError(
                f"checkpoint {start.path} trained on {_splits_said(then)}; this resume would train on "
                f"{_splits_said(splits)}, so its rows and the split that chooses its best model would change "
                f"mid-run. Resume with --eval_split {keep} (what the checkpoint trained with), or start a new run "
                "in another --output_dir."
            )
    return {**inputs, "splits": splits}


def _splits_said(splits: dict) -> str:
    train = "every train row" if splits["train"] != "train" else "train less any rows held out for validation"
    return f"{train}, evaluated on the {splits['evaluation']} split"


def data_fingerprint(data: DataConfig) -> dict:
    """{each file the run's rows are read from, by its name in the source (utils/data/sources.py: TextSource):
    its path, size and digest}; empty for a hub dataset."""
    files = text_source(data).files
    return {name: {"path": str(path), **content_fingerprint(path)} for name, path in files.items()}


def model_fingerprint(model_name: str, lora: bool) -> dict:
    """A model folder's path and {file: its path, size and digest} of what a resume reads from it, with `lora`
    also its weight files' sizes and safetensors headers; a hub model's name."""
    if not os.path.isdir(model_name):
        return {"name": model_name}
    files = {}
    for path in sorted(Path(model_name).iterdir()):
        if path.is_file() and path.suffix in READ_SUFFIXES:
            files[path.name] = {"path": str(path), **content_fingerprint(path)}
        elif path.is_file() and lora and path.suffix in WEIGHT_SUFFIXES:
            files[path.name] = {"path": str(path), **weights_fingerprint(path)}
    return {"path": model_name, "files": files}


def content_fingerprint(path: Path) -> dict:
    """A file's size and the digest of its every byte (the text cache's key reads less: utils/data/sources.py)."""
    hasher = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            hasher.update(block)
    return {"bytes": path.stat().st_size, DIGEST: hasher.hexdigest()}


def weights_fingerprint(path: Path) -> dict:
    """A weight file's size, and for safetensors the digest of its header (8 bytes of length, then JSON)."""
    size = path.stat().st_size
    if path.suffix != ".safetensors":
        return {"bytes": size}
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = f.read(min(length, size))
    return {"bytes": size, HEADER_DIGEST: xxhash.xxh3_128_hexdigest(header)}


def data_differences(then: dict, now: dict) -> tuple[list[str], list[str]]:
    """(each data file that changed and how; each with the same content at another path) from `then` to `now`."""
    moved = [
        f"{new['path']} (the run read {old['path']})"
        for name, new in now.items()
        if (old := then.get(name)) and _same_content(old, new) and not _same_path(new["path"], old["path"])
    ]
    return _file_changes(then, now), moved


def model_differences(then: dict, now: dict) -> tuple[list[str], list[str]]:
    """(how the model changed; the model folder, if the same content is at another path) from `then` to `now`."""
    if "files" not in then or "files" not in now:
        changed = then != now
        return [f"the model: {_model_named(now)}, the run's was {_model_named(then)}"] if changed else [], []
    folder = now["path"]
    moved_from = "" if _same_path(folder, then["path"]) else f" (the run's was {then['path']})"
    changes = _file_changes(then["files"], now["files"])
    if changes:
        return [f"the model folder {folder}{moved_from}: {', '.join(changes)}"], []
    return [], [f"the model folder {folder}{moved_from}"] if moved_from else []


def _file_changes(then: dict, now: dict) -> list[str]:
    """How the files of `now` differ from those of `then` ({name: path and fingerprint}), each named by path."""
    found = []
    for name in sorted(then.keys() | now.keys()):
        old, new = then.get(name), now.get(name)
        if new is None:
            found.append(f"{old['path']} was read by the run, and is not now")
        elif old is None:
            found.append(f"{new['path']} is read now, and was not by the run")
        elif old["bytes"] != new["bytes"]:
            found.append(f"{new['path']} changed: {new['bytes']:,} bytes, the run read {old['bytes']:,}")
        elif old.get(HEADER_DIGEST) != new.get(HEADER_DIGEST):
            found.append(f"{new['path']} changed: the run's {new['bytes']:,} bytes, other tensors in them")
        elif old.get(DIGEST) != new.get(DIGEST):
            found.append(f"{new['path']} changed: the run's {new['bytes']:,} bytes, other content")
    return found


def _same_content(then: dict, now: dict) -> bool:
    return all(then.get(key) == now.get(key) for key in ("bytes", DIGEST, HEADER_DIGEST))


def _model_named(model: dict) -> str:
    return f"the folder {model['path']}" if "path" in model else f"{model.get('name')} (a hub name)"


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)
