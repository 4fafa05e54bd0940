"""NEFTune (--neftune_noise_alpha; Jain et al. 2023, "NEFTune: Noisy Embeddings Improve Instruction
Finetuning"): uniform noise on the input embeddings while the model trains, as transformers' Trainer and TRL
add it (transformers.integrations.neftune: neftune_post_forward_hook).

A forward hook on the module that embeds the input ids adds noise drawn uniformly from [-b, b] to every element
of its output, b = alpha / sqrt(length x width): the output's padded sequence length and hidden width, so the
noise's norm per row is about alpha / sqrt(3) whatever the shape. In evaluation (module.training false: the
validation loss, generation) it adds nothing. The noise is drawn from the global generator of the output's
device, which each rank's checkpoint holds (utils/checkpoint/manager.py: the RNG files): a resume on the same
number of ranks draws the same noise, as it draws the same dropout masks.

The hook is added to the unwrapped model, before FSDP: FSDP1 (flat parameters) and FSDP2 keep the embedding
module and call it in their forward, so the sharded model is noised as the unsharded one.
"""

import functools

import torch
from torch import nn

from utils.spec import ModelSpec


def add_embedding_noise(model: nn.Module, alpha: float, spec: ModelSpec) -> list[str]:
    """Hook NEFTune's noise of `alpha` onto `model`'s input embeddings (the spec's input_embeddings); their
    names in `model`."""
    modules = spec.input_embeddings(model)
    for module in modules:
        module.register_forward_hook(functools.partial(noisy_embeddings, alpha))
    return [name for name, module in model.named_modules() if any(module is hooked for hooked in modules)]


def noisy_embeddings(alpha: float, module: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """The forward hook: `output` (rows, length, width) plus uniform noise in [-b, b], b = alpha /
    sqrt(length x width), while `module` trains; `output` itself in evaluation."""
    if not module.training:
        return output
    # In float32 on the host, as transformers' hook computes it: the same bound, so the same noise to the bit.
    bound = (alpha / torch.tensor(output.shape[1] * output.shape[2]).sqrt()).item()
    return output + torch.empty_like(output).uniform_(-bound, bound)
