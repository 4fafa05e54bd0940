"""The tutorial's FSDP MixedPrecision policies, and the one place that chooses between them.

param_dtype is the compute dtype of the gathered parameters, reduce_dtype the dtype of the gradient reduce-
scatter/all-reduce, buffer_dtype the dtype of buffers (T5 has none; BART's final_logits_bias is one). The
sharded fp32 master copy that the optimizer updates is unaffected by all of them. A policy is named by its key
in POLICIES everywhere (config.json, the log). `resolve_precision` turns the settings into one Precision, once
per run; everything that depends on the precision asks that object."""

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

from configs.fsdp import FSDPConfig

fpSixteen = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)

bfSixteen = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)

# bf16 compute with the gradient reduce-scatter in fp32 (torchtitan's default, and this package's for bf16):
# a bf16 sum keeps 8 significant bits, so each reduction of N ranks' gradients rounds away what the ranks
# disagree on below 2**-8 of the gradient. Costs twice bfSixteen's gradient traffic (the same as fp32's).
bfSixteen_fp32_reduce = MixedPrecision(
    param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16
)

# Compute in fp32 but halve the gradient traffic: for when bf16 compute hurts accuracy, or comms dominate.
bfSixteen_working = MixedPrecision(
    param_dtype=torch.float32, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
)

fp32_policy = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32)

POLICIES = {
    "fpSixteen": fpSixteen,
    "bfSixteen": bfSixteen,
    "bfSixteen_fp32_reduce": bfSixteen_fp32_reduce,
    "bfSixteen_working": bfSixteen_working,
    "fp32_policy": fp32_policy,
}


def bf16_supported(device: torch.device) -> bool:
    """Can this device compute in bf16 and its backend reduce bf16 tensors?

    Replaces the tutorial's check, which imported pkg_resources (gone from recent setuptools) and read
    torch.version.cuda (None on CPU builds; docs/pitfalls.md #6). On CUDA: the GPU supports bf16 (Ampere or
    newer) and NCCL is 2.10+, the first with bf16 reductions. On CPU: torch computes bf16 on any x86/ARM CPU
    (natively with AVX512-BF16/AMX, emulated and slower otherwise) and gloo reduces bf16, so a tiny bf16
    matmul is the test.
    """
    if device.type == "cuda":
        nccl_ok = dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
        return bool(torch.cuda.is_bf16_supported() and nccl_ok)
    try:
        probe = torch.ones(2, 2, dtype=torch.bfloat16)
        return bool((probe @ probe).eq(2).all())
    except RuntimeError:
        return False


def select_policy_name(fsdp_config: FSDPConfig, bf16_ok: bool) -> str:
    """Name of the policy (a key of POLICIES) the config asks for on hardware where bf16 is `bf16_ok`.

    bf16 that the hardware cannot do falls back to fp32 (the tutorial's behaviour). bfSixteen reduces in
    fp32 unless --reduce_dtype bf16 asks for the tutorial's all-bf16 policy (configs/validate.py refuses
    the combinations that make no sense).
    """
    if not fsdp_config.mixed_precision:
        return "fp32_policy"
    if fsdp_config.use_fp16:
        return "fpSixteen"
    if not bf16_ok:
        return "fp32_policy"
    if fsdp_config.bf16_policy == "bfSixteen" and fsdp_config.reduce_dtype != "bf16":
        return "bfSixteen_fp32_reduce"
    return fsdp_config.bf16_policy


@dataclass(frozen=True)
class Precision:
    """The run's precision: a policy of POLICIES, resolved once for the settings and the device."""

    name: str  # a key of POLICIES (config.json, the log)
    fallback: str | None = None  # why bf16 was asked for and fp32 is used (to be logged), else None

    @property
    def policy(self) -> MixedPrecision:
        """FSDP1's MixedPrecision, each unit casting its floating inputs to the compute dtype (FSDP2's
        default). FSDP1's own default casts at the root's forward only, which `generate` skips: the summoned
        root then runs in fp32 and hands fp32 activations to bf16 units, and a BART layer's LayerNorm refuses
        them on CPU ("mixed dtype"). In training every unit's input already is in the compute dtype."""
        return dataclasses.replace(POLICIES[self.name], cast_forward_inputs=True)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.param_dtype

    @property
    def needs_grad_scaler(self) -> bool:
        """fp16 gradients underflow without loss scaling (docs/pitfalls.md #5); bf16 and fp32 need none."""
        return self.compute_dtype == torch.float16

    @property
    def fsdp2_policy(self) -> MixedPrecisionPolicy:
        """The FSDP2 form of the policy (buffer_dtype has no FSDP2 equivalent: FSDP2 leaves buffers alone)."""
        return MixedPrecisionPolicy(param_dtype=self.policy.param_dtype, reduce_dtype=self.policy.reduce_dtype)


def resolve_precision(fsdp_config: FSDPConfig, device: torch.device) -> Precision:
    """The policy for these settings on `device`; bf16 that the device cannot do falls back to fp32."""
    bf16_ok = bf16_supported(device)
    fallback = None
    if fsdp_config.mixed_precision and not fsdp_config.use_fp16 and not bf16_ok:
        fallback = f"bf16 is not supported on {device}: training in fp32 instead"
    return Precision(select_policy_name(fsdp_config, bf16_ok), fallback)
