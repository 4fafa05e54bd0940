"""LoRA through PEFT (--peft lora): adapters on the frozen model, before FSDP wraps it, and their export.

FSDP sees the PEFT model as it would the plain one: the stack layers (T5Blocks) become the units. Only the adapters
require grad, so AdamW holds state for them alone. A FSDP1 flat parameter cannot mix frozen and trained
weights ("FlatParameter requires uniform requires_grad"), so the wrap policy makes each adapter a unit of
its own (policies/wrapping.py). With use_orig_params FSDP1 would accept the mix, but a block's flat
parameter then puts every q/v adapter in rank 0's half. FSDP2 shards parameter by parameter. Checkpoints
hold the whole model (frozen weights included), so resuming needs nothing else. The export
(utils/checkpoint/hf_export.py: `lora_exports`) gathers the adapters alone, which PEFT's `save_pretrained`
writes; the merged model is computed row block by row block on the ranks that hold W, never gathered.
"""

import contextlib
import os

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from configs.errors import ConfigError
from configs.lora import LoraConfig
from utils.base.log import warnings_ignored
from utils.model.source import looks_like_local_path
from utils.spec import ModelSpec

# get_peft_model reads transformers' `is_gradient_checkpointing`, which transformers 5 deprecates (for
# `is_activation_checkpointing`): a warning about the two libraries' internals, per rank and per call.
PEFT_ASKS_A_DEPRECATED_PROPERTY = (FutureWarning, "`is_gradient_checkpointing` is deprecated")
PEFT_PREFIX = "base_model.model."  # PEFT's names of the wrapped model's parameters
ADAPTER_NAME = "default"  # PEFT's name of the one adapter (in parameter names: q.lora_A.default.weight)


# The attention's query and value projections, by the names the encoder-decoder families give them, for
# the families PEFT has no default for (UMT5, PEGASUS, mBART in peft 0.21): T5's family, then BART's.
QUERY_VALUE_NAMES = (("q", "v"), ("q_proj", "v_proj"))
ALL_LINEAR = "all-linear"  # PEFT's INCLUDE_LINEAR_LAYERS_SHORTHAND


def target_modules(lora: LoraConfig, model: nn.Module) -> list[str]:
    """--lora_target_modules as a list of layer names; `auto`: PEFT's default for the model's family (T5 and
    mT5: q, v; BART: q_proj, v_proj), else its attention's query and value projections; `all-linear`: PEFT's
    shorthand, every linear layer but the output head (lm_head)."""
    if lora.lora_target_modules.lower() == ALL_LINEAR:  # PEFT's spelling, read case-insensitively as PEFT does
        head = model.get_output_embeddings()
        heads = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is head}
        return [name for name in linear_layer_names(model) if name not in heads]
    if lora.lora_target_modules != "auto":
        return [name.strip() for name in lora.lora_target_modules.split(",") if name.strip()]
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    default = PEFT_DEFAULTS.get(model.config.model_type)
    if default:
        return list(default)
    layers = set(linear_layer_names(model))
    for names in QUERY_VALUE_NAMES:
        if layers.issuperset(names):
            return list(names)
    raise ConfigError(
        f"--lora_target_modules auto: no default for a {model.config.model_type} model (PEFT has none, and it "
        f"has no q/v or q_proj/v_proj layers). Name them: its linear layers are {','.join(sorted(layers))}"
    )


def transposed_layers(model: nn.Module) -> frozenset[str]:
    """The adapted layers whose weight is stored (in, out), as state dicts name them: GPT-2's Conv1D, which
    PEFT adapts with fan_in_fan_out (hf_export.lora_exports merges them transposed). FSDP's and activation
    checkpointing's wrappers are left out of the names."""
    from peft.tuners.lora import LoraLayer

    return frozenset(
        ".".join(part for part in name.split(".") if not part.endswith("wrapped_module"))
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and getattr(module, "fan_in_fan_out", False)
    )


def adapter_base(model_name: str) -> str:
    """What PeftModel.from_pretrained loads the adapter onto (adapter_config.json names it): a local folder as
    an absolute path, so that it is found from any working directory; a hub name as it is."""
    return os.path.abspath(model_name) if looks_like_local_path(model_name) else model_name


def apply_lora(
    model: nn.Module, lora: LoraConfig, base_model: str, spec: ModelSpec, adapters_on_meta: bool = False
) -> nn.Module:
    """The PEFT model: `model` (of `spec`) frozen, adapters (B zero-initialised, so training starts from the
    model) on the target layers; `base_model` (adapter_base) is what the adapter's config names as its base.
    Seeded by the caller's RNG state, the same on every rank. On a skeleton (rank-0-only loading, a resume)
    the adapters are built in host memory all the same, with the values and the random draws they get on the
    loaded model (adapters_initialised_on_skeleton); `adapters_on_meta`: left on the meta device instead, for a
    weights file to fill (FSDP1's rank-0-only loading from a LoRA run's .pt)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = linear_layer_names(model)
    targets = target_modules(lora, model)
    targeted = [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] in targets]
    peft_config = PeftLoraConfig(
        task_type=TaskType(spec.lora_task_type),
        r=lora.lora_r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=targets,
        # GPT-2's Conv1D stores its weight (in, out): said here, PEFT does not warn once per layer.
        fan_in_fan_out=bool(targeted) and all(isinstance(module, Conv1D) for module in targeted),
    )
    built = contextlib.nullcontext() if adapters_on_meta else adapters_initialised_on_skeleton(targeted)
    try:
        with warnings_ignored(PEFT_ASKS_A_DEPRECATED_PROPERTY), built:
            model = get_peft_model(model, peft_config)
    except ValueError:  # PEFT's NoMatchingPeftModuleError: not one target matched
        raise ConfigError(_missing_targets(targets, layers)) from None
    # get_peft_model names the base after the model's name_or_path (maybe relative; and it warns when the
    # config named another): the export's adapter_config.json must name what PeftModel.from_pretrained finds.
    model.peft_config[ADAPTER_NAME].base_model_name_or_path = base_model
    adapted = {name.rsplit(".", 1)[-1] for name in model.targeted_module_names}
    missing = [target for target in targets if target not in adapted]
    if missing:  # PEFT adapts what matches and says nothing about the rest
        raise ConfigError(_missing_targets(missing, layers))
    for module in model.modules():
        # PEFT casts an adapter's input to its weight's dtype, read outside FSDP's forward: a FSDP1 unit's
        # weight is then the fp32 shard, while its forward computes in bf16 ("expected m1 and m2 to have the
        # same dtype"). FSDP's mixed precision already gives the input and the weights one dtype.
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False
    return model


@contextlib.contextmanager
def adapters_initialised_on_skeleton(targeted: list[nn.Module]):
    """Inside, each targeted layer's meta weights are stand-ins in host memory of their shape and dtype that hold
    one element (a 0-stride view): PEFT builds each adapter on the default device, initialises it from the
    random stream and then moves it to its base layer's device, which on a skeleton is the meta device, where
    the values are lost. With the stand-ins they stay, equal to a loaded model's (same draws in the same order),
    so rank-0-only loading starts the adapters where loading on every rank does. The meta weights come back
    after, frozen as PEFT froze the stand-ins. A default device of meta (an export's PEFT skeleton) keeps them
    on meta."""
    swapped = []
    for module in targeted:
        for name, weight in list(module.named_parameters(recurse=False)):
            if weight.is_meta:
                stand_in = torch.zeros((), dtype=weight.dtype).expand(weight.shape)
                module._parameters[name] = nn.Parameter(stand_in, requires_grad=weight.requires_grad)
                swapped.append((module, name, weight))
    try:
        yield
    finally:
        for module, name, weight in swapped:
            weight.requires_grad_(module._parameters[name].requires_grad)
            module._parameters[name] = weight


def base_weight_name(name: str) -> str:
    """A PEFT model's parameter name as its base model names it (what a pretrained weights file holds): without
    PEFT's prefix and an adapted layer's base_layer."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def holds_adapters(weights_file: str) -> bool:
    """Whether a full .pt was saved by a LoRA run (PEFT's names), rather than by a plain model."""
    state = torch.load(weights_file, map_location="cpu", weights_only=True, mmap=True)  # keys: nothing read
    return any(key.startswith(PEFT_PREFIX) for key in state)


def _missing_targets(missing: list[str], layers: list[str]) -> str:
    # A gated T5 (v1.1, flan-t5) has wi_0 and wi_1 where T5 v1.0 has wi.
    return (
        f"--lora_target_modules {','.join(missing)}: no such layer in this model; its linear layers are "
        f"{','.join(layers)}"
    )


def linear_layer_names(model: nn.Module) -> list[str]:
    """The short names of a model's linear layers, GPT-2's Conv1D included (of a PEFT model's: an adapted
    layer's base_layer by its own name, the adapters' inner layers left out)."""
    names = set()
    for path, module in model.named_modules():
        parts = path.split(".")
        if not isinstance(module, nn.Linear | Conv1D) or any(part.startswith("lora_") for part in parts):
            continue
        names.add(parts[-2] if parts[-1] == "base_layer" else parts[-1])
    return sorted(names)


def trainable_share(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters), tied weights once."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
