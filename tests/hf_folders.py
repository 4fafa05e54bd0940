"""The weights of a Hugging Face folder as they are on disk, and the check that the shard-written export
holds what save_pretrained writes for the same weights (the export this package did before: gather the
model on rank 0, then save_pretrained), tensor for tensor."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import T5Config, T5ForConditionalGeneration

INDEX = "model.safetensors.index.json"


def folder_tensors(folder: Path) -> dict:
    """Every tensor of the folder's safetensors files; with an index, the files it names, each name in the
    file the index says."""
    index = folder / INDEX
    if not index.is_file():
        return load_file(folder / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    tensors = {}
    for file in sorted(set(weight_map.values())):
        in_file = load_file(folder / file)
        assert all(weight_map[name] == file for name in in_file), file
        tensors.update(in_file)
    assert tensors.keys() == weight_map.keys()
    return tensors


def assert_folder_is_save_pretrained_of(folder: Path, state: dict, scratch: Path) -> None:
    """`folder`'s weights are, name for name and bit for bit, what save_pretrained writes for `state` (a full
    plain state dict), and from_pretrained loads the folder with no key missing or left over."""
    model = T5ForConditionalGeneration(T5Config.from_pretrained(folder))
    model.load_state_dict(state, strict=True)
    model.save_pretrained(scratch)
    config = json.loads((folder / "config.json").read_text())
    assert config == json.loads((scratch / "config.json").read_text())  # the architecture and dtype too
    expected, written = folder_tensors(scratch), folder_tensors(folder)
    assert written.keys() == expected.keys(), sorted(written.keys() ^ expected.keys())
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name
        assert written[name].dtype == tensor.dtype, name
    loaded, info = T5ForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    for name, tensor in state.items():  # the tied names too, tied again by from_pretrained
        assert torch.equal(loaded.state_dict()[name], tensor), name


def parameter_ties(model) -> list[list[str]]:
    """The model's parameter names grouped by the tensor they name: a tie is a group of two or more."""
    ids: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        ids.setdefault(id(parameter), []).append(name)
    return sorted(sorted(names) for names in ids.values())
