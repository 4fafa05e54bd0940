"""How the model is spread over the ranks: chosen once, and asked by everything that depends on it.

    parallelism = parallelism_for(config.fsdp, world_size)   # FSDP1, FSDP2, or one rank unwrapped
    model = parallelism.wrap(model, precision=..., device=...)

FSDP1 (`--fsdp_version 1`, the tutorial's API, deprecated upstream) is the tutorial's one constructor call,
`FSDP(model, auto_wrap_policy=..., mixed_precision=..., sharding_strategy=..., ...)`, then activation
checkpointing of the stack layers inside their units (each T5Block for T5; policies/wrapping.py: layer_classes).
FSDP2 (`--fsdp_version 2`) reads like torchtitan's `parallelize`: activation checkpointing, then `fully_shard`
of every layer and of the root. With --float8, the Linear layers are swapped for torchao's float8 ones first;
with --compile, each layer is then compiled, for all three. At world size 1
with --single_rank_fsdp false nothing is sharded or wrapped: the model itself, its layers checkpointed and
compiled alike, computes under autocast (`Unwrapped`).

After wrapping, the object answers what differs between them; nothing else asks which backend the model is in.
How the tutorial's FSDP1 settings map onto FSDP2: docs/throughput.md's table (docs/pitfalls.md #15); what has
no FSDP2 meaning is refused by configs/validate.py before anything loads.
"""

import abc
import contextlib
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    FullStateDictConfig,
    ShardingStrategy,
    StateDictType,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

from configs.fsdp import FSDPConfig, wraps_in_fsdp
from policies.activation_checkpointing_functions import apply_fsdp_checkpointing
from policies.mixed_precision import Precision
from policies.private_api import fsdp1_units_kept_unsharded, fsdp1_unsharded_numel, fsdp2_units_kept_unsharded
from policies.wrapping import get_wrap_policy, layer_classes
from utils.base.log import get_logger, warnings_ignored
from utils.distributed.mesh import fsdp1_mesh, fsdp2_mesh
from utils.fsdp.shard import (
    FSDP1_NO_SHARD_WARNING,
    FSDP1_ONE_RANK_WARNING,
    RESHARD_AFTER_FORWARD,
    compile_layers,
    computed_buffers_kept,
    fsdp1_state_dict_warnings_ignored,
    layer_units,
    unit_class_name,
)
from utils.model.float8 import convert_to_float8
from utils.model.rank0_loading import UnitMaterializer, broadcast_rank0_weights, to_empty, weight_reader


class Parallelism(abc.ABC):
    """What every way of spreading the model shares; a subclass names the rest (FSDP1, FSDP2, Unwrapped)."""

    version = 0  # the FSDP version it wraps in (0: none), as the layout line names it
    stages_in_shared_memory = False  # a background save's copies go to shared memory for a writer process

    def __init__(self, fsdp: FSDPConfig):
        self.fsdp = fsdp

    def builds_on_meta(self, is_main: bool, restores: bool) -> bool:  # noqa: ARG002 - FSDP2's reads it
        """Whether this rank builds only a skeleton: every rank when a checkpoint will fill the shards
        (`restores`); with rank-0-only loading, as the backend fills the others."""
        return restores

    @property
    def fills_units_from_files(self) -> bool:
        """Rank-0-only loading fills each unit from the model's files as it is wrapped (FSDP1)."""
        return False

    @property
    def gathers_in_float8(self) -> bool:
        """With --float8: whether the float8 layers' weights are all-gathered cast to float8 (torchao's
        enable_fsdp_float8_all_gather, an FSDP2 extension), where there are shards to gather."""
        return False

    def wrap(
        self,
        model: nn.Module,
        *,
        precision: Precision,
        device: torch.device,
        weights_source: str = "",
        restores: bool = False,
    ) -> nn.Module:
        """`model` (unwrapped, on CPU or meta) spread over the default process group. Collective.

        With rank-0-only loading (--cpu_ram_efficient_loading) the ranks hold a skeleton on the meta device:
        FSDP1 fills each unit with rank 0's reads of `weights_source` (the pretrained model or a full .pt) as it
        wraps it; FSDP2 broadcasts rank 0's loaded weights into every rank's shards after sharding. `restores`:
        every rank holds a skeleton that a checkpoint fills after sharding (utils/checkpoint/manager.py), so the
        shards are only allocated."""
        layers = layer_classes(model)  # T5Block for T5: the units, what is checkpointed and compiled
        if self.fsdp.float8:  # before compiling and wrapping: FSDP2 shards the float8 layers' weights
            convert_to_float8(model, all_gather_in_float8=self.gathers_in_float8)
        if self.fsdp.compile:
            compile_layers(model, layers)
        return self._wrap(model, layers, precision, device, weights_source, restores)

    @abc.abstractmethod
    def _wrap(self, model, layers, precision, device, weights_source, restores) -> nn.Module:
        """The backend's own wrapping of `model` (its stack `layers` found, compiled where asked)."""

    def gradient_sync(self, model: nn.Module, enabled: bool):
        """Inside, unless `enabled`: this backward's gradient reduction is skipped, and gradients stay unsharded
        on every rank until a backward with the reduction."""
        return contextlib.nullcontext() if enabled else self._reduction_skipped(model)

    def _reduction_skipped(self, model: nn.Module):  # noqa: ARG002 - the backends' own
        return contextlib.nullcontext()  # one rank's unwrapped model reduces nothing

    def clip_grad_norm(self, model: nn.Module, limit: float) -> torch.Tensor:
        """The global gradient norm over every shard, before clipping to `limit`. Collective."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
        return (norm.full_tensor() if isinstance(norm, DTensor) else norm).detach()

    def generate(self, model: nn.Module, kwargs: dict) -> torch.Tensor:
        """`model.generate(**kwargs)`: FSDP2 gathers the root through a registered forward method; one rank's
        unwrapped model runs under autocast (`Unwrapped`)."""
        return model.generate(**kwargs)

    def kept_gathered(self, model: nn.Module):  # noqa: ARG002 - the backends' own
        """Inside: each unit stays gathered from its first forward on; all are freed at the end."""
        return contextlib.nullcontext()

    def inner(self, model: nn.Module) -> nn.Module:
        """The model the wrapper holds (its generation_config, its own attributes)."""
        return model

    def offloads_full_state(self, device: torch.device) -> bool:  # noqa: ARG002 - FSDP1's reads it
        """Whether a full state dict is copied to host memory as it is gathered."""
        return True

    @fsdp1_state_dict_warnings_ignored()
    def full_state_dict(self, model: nn.Module, device: torch.device) -> dict:  # noqa: ARG002 - FSDP1's reads it
        """The unsharded model state dict on rank 0 (streamed to its host memory unit by unit). Collective."""
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def param_numel_whole(self, model: nn.Module) -> int:
        """Elements of the model's parameters, whole, counted once however many ranks replicate them (FSDP2's
        DTensors count the whole parameter)."""
        return sum(p.numel() for p in model.parameters())

    def units(self, model: nn.Module) -> list[nn.Module]:  # noqa: ARG002 - the backends' own
        """The FSDP units, root first (none unwrapped)."""
        return []

    def describe(self, model: nn.Module, precision: Precision) -> None:
        """One line at INFO (units by class, precision); the wrapped module tree at DEBUG (long for t5-3b)."""
        units = self.units(model)
        tf32 = ", fp32 matmuls in TF32 (--tf32)" if precision.tf32 else ""
        by_class = Counter(unit_class_name(unit) for unit in units[1:])
        get_logger().info(
            "FSDP%d: %d units (root + %s)%s, mixed precision %s%s",
            self.version,
            len(units),
            " + ".join(f"{count} {name}" for name, count in by_class.items()),
            self._strategy_note(model),
            precision.name,
            tf32,
        )
        units_note = self._units_note(model, by_class)
        if units_note:
            get_logger().info("%s", units_note)
        get_logger().debug("FSDP model:\n%s", model)

    def _strategy_note(self, model: nn.Module) -> str:  # noqa: ARG002 - FSDP1's reads it
        return ""

    def _units_note(self, model: nn.Module, by_class: Counter) -> str:  # noqa: ARG002 - FSDP1's reads them
        return ""


class FSDP1(Parallelism):
    """FullyShardedDataParallel: the tutorial's wrapper, flat parameters per unit."""

    version = 1

    def builds_on_meta(self, is_main: bool, restores: bool) -> bool:  # noqa: ARG002 - every rank's the same
        return restores or self.fsdp.cpu_ram_efficient_loading  # each unit is filled as it is wrapped

    @property
    def fills_units_from_files(self) -> bool:
        return self.fsdp.cpu_ram_efficient_loading

    def _wrap(self, model, layers, precision, device, weights_source, restores) -> nn.Module:
        fsdp = self.fsdp
        param_init_fn = None
        if restores:
            param_init_fn = UnitMaterializer(model, device, fill=False)
        elif fsdp.cpu_ram_efficient_loading:
            read, available = weight_reader(weights_source) if dist.get_rank() == 0 else (None, set())
            param_init_fn = UnitMaterializer(model, device, fill=True, read=read, available=available)
        mesh = fsdp1_mesh(fsdp.sharding_strategy, dist.get_world_size(), device, fsdp.hybrid_shard_group_size)
        # The config names torch's enum members (it is read without importing torch).
        prefetch = None if fsdp.backward_prefetch is None else BackwardPrefetch[fsdp.backward_prefetch]
        with warnings_ignored(FSDP1_NO_SHARD_WARNING, FSDP1_ONE_RANK_WARNING):
            model = FSDP(
                model,
                auto_wrap_policy=get_wrap_policy(fsdp.wrap_policy, model, fsdp.min_num_params),
                mixed_precision=computed_buffers_kept(precision.policy, model),
                sharding_strategy=ShardingStrategy[fsdp.sharding_strategy],
                backward_prefetch=prefetch,
                limit_all_gathers=fsdp.limit_all_gathers,
                # FSDP moves each unit to the device as it wraps it, so a model that fits in host memory but not
                # on one GPU never needs to be on the GPU whole (tutorial: "FSDP model init on device").
                device_id=device,
                device_mesh=mesh,
                forward_prefetch=fsdp.forward_prefetch,
                use_orig_params=fsdp.use_orig_params,
                sync_module_states=fsdp.sync_module_states,
                cpu_offload=CPUOffload(offload_params=True) if fsdp.fsdp_cpu_offload else None,
                param_init_fn=param_init_fn,
            )
        if fsdp.fsdp_activation_checkpointing:
            apply_fsdp_checkpointing(model, layers, fsdp.activation_checkpointing_scope)
        return model

    def _reduction_skipped(self, model: nn.Module):
        return model.no_sync()

    def clip_grad_norm(self, model: nn.Module, limit: float) -> torch.Tensor:
        return model.clip_grad_norm_(limit).detach()

    def generate(self, model: nn.Module, kwargs: dict) -> torch.Tensor:
        """`generate` calls the encoder directly, not the model's forward, so FSDP1 never gathers the root
        unit's parameters (the shared embedding, the final norms, the tied lm_head): they are summoned around
        the whole call (docs/pitfalls.md #18)."""
        with FSDP.summon_full_params(model, recurse=False, writeback=False), _fsdp1_compute_dtype(model):
            return model.module.generate(**kwargs)

    def kept_gathered(self, model: nn.Module):
        return fsdp1_units_kept_unsharded(model)

    def inner(self, model: nn.Module) -> nn.Module:
        return model.module

    def offloads_full_state(self, device: torch.device) -> bool:
        """Not on a CPU group, where FSDP1's cpu_offload crashes (docs/pitfalls.md #1): there every rank holds
        the whole state until the save is written."""
        return device.type == "cuda"

    @fsdp1_state_dict_warnings_ignored()
    def full_state_dict(self, model: nn.Module, device: torch.device) -> dict:
        """The unsharded model state dict on rank 0 (an empty dict on every other rank: never index it there),
        gathered unit by unit, each copied to host memory at once where `offloads_full_state`."""
        policy = FullStateDictConfig(offload_to_cpu=self.offloads_full_state(device), rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, policy):
            return model.state_dict()

    def param_numel_whole(self, model: nn.Module) -> int:
        """FSDP1's flat parameters count their unpadded unsharded size."""
        return fsdp1_unsharded_numel(model)

    def units(self, model: nn.Module) -> list[nn.Module]:
        return [unit.module for unit in FSDP.fsdp_modules(model)]

    def _strategy_note(self, model: nn.Module) -> str:
        # the strategy as it runs (NO_SHARD at world size 1, whatever was asked)
        return f", {model.sharding_strategy.name}"

    def _units_note(self, model: nn.Module, by_class: Counter) -> str:
        # LoRA's lora_A and lora_B, units of their own under FSDP1 in a partly frozen model
        adapters = by_class.get("Linear", 0) if any(not p.requires_grad for p in model.parameters()) else 0
        if not adapters:
            return ""
        return (
            f"FSDP1: {adapters} of the units are LoRA adapters, each with its own all-gathers and reduce-scatters "
            "every step (a flat parameter cannot mix frozen and trained weights); --fsdp_version 2 keeps the "
            "adapters in their layers' units (docs/ecosystem.md: LoRA)"
        )


class FSDP2(Parallelism):
    """fully_shard: per-parameter DTensor shards, each layer and the root a unit."""

    version = 2
    stages_in_shared_memory = True  # DCP's writer process reads the staged DTensor shards

    def builds_on_meta(self, is_main: bool, restores: bool) -> bool:
        return restores or (self.fsdp.cpu_ram_efficient_loading and not is_main)  # rank 0's is broadcast

    @property
    def gathers_in_float8(self) -> bool:
        return dist.get_world_size() > 1 and self.fsdp.sharding_strategy != "NO_SHARD"

    def _wrap(self, model, layers, precision, device, weights_source, restores) -> nn.Module:  # noqa: ARG002
        fsdp = self.fsdp
        rank0_state = None
        if fsdp.cpu_ram_efficient_loading and not restores:
            # References to rank 0's loaded tensors: they stay alive (one full copy) until the broadcast.
            rank0_state = model.state_dict() if dist.get_rank() == 0 else {}
        if fsdp.fsdp_activation_checkpointing:  # before sharding: FSDP2 shards the checkpoint wrappers
            apply_fsdp_checkpointing(model, layers, fsdp.activation_checkpointing_scope)
        units = layer_units(model, layers)
        mesh = fsdp2_mesh(fsdp.sharding_strategy, dist.get_world_size(), device, fsdp.hybrid_shard_group_size)
        options = {
            "mesh": mesh,
            "reshard_after_forward": RESHARD_AFTER_FORWARD[fsdp.sharding_strategy],
            "mp_policy": precision.fsdp2_policy,
        }
        if fsdp.fsdp_cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy()
        for unit in [*units, model]:
            fully_shard(unit, **options)
        # BACKWARD_PRE is FSDP2's default; NONE empties every unit's backward list. Forward prefetch makes each
        # block's forward all-gather the next block too (FSDP2's default is none).
        if fsdp.backward_prefetch is None:
            for unit in [*units, model]:
                unit.set_modules_to_backward_prefetch([])
        if fsdp.forward_prefetch:
            for unit, following in zip(units, units[1:], strict=False):
                unit.set_modules_to_forward_prefetch([following])
        # generate() calls the encoder directly: registered, it gathers the root's parameters like forward does.
        register_fsdp_forward_method(model, "generate")
        if rank0_state is not None:
            broadcast_rank0_weights(model, rank0_state, device)
        elif restores:
            # Each rank's shards, uninitialised: the checkpoint fills them. With CPU offload they live in host
            # memory (FSDP2 copies each unit to the GPU as it runs), as torchtitan places them.
            to_empty(model, torch.device("cpu") if fsdp.fsdp_cpu_offload else device)
        return model

    @contextlib.contextmanager
    def _reduction_skipped(self, model: nn.Module):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def kept_gathered(self, model: nn.Module):
        return fsdp2_units_kept_unsharded(self.units(model))

    def units(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, FSDPModule)]


class Unwrapped(Parallelism):
    """One rank, --single_rank_fsdp false: the model itself on the device, its stack layers checkpointed as
    FSDP's would be. Its forward and generate run under autocast to the compute dtype (bf16, fp16; nothing in
    fp32); the weights and AdamW's state stay fp32, like FSDP's master copy."""

    def _wrap(self, model, layers, precision, device, weights_source, restores) -> nn.Module:  # noqa: ARG002
        if self.fsdp.fsdp_activation_checkpointing:
            apply_fsdp_checkpointing(model, layers, self.fsdp.activation_checkpointing_scope)
        if restores:
            to_empty(model, device)  # the skeleton on the meta device, allocated for the checkpoint to fill
        else:
            model.to(device)
        dtype = precision.compute_dtype
        if dtype != torch.float32:
            # One autocast object per method: generate calls forward, and an object entered twice loses the state
            # it restores on exit. generate is covered whole: it calls the encoder without forward.
            model.forward = torch.autocast(device.type, dtype=dtype)(model.forward)
            model.generate = torch.autocast(device.type, dtype=dtype)(model.generate)
        return model

    def describe(self, model: nn.Module, precision: Precision) -> None:  # noqa: ARG002 - FSDP's reads it
        name = precision.unwrapped_name
        how = "in fp32" if name == "fp32" else f"mixed precision {name} (fp32 weights and optimizer)"
        tf32 = ", fp32 matmuls in TF32 (--tf32)" if precision.tf32 else ""
        get_logger().info("no FSDP: one rank trains the model itself (--single_rank_fsdp false), %s%s", how, tf32)


def parallelism_for(fsdp: FSDPConfig, world_size: int) -> Parallelism:
    """The run's parallelism: FSDP1 or FSDP2 (--fsdp_version), or the model unwrapped on one rank."""
    if not wraps_in_fsdp(fsdp, world_size):
        return Unwrapped(fsdp)
    return FSDP1(fsdp) if fsdp.fsdp_version == 1 else FSDP2(fsdp)


def _fsdp1_compute_dtype(model: FSDP):
    """Autocast to the policy's compute dtype: generate skips the root's forward, which casts, so the fp32 root's
    matmuls would meet bf16/fp16 units (docs/pitfalls.md #43). Nothing to do in fp32."""
    dtype = model.mixed_precision.param_dtype
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=model.compute_device.type, dtype=dtype)
