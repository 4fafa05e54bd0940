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


def input_embedding_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose outputs are the model's input embeddings: a decoder-only model's
    get_input_embeddings() (a PEFT model's base model's: PEFT hands the call on), which is where HF's Trainer
    hooks it; an encoder-decoder's encoder's and decoder's. transformers 5 gives T5's and BART's stacks
    embedding modules of their own, tied to the shared one, which is then never called: HF's hook on it adds
    nothing there, these add the noise its hook added when the stacks called the shared module."""
    if not model.config.is_encoder_decoder:
        return [model.get_input_embeddings()]
    stacks = (model.get_encoder().get_input_embeddings(), model.get_decoder().get_input_embeddings())
    return list({id(module): module for module in stacks}.values())  # one module where both stacks call it


def add_embedding_noise(model: nn.Module, alpha: float) -> list[str]:
    """Hook NEFTune's noise of `alpha` onto `model`'s input embeddings (input_embedding_modules); their names
    in `model`."""
    modules = input_embedding_modules(model)
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
