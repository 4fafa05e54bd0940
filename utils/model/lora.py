"""LoRA through PEFT (--peft lora): adapters on the frozen T5, before FSDP wraps it, and their export.

FSDP sees the PEFT model as it would the plain one: the T5Blocks become the units. Only the adapters
require grad, so AdamW holds state for them alone. A FSDP1 flat parameter cannot mix frozen and trained
weights ("FlatParameter requires uniform requires_grad"), so the wrap policy makes each adapter a unit of
its own (policies/wrapping.py). With use_orig_params FSDP1 would accept the mix, but a block's flat
parameter then puts every q/v adapter in rank 0's half. FSDP2 shards parameter by parameter. Checkpoints
hold the whole model (frozen weights included), so resuming needs nothing else. The export
(`write_lora_folders`) rebuilds the PEFT model on rank 0 from the gathered state dict: PEFT's
`save_pretrained` writes the adapter alone, `merge_and_unload` the merged model.
"""

import copy
import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import T5ForConditionalGeneration

from configs.training import TrainConfig
from utils.checkpoint.hf_export import write_hf_folder
from utils.errors import ConfigError
from utils.files import atomic_path
from utils.model.loading import looks_like_local_path

PEFT_PREFIX = "base_model.model."  # PEFT's names of the wrapped model's parameters


@dataclass(frozen=True)
class LoraSettings:
    r: int
    alpha: int
    dropout: float
    target_modules: tuple[str, ...]
    base_model: str  # what PeftModel.from_pretrained loads the adapter onto (adapter_config.json)
    merge: bool  # also export the merged model

    @classmethod
    def from_config(cls, config: TrainConfig) -> "LoraSettings | None":
        if config.peft != "lora":
            return None
        modules = tuple(name.strip() for name in config.lora_target_modules.split(",") if name.strip())
        # A local folder as an absolute path: adapter_config.json must name it from any working directory.
        base = (
            os.path.abspath(config.model_name) if looks_like_local_path(config.model_name) else config.model_name
        )
        return cls(config.lora_r, config.lora_alpha, config.lora_dropout, modules, base, config.merge_lora)

    def peft_config(self):
        from peft import LoraConfig, TaskType

        return LoraConfig(
            task_type=TaskType.SEQ_2_SEQ_LM,
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            base_model_name_or_path=self.base_model,
        )


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """The PEFT model: `model` frozen, adapters (B zero-initialised, so training starts from the model) on
    the target layers. Seeded by the caller's RNG state, the same on every rank."""
    from peft import get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = linear_layer_names(model)
    try:
        model = get_peft_model(model, settings.peft_config())
    except ValueError:  # PEFT's NoMatchingPeftModuleError: not one target matched
        raise ConfigError(_missing_targets(settings.target_modules, layers)) from None
    adapted = {name.rsplit(".", 1)[-1] for name in model.targeted_module_names}
    missing = tuple(target for target in settings.target_modules if target not in adapted)
    if missing:  # PEFT adapts what matches and says nothing about the rest
        raise ConfigError(_missing_targets(missing, layers))
    for module in model.modules():
        # PEFT casts an adapter's input to its weight's dtype, read outside FSDP's forward: a FSDP1 unit's
        # weight is then the fp32 shard, while its forward computes in bf16 ("expected m1 and m2 to have the
        # same dtype"). FSDP's mixed precision already gives the input and the weights one dtype.
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False
    return model


def holds_adapters(weights_file: str) -> bool:
    """Whether a full .pt was saved by a LoRA run (PEFT's names), rather than by a plain model."""
    state = torch.load(weights_file, map_location="cpu", weights_only=True, mmap=True)  # keys: nothing read
    return any(key.startswith(PEFT_PREFIX) for key in state)


def _missing_targets(missing: tuple[str, ...], layers: list[str]) -> str:
    # A gated T5 (v1.1, flan-t5) has wi_0 and wi_1 where T5 v1.0 has wi.
    return (
        f"--lora_target_modules {','.join(missing)}: no such layer in this model; its linear layers are "
        f"{','.join(layers)}"
    )


def linear_layer_names(model: nn.Module) -> list[str]:
    """The short names of a model's linear layers (of a PEFT model's: an adapted layer's base_layer by its
    own name, the adapters' inner layers left out)."""
    names = set()
    for path, module in model.named_modules():
        parts = path.split(".")
        if not isinstance(module, nn.Linear) or any(part.startswith("lora_") for part in parts):
            continue
        names.add(parts[-2] if parts[-1] == "base_layer" else parts[-1])
    return sorted(names)


def trainable_share(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters), tied weights once."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def write_lora_folders(state_dict: dict, model_config, tokenizer, settings: LoraSettings, folders: tuple) -> None:
    """Rank 0: the adapter folder (PEFT save_pretrained + tokenizer) and, with settings.merge, the merged
    model as a plain transformers folder. `folders`: (adapter folder, merged folder)."""
    adapter_folder, merged_folder = folders
    config = copy.deepcopy(model_config)
    config.use_cache = True
    with torch.device("meta"):  # no random init of a model about to be overwritten
        peft_model = apply_lora(T5ForConditionalGeneration(config), settings)
    peft_model.to_empty(device="cpu")  # keeps parameter identity: the tied embedding stays one tensor
    peft_model.load_state_dict(state_dict, strict=True)
    # PEFT names the base after the skeleton's config, which has no name: PeftModel.from_pretrained reads it.
    peft_model.peft_config["default"].base_model_name_or_path = settings.base_model
    with atomic_path(adapter_folder) as tmp:
        peft_model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    if settings.merge:
        merged = peft_model.merge_and_unload()
        write_hf_folder(merged.state_dict(), model_config, tokenizer, merged_folder)
