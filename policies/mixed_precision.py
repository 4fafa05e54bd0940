"""The tutorial's FSDP MixedPrecision policies, and the choice between them.

param_dtype is the compute dtype of the gathered parameters, reduce_dtype the dtype of the gradient
reduce-scatter/all-reduce, buffer_dtype the dtype of buffers (T5 has none that matter). The sharded fp32
master copy that the optimizer updates is unaffected by all of them.
"""

import torch
from torch.distributed.fsdp import MixedPrecision

fpSixteen = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)

bfSixteen = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)

# Compute in fp32 but halve the gradient traffic: for when bf16 compute hurts accuracy, or comms dominate.
bfSixteen_working = MixedPrecision(
    param_dtype=torch.float32, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
)

fp32_policy = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32)

POLICIES = {
    "fpSixteen": fpSixteen,
    "bfSixteen": bfSixteen,
    "bfSixteen_working": bfSixteen_working,
    "fp32_policy": fp32_policy,
}


def select_policy_name(mixed_precision: bool, use_fp16: bool, bf16_policy: str, bf16_supported: bool) -> str:
    """Name of the policy (a key of POLICIES) the config asks for on this hardware.

    bf16 that the hardware cannot do falls back to fp32 (the tutorial's behaviour); the caller warns.
    """
    if bf16_policy not in ("bfSixteen", "bfSixteen_working"):
        raise ValueError(f"bf16_policy must be bfSixteen or bfSixteen_working, not {bf16_policy!r}")
    if not mixed_precision:
        return "fp32_policy"
    if use_fp16:
        return "fpSixteen"
    return bf16_policy if bf16_supported else "fp32_policy"
