"""The tutorial's FSDP MixedPrecision policies, and the one place that chooses between them.

param_dtype is the compute dtype of the gathered parameters, reduce_dtype the dtype of the gradient reduce-
scatter/all-reduce, buffer_dtype the dtype of buffers (T5 has none; BART's final_logits_bias is one). The
sharded fp32 master copy that the optimizer updates is unaffected by all of them. A policy is named by its key
in POLICIES everywhere (config.json, the log). `resolve_precision` turns the settings into one Precision, once
per run; everything that depends on the precision asks that object."""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

from configs.fsdp import FSDPConfig
from policies import private_api

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


def bf16_problem(device: torch.device, allow_emulated: bool = False) -> str | None:
    """Why bf16 training is not used on `device` (one line for the log), or None where it is (the tutorial's
    check, docs/pitfalls.md #6). bf16 needs the device to compute it and the backend to reduce it (NCCL 2.10+;
    gloo reduces bf16); by default bf16 kernels too, because emulated bf16 is slower than fp32 (the tutorial's
    fallback promise): on CUDA compute capability 8.0 (Ampere), on CPU oneDNN's (AVX512, AMX, ARM's bf16)."""
    if device.type == "cuda":
        if not (dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)):
            return "bf16 needs NCCL 2.10 or newer for its reductions: training in fp32 instead"
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return None
        major, minor = torch.cuda.get_device_capability(device)
        if allow_emulated and torch.cuda.is_bf16_supported(including_emulation=True):
            return None
        return (
            f"this GPU (compute capability {major}.{minor}) emulates bf16, more slowly than it computes fp32 "
            "(native bf16 needs 8.0, Ampere): training in fp32 instead; --allow_emulated_bf16 true to use bf16"
        )
    if private_api.cpu_has_native_bf16():
        return None
    if allow_emulated and cpu_computes_bf16():
        return None
    return (
        f"oneDNN has no bf16 kernels for this CPU ({torch.backends.cpu.get_cpu_capability()}; they need AVX512 or "
        "AMX), and torch's emulated bf16 is slower than fp32: training in fp32 instead; --allow_emulated_bf16 "
        "true to use bf16"
    )


def cpu_computes_bf16() -> bool:
    """Does torch compute bf16 on this CPU at all (natively or emulated)? A tiny bf16 matmul tells."""
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
    tf32: bool = False  # fp32 matmuls on TF32 tensor cores (--tf32 on a CUDA device)

    @property
    def policy(self) -> MixedPrecision:
        """FSDP1's MixedPrecision, each unit casting its floating inputs to the compute dtype (FSDP2's
        default). FSDP1's own default casts at the root's forward only, which `generate` skips: the summoned
        root then runs in fp32 and hands fp32 activations to bf16 units, and a BART layer's LayerNorm refuses
        them on CPU ("mixed dtype"). In training every unit's input already is in the compute dtype."""
        return dataclasses.replace(POLICIES[self.name], cast_forward_inputs=True)

    def set_matmul_precision(self) -> None:
        """TF32 for this process's fp32 matmuls where the run takes it; otherwise torch's setting is left as
        it is (IEEE by default), so CPU runs and in-process tests keep their exact fp32."""
        if self.tf32:
            # The global setter, not torch.backends.cuda.matmul.fp32_precision: after the per-backend one,
            # torch.get_float32_matmul_precision() (which inductor calls) raises on the mix of the two APIs.
            torch.set_float32_matmul_precision("high")

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.policy.param_dtype

    @property
    def unwrapped_name(self) -> str:
        """The precision of a model FSDP does not wrap (--single_rank_fsdp false): autocast to the compute
        dtype, or fp32 (the run record's name for it)."""
        dtype = str(self.compute_dtype).removeprefix("torch.")
        return "fp32" if self.compute_dtype == torch.float32 else f"autocast_{dtype}"

    @property
    def needs_grad_scaler(self) -> bool:
        """fp16 gradients underflow without loss scaling (docs/pitfalls.md #5); bf16 and fp32 need none."""
        return self.compute_dtype == torch.float16

    @property
    def fsdp2_policy(self) -> MixedPrecisionPolicy:
        """The FSDP2 form of the policy (buffer_dtype has no FSDP2 equivalent: FSDP2 leaves buffers alone)."""
        return MixedPrecisionPolicy(param_dtype=self.policy.param_dtype, reduce_dtype=self.policy.reduce_dtype)


def resolve_precision(
    fsdp_config: FSDPConfig, device: torch.device, any_rank: Callable[[bool], bool] = bool
) -> Precision:
    """The policy for these settings on `device`: bf16 falls back to fp32 where the device cannot do it, or
    only emulates it (unless --allow_emulated_bf16 true). `any_rank(flag)`: whether the flag holds on any rank
    (collective); every rank then falls back if one does, since FSDP's collectives need one dtype on all."""
    wants_bf16 = fsdp_config.mixed_precision and not fsdp_config.use_fp16
    fallback = bf16_problem(device, fsdp_config.allow_emulated_bf16) if wants_bf16 else None
    if any_rank(fallback is not None) and fallback is None:
        fallback = "another rank's device has no bf16 kernels: every rank trains in fp32"
    tf32 = fsdp_config.tf32 and device.type == "cuda"
    return Precision(name=select_policy_name(fsdp_config, fallback is None), fallback=fallback, tf32=tf32)
