"""Rank-0-only loading (--cpu_ram_efficient_loading): only rank 0 reads the weights, for either backend.

FSDP1: every rank builds the model on the meta device, and FSDP1 materialises it unit by unit. FSDP1 calls
`param_init_fn(module)` for each module of a unit that still has meta parameters, just before it flattens
and shards that unit, in the same order on every rank. UnitMaterializer allocates the module's own
parameters, lets rank 0 read just those tensors from the pretrained safetensors file (or a full .pt), and
broadcasts them. No rank ever holds more than one unit it does not keep (rank 0 included: it reads tensors
by name, not the whole file), and FSDP1's `sync_module_states`, which it refuses for CPU tensors
(docs/pitfalls.md #16), is not needed. A weak memo keeps tied weights (T5's `shared`, `embed_tokens`,
`lm_head`) one parameter without keeping any unit alive after it is sharded.

FSDP2: ranks but 0 build on meta; after fully_shard, broadcast_rank0_weights allocates every rank's shards
and scatters rank 0's loaded state dict into them.

LoRA (--peft lora): the adapters are in no pretrained file, so every rank builds them in host memory on its
skeleton, with the values they get on a loaded model (utils/model/lora.py: apply_lora), and only the base
weights are read: FSDP1's units of the adapters have nothing on meta, FSDP2's broadcast overwrites them with
rank 0's equal ones. A LoRA run's .pt holds its adapters: FSDP1 reads them from it by name like the rest.

A run that resumes a checkpoint builds the skeleton on every rank and reads nothing here: UnitMaterializer
(FSDP1) and `to_empty` (FSDP2; one rank's unwrapped model too) allocate them, and the checkpoint manager fills
them.
"""

import json
import os
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from configs.errors import ConfigError
from utils.model.loading import INDEX_FILE, SINGLE_FILE, cached_file_or_none, computed_buffers
from utils.model.lora import base_weight_name
from utils.observe.memory import trim_host_heap


class SafetensorsReader:
    """Reads single tensors by name from a model's safetensors file(s), without loading the rest."""

    def __init__(self, model_name: str):
        self.files = _weight_files(model_name)

    def names(self) -> set[str]:
        return set(self.files)

    def __call__(self, name: str) -> torch.Tensor:
        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(name)


def _weight_files(model_name: str) -> dict[str, str]:
    """{tensor name: file} of a local folder or hub model stored as safetensors (single file or shards)."""
    index = cached_file_or_none(model_name, INDEX_FILE)
    if index is not None:
        folder = os.path.dirname(index)
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    single = cached_file_or_none(model_name, SINGLE_FILE)
    if single is None:
        raise ConfigError(
            f"{model_name!r} has no {SINGLE_FILE} (only PyTorch .bin weights?): rank-0-only loading with FSDP1 "
            "reads safetensors. Re-save the model with save_pretrained, or use --fsdp_version 2 (which "
            "broadcasts rank 0's loaded model)."
        )
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def weight_reader(source: str) -> tuple[Callable[[str], torch.Tensor], set[str]]:
    """(read tensor by name, available names) for a pretrained model (hub name or folder) or a full .pt."""
    if source.endswith(".pt"):
        # mmap: tensors are paged in as they are read, so rank 0 does not hold the whole file at once.
        state = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
        return state.__getitem__, set(state)
    reader = SafetensorsReader(source)
    return reader, reader.names()


class UnitMaterializer:
    """FSDP1 `param_init_fn`: allocate a meta module's own tensors on `device`; with `read` given (rank-0-only
    loading), filled with rank 0's values, else left empty for a checkpoint to fill after sharding.

    Collective when filling: every rank must be called for the same modules in the same order (FSDP1
    guarantees it: its traversal depends only on the module structure). `read` (rank 0 only) returns a tensor
    by name.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        fill: bool,
        read: Callable[[str], torch.Tensor] | None = None,
        available: set[str] | None = None,
    ):
        # Every name of every parameter: a tied weight has several and the file may hold any one of them.
        self.aliases: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            self.aliases.setdefault(id(param), []).append(name)
        self.buffer_names = {id(b): name for name, b in model.named_buffers(remove_duplicate=False)}
        self.device, self.fill, self.read, self.available = device, fill, read, available or set()
        # Weakly held: a tied weight is met again only inside its own unit, while that unit's modules still
        # hold it. A plain dict kept every unit's full, unsharded parameters alive after FSDP had flattened
        # and sharded them: the whole model resident on every rank for the whole run.
        self.materialized: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()
        self.is_rank0 = dist.get_rank() == 0
        self.base_prefix = f"{getattr(model, 'base_model_prefix', '')}."

    def _spellings(self, names: list[str]) -> list[str]:
        """`names`, then each as the base model names it (a PEFT model's: base_weight_name), then each of those
        without the model's base prefix."""
        based = [base_weight_name(name) for name in names]
        return [
            *names,
            *based,
            *(name.removeprefix(self.base_prefix) for name in based if name.startswith(self.base_prefix)),
        ]

    def _allocated(self, meta: torch.Tensor, names: list[str]) -> torch.Tensor:
        tensor = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        if not self.fill:
            return tensor
        if self.is_rank0:
            # A checkpoint may store names without the model's base prefix (GPT-2's: wte.weight, not
            # transformer.wte.weight), which from_pretrained accepts too.
            stored = next((name for name in self._spellings(names) if name in self.available), None)
            if stored is None:
                raise ConfigError(f"the pretrained weights have none of {names}: another model?")
            tensor.copy_(self.read(stored))
        dist.broadcast(tensor, src=0)
        return tensor

    def __call__(self, module: nn.Module) -> None:
        trim_host_heap()  # the previous unit's full parameters are freed by now: keep them off the RSS
        for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            real = self.materialized.get(id(param))
            if real is None:
                if not param.is_meta:
                    continue
                allocated = self._allocated(param, self.aliases[id(param)])
                real = nn.Parameter(allocated, requires_grad=param.requires_grad)
                self.materialized[id(param)] = real
            setattr(module, name, real)  # replaces the registered parameter (tied ones by the same object)
        for name, buffer in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            if buffer.is_meta:  # setattr keeps a buffer's persistence
                setattr(module, name, self._allocated(buffer, [self.buffer_names.get(id(buffer), name)]))


def to_empty(model: nn.Module, device: torch.device) -> None:
    """model.to_empty(device), keeping the values of its computed non-persistent buffers (RoPE's inv_freq,
    loading.computed_buffers): no state dict holds them, so nothing would fill them again. And keeping tied
    weights one parameter: on an unwrapped model to_empty makes each of T5's `shared`, `embed_tokens` and
    `lm_head` a parameter of its own (FSDP's parameters stay tied)."""
    computed = computed_buffers(model)
    tied = tied_parameter_names(model)
    model.to_empty(device=device)
    for first, *aliases in tied:
        parameter = model.get_parameter(first)
        for alias in aliases:
            owner, _, name = alias.rpartition(".")
            if model.get_parameter(alias) is not parameter:
                setattr(model.get_submodule(owner), name, parameter)
    with torch.no_grad():
        for name, value in computed.items():
            model.get_buffer(name).copy_(value)


def tied_parameter_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that has several, first the one named_parameters() gives."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def broadcast_rank0_weights(model: nn.Module, rank0_state: dict, device: torch.device) -> None:
    """Fill an FSDP2 model whose non-zero ranks were built on the meta device with rank 0's weights.

    Collective. to_empty allocates each rank's shards (uninitialised), then rank 0's full state dict is
    broadcast shard by shard. The tied embedding stays one parameter: to_empty keeps parameter identity.
    """
    to_empty(model, device)
    set_model_state_dict(
        model, rank0_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
