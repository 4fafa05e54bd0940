"""--float8 true: torchao's float8 training of the model's Linear layers (torchao.float8), swapped in before the
model is compiled and wrapped.

Each converted layer computes its forward and both backward matmuls in float8 (`torch._scaled_mm`) from the
high-precision weights and activations, scaled per tensor from their absolute maximum (torchao's default
recipe, "tensorwise"); the weights, their gradients and the optimizer stay as they were. Not converted: the
output head (the logits' matmul, whose rounding every token's loss reads) and the layers whose dimensions
float8's matmul cannot take (not multiples of 16). The settings and devices torchao's float8 needs are checked
before anything loads (configs/validate.py: check_float8).
"""

from collections.abc import Callable

from torch import nn

from configs.errors import ConfigError
from utils.base.log import get_logger

# torch._scaled_mm takes matrices whose two dimensions are multiples of 16 (torchao's own filter checks the same).
FLOAT8_DIMENSION_MULTIPLE = 16


def float8_layer_filter(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """torchao's `module_filter_fn` for `model`: every Linear but the output head and those float8 cannot take."""
    head = model.get_output_embeddings()

    def converts(module: nn.Module, name: str) -> bool:  # noqa: ARG001 - torchao's signature
        fits = all(size % FLOAT8_DIMENSION_MULTIPLE == 0 for size in module.weight.shape)
        return isinstance(module, nn.Linear) and module is not head and fits

    return converts


def convert_to_float8(model: nn.Module, all_gather_in_float8: bool) -> list[str]:
    """Swap `model`'s Linear layers (float8_layer_filter) for torchao's Float8Linear, in place; their names.
    `all_gather_in_float8`: FSDP2 gathers the converted weights cast to float8, half of bf16's traffic
    (torchao's enable_fsdp_float8_all_gather)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    linears = sum(isinstance(module, nn.Linear) for module in model.modules())
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather_in_float8)
    convert_to_float8_training(model, module_filter_fn=float8_layer_filter(model), config=config)
    converted = [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]
    if not converted:  # GPT-2's layers are Conv1D: a float8 run would be a bf16 run under another name
        raise ConfigError(
            f"--float8 true: none of this model's {linears} Linear layers can compute in float8 (its layers are "
            f"of other classes, such as GPT-2's Conv1D, or their dimensions are not multiples of "
            f"{FLOAT8_DIMENSION_MULTIPLE}). Leave --float8 false for this model."
        )
    get_logger().info(
        "float8 (torchao): %d of the %d Linear layers compute in float8%s; the others are the output head and "
        "those whose dimensions are not multiples of %d",
        len(converted), linears, ", their weights all-gathered in float8" if all_gather_in_float8 else "",
        FLOAT8_DIMENSION_MULTIPLE,
    )  # fmt: skip
    return converted
