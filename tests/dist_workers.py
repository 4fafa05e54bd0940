"""Functions run on each rank of a spawned gloo group by tests/dist_harness.run_ranks.

Models are the embedded tiny T5's architecture with dropout off, so that sharded and unsharded runs see the
same computation and any difference comes from FSDP itself.
"""

import contextlib
import copy
import dataclasses
import datetime
import errno
import functools
import gc
import math
import os
import time
import traceback
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset
from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer
from transformers.models.t5.modeling_t5 import T5Attention, T5Block

from configs.checkpointing import CheckpointConfig
from configs.errors import ConfigError, TrainingDivergedError
from configs.fsdp import FSDPConfig
from configs.lora import LoraConfig
from configs.paths import EMBEDDED_MODEL_DIR, REPO_ROOT
from policies.mixed_precision import POLICIES, Precision
from policies.private_api import TorchDispatchMode, default_store, fsdp1_unsharded_flat_parameter
from summarization_dataset import FORMAT, pad_collate
from utils.base import layout
from utils.base.log import ProgressLines
from utils.checkpoint import background as background_writing
from utils.checkpoint import integrity
from utils.checkpoint import manager as checkpoint_manager
from utils.checkpoint.hf_export import lora_exports, write_adapter_folder, write_model_folder
from utils.checkpoint.manager import CheckpointManager
from utils.checkpoint.progress import TrainProgress
from utils.checkpoint.run_lock import check_writable, claimed_output_dir
from utils.checkpoint.start import resolve_start
from utils.checkpoint.state_dicts import save_full_model, sharded_model_state
from utils.data.loaders import IGNORED, build_loader, move_batch
from utils.data.samplers import PaddedEvalSampler
from utils.distributed.process_group import DistInfo, StopAgreed, StopCheck
from utils.distributed.progress_bounded import PeerFailed, PeerStalled, progress_bounded
from utils.fsdp.parallelism import Parallelism, parallelism_for
from utils.model import t5_attention
from utils.model.loading import load_full_model_state, load_model, load_tokenizer
from utils.model.lora import apply_lora, transposed_layers
from utils.model.rank0_loading import UnitMaterializer
from utils.observe.flops import Seq2SeqFlops
from utils.observe.memory import optim_state_numel_local
from utils.spec import CAUSAL, SEQ2SEQ, ModelSpec, spec_for
from utils.train import step as step_module
from utils.train.step import StepSettings, train_step, validate
from utils.train.step_log import StepLog

CPU = torch.device("cpu")
VOCAB = 1100
LR = 1e-3
FP32 = Precision("fp32_policy")
EXPORT_FILE_BYTES = 100_000  # the tiny model's 1.2 MB over several files, as --export_max_file_gb splits


def tiny_t5(seed: int = 0, on_meta: bool = False, attn_implementation: str = "sdpa") -> T5ForConditionalGeneration:
    config = T5Config.from_pretrained(EMBEDDED_MODEL_DIR, dropout_rate=0.0, use_cache=False)
    config._attn_implementation = attn_implementation
    if on_meta:
        with torch.device("meta"):
            model = T5ForConditionalGeneration(config)
    else:
        torch.manual_seed(seed)
        model = T5ForConditionalGeneration(config)
    if attn_implementation == t5_attention.NAME:
        t5_attention.fuse_norms(model)  # as loading does (utils/model/loading.py: load_model_for_run)
    return model


def make_batch(seed: int, rows: int = 3, src_len: int = 12, tgt_len: int = 7, vocab: int = VOCAB) -> dict:
    """Random token ids with random right padding: ranks get different numbers of target tokens."""
    gen = torch.Generator().manual_seed(seed)
    source = torch.randint(2, vocab, (rows, src_len), generator=gen)
    target = torch.randint(2, vocab, (rows, tgt_len), generator=gen)
    source_mask = (torch.arange(src_len) < torch.randint(3, src_len + 1, (rows, 1), generator=gen)).long()
    target_mask = (torch.arange(tgt_len) < torch.randint(2, tgt_len + 1, (rows, 1), generator=gen)).long()
    return {
        "source_ids": source.masked_fill(source_mask == 0, 0),
        "source_mask": source_mask,
        "target_ids": target.masked_fill(target_mask == 0, 0),
        "target_mask": target_mask,
    }


def causal_batch(seed: int, rows: int = 3, length: int = 14, vocab: int = VOCAB) -> dict:
    """A decoder-only model's batch (causal_lm_dataset.py's keys): random ids, right padding of random length,
    and no loss on a prompt of 1-3 tokens or on the padding, so that ranks train on different token counts."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=gen)
    positions = torch.arange(length)
    mask = (positions < torch.randint(4, length + 1, (rows, 1), generator=gen)).long()
    prompt = positions < torch.randint(1, 4, (rows, 1), generator=gen)
    return {
        "input_ids": ids.masked_fill(mask == 0, 0),
        "attention_mask": mask,
        "labels": ids.masked_fill(prompt | (mask == 0), IGNORED),
    }


def packed_causal_batch(seed: int, rows: int = 3, length: int = 14, vocab: int = VOCAB) -> dict:
    """causal_batch packed as --packing documents makes blocks: each row two documents (position ids restarting
    at the second, whose first token is no target), then padding."""
    batch = causal_batch(seed, rows, length, vocab)
    gen = torch.Generator().manual_seed(seed + 1)
    positions = torch.arange(length).expand(rows, length).clone()
    mask = batch.pop("attention_mask")
    real = mask.sum(dim=1)
    for row in range(rows):
        second = int(torch.randint(2, max(3, int(real[row]) - 1), (1,), generator=gen))
        positions[row, second:] -= second
        positions[row, int(real[row]) :] = 0
        batch["labels"][row, second] = IGNORED
    return {**batch, "position_ids": positions, "attention_mask": mask}


BATCHES = {SEQ2SEQ: make_batch, CAUSAL: causal_batch}  # a model spec's random batches


def batch_seed(step: int, rank: int) -> int:
    return 1000 * step + rank


def global_batch(
    step: int, world_size: int, vocab: int = VOCAB, spec: ModelSpec = SEQ2SEQ, packed: bool = False
) -> dict:
    """What all ranks see at `step`, as one batch (the unsharded reference's input)."""
    batches = packed_causal_batch if packed else BATCHES[spec]
    parts = [batches(batch_seed(step, rank), vocab=vocab) for rank in range(world_size)]
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def reference_run(
    steps: int, world_size: int, model: nn.Module | None = None, vocab: int = VOCAB, spec: ModelSpec = SEQ2SEQ,
    packed: bool = False,
) -> tuple[list[float], dict]:  # fmt: skip
    """Unsharded model (tiny_t5 unless given), no process group: token-mean loss over the global batch,
    AdamW over the parameters that train (all of them, or a PEFT model's adapters)."""
    model = tiny_t5() if model is None else model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(steps):
        token_losses, labels = spec.token_losses(model, global_batch(step, world_size, vocab, spec, packed))
        loss = token_losses.sum() / (labels != -100).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def fsdp_run(
    config: FSDPConfig,
    rank: int,
    world_size: int,
    steps: int,
    precision: Precision = FP32,
    weights_file: str = "",
    export_folder: str = "",
):
    """Per-step reported losses of train_step under FSDP, and the final full state dict (rank 0). With
    `export_folder`, the trained model is first exported there from the shards (EXPORT_FILE_BYTES files).

    With rank-0-only loading the ranks start from a meta-device skeleton: FSDP2's ranks but 0 (rank 0's
    weights are broadcast), FSDP1's every rank (rank 0 reads `weights_file`, a .pt of tiny_t5()'s weights).
    """
    efficient = config.cpu_ram_efficient_loading
    skeleton = efficient and (config.fsdp_version == 1 or rank != 0)
    model, parallelism = sharded(tiny_t5(on_meta=skeleton), config, precision, weights_source=weights_file)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = train_wrapped(model, parallelism, optimizer, rank, world_size, steps)
    if export_folder:
        tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
        model_config = tiny_t5(on_meta=True).config
        state = sharded_model_state(model)
        write_model_folder(state, model_config, SEQ2SEQ, tokenizer, export_folder, EXPORT_FILE_BYTES, rank == 0)
    return losses, parallelism.full_state_dict(model, CPU)


def train_wrapped(
    model: nn.Module, parallelism: Parallelism, optimizer, rank: int, world_size: int, steps: int,
    vocab: int = VOCAB, first: int = 0,
    spec: ModelSpec = SEQ2SEQ, packed: bool = False,
) -> list[float]:  # fmt: skip
    """Steps `first` to `steps` - 1 of train_step on this rank's batches (`packed`: a decoder-only model's
    packed blocks); the reported (global token-mean) loss of each."""
    records: list[dict] = []
    step_log = StepLog(every=steps, on_flush=records.extend)
    settings = step_module.StepSettings(parallelism, spec=spec)
    batches = packed_causal_batch if packed else BATCHES[spec]
    for step in range(first, steps):
        batch = batches(batch_seed(step, rank), vocab=vocab)
        stats = train_step(model, batch, optimizer, None, world_size, settings)
        step_log.add(step + 1, LR, stats)
    step_log.flush()
    return [r["loss"] for r in records]


PARITY_VARIANTS = {
    "FULL_SHARD": {},
    "SHARD_GRAD_OP": {"sharding_strategy": "SHARD_GRAD_OP"},
    "NO_SHARD": {"sharding_strategy": "NO_SHARD"},
    "FULL_SHARD+checkpointing": {"fsdp_activation_checkpointing": True},
    "SHARD_GRAD_OP+checkpointing": {
        "sharding_strategy": "SHARD_GRAD_OP",
        "fsdp_activation_checkpointing": True,
    },
    "BACKWARD_POST": {"backward_prefetch": "BACKWARD_POST"},
    "no prefetch, no all-gather limit": {"backward_prefetch": None, "limit_all_gathers": False},
    "size_based wrap": {"wrap_policy": "size_based", "min_num_params": 20_000},
    "HYBRID_SHARD (1x2 mesh)": {"sharding_strategy": "HYBRID_SHARD"},
    "_HYBRID_SHARD_ZERO2 (1x2 mesh)": {"sharding_strategy": "_HYBRID_SHARD_ZERO2"},
    "forward_prefetch": {"forward_prefetch": True},
    "use_orig_params": {"use_orig_params": True},
    "rank-0-only loading": {"cpu_ram_efficient_loading": True},
}


FSDP2_VARIANTS = {
    f"FSDP2 {name}": {**overrides, "fsdp_version": 2}
    for name, overrides in {
        "FULL_SHARD": {},
        "SHARD_GRAD_OP": {"sharding_strategy": "SHARD_GRAD_OP"},
        "NO_SHARD": {"sharding_strategy": "NO_SHARD"},
        "HYBRID_SHARD": {"sharding_strategy": "HYBRID_SHARD"},
        "_HYBRID_SHARD_ZERO2": {"sharding_strategy": "_HYBRID_SHARD_ZERO2"},
        "FULL_SHARD+checkpointing": {"fsdp_activation_checkpointing": True},
        "SHARD_GRAD_OP+checkpointing": {
            "sharding_strategy": "SHARD_GRAD_OP",
            "fsdp_activation_checkpointing": True,
        },
        "no backward prefetch": {"backward_prefetch": None},
        "forward_prefetch": {"forward_prefetch": True},
        "rank-0-only loading": {"cpu_ram_efficient_loading": True},
    }.items()
}
FOUR_RANK_HYBRID_VARIANTS = {
    "FSDP1 HYBRID_SHARD 2x2": {"sharding_strategy": "HYBRID_SHARD", "hybrid_shard_group_size": 2},
    "FSDP2 HYBRID_SHARD 2x2": {
        "sharding_strategy": "HYBRID_SHARD",
        "hybrid_shard_group_size": 2,
        "fsdp_version": 2,
    },
    "FSDP2 _HYBRID_SHARD_ZERO2 2x2": {
        "sharding_strategy": "_HYBRID_SHARD_ZERO2",
        "hybrid_shard_group_size": 2,
        "fsdp_version": 2,
    },
    "FSDP2 HYBRID_SHARD 4x1": {
        "sharding_strategy": "HYBRID_SHARD",
        "hybrid_shard_group_size": 1,
        "fsdp_version": 2,
    },
}
VARIANT_SETS = {"fsdp1": PARITY_VARIANTS, "fsdp2": FSDP2_VARIANTS, "hybrid4": FOUR_RANK_HYBRID_VARIANTS}


def _fsdp_config(overrides: dict) -> FSDPConfig:
    base = FSDPConfig(mixed_precision=False, fsdp_activation_checkpointing=False)
    return dataclasses.replace(base, **overrides)


def sharded(model: nn.Module, fsdp: FSDPConfig, precision: Precision, **options) -> tuple[nn.Module, Parallelism]:
    """`model` spread over the CPU group as a run with `fsdp` spreads it, and that parallelism."""
    parallelism = parallelism_for(fsdp, dist.get_world_size())
    return parallelism.wrap(model, precision=precision, device=CPU, **options), parallelism


def parity_worker(
    rank: int,
    world_size: int,
    steps: int,
    variant_set: str = "fsdp1",
    weights_file: str = "",
    export_dir: str = "",
) -> dict:
    """Losses and final weights of every variant; the unsharded reference on rank 0. With `export_dir`, each
    variant's model is exported from the shards to export_dir/<variant>, and rank 0 returns its full state."""
    out = {"losses": {}, "max_param_diff": {}, "states": {}}
    reference_losses, reference_state = reference_run(steps, world_size) if rank == 0 else (None, None)
    for name, overrides in VARIANT_SETS[variant_set].items():
        export_folder = f"{export_dir}/{name}" if export_dir else ""
        losses, state = fsdp_run(
            _fsdp_config(overrides),
            rank,
            world_size,
            steps,
            weights_file=weights_file,
            export_folder=export_folder,
        )
        out["losses"][name] = losses
        if rank == 0:
            out["max_param_diff"][name] = max(
                (state[key] - reference_state[key]).abs().max().item() for key in reference_state
            )
            if export_dir:
                out["states"][name] = state
    out["reference_losses"] = reference_losses
    return out


def t5_flex_worker(rank: int, world_size: int, steps: int) -> dict:
    """Per-step losses and final full weights (rank 0) of transformers' sdpa and of t5_flex, under FSDP1 and
    FSDP2 with activation checkpointing (the mask object passes through the checkpointed blocks)."""
    t5_attention.register()
    out = {}
    for version in (1, 2):
        for kernel in ("sdpa", t5_attention.NAME):
            config = _fsdp_config({"fsdp_version": version, "fsdp_activation_checkpointing": True})
            model, parallelism = sharded(tiny_t5(attn_implementation=kernel), config, FP32)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            losses = train_wrapped(model, parallelism, optimizer, rank, world_size, steps)
            out[(version, kernel)] = (losses, parallelism.full_state_dict(model, CPU))
    return out


def structure_worker(rank: int, world_size: int) -> dict:
    """Which modules are FSDP units, and which parameters each unit's flat parameter holds."""
    out = {}
    for checkpointing in (False, True):
        config = dataclasses.replace(_fsdp_config({}), fsdp_activation_checkpointing=checkpointing)
        plain = tiny_t5()
        n_blocks = sum(isinstance(m, T5Block) for m in plain.modules())
        model, parallelism = sharded(plain, config, FP32)
        units = FSDP.fsdp_modules(model)
        out[checkpointing] = {
            "n_blocks": n_blocks,
            "root_is_model": units[0] is model and isinstance(model.module, T5ForConditionalGeneration),
            "unit_module_types": [type(unit.module).__name__ for unit in units[1:]],
            # FQNs of the original parameters inside each unit's flat parameter (private FSDP1 attribute:
            # the only record of which unit owns a parameter when use_orig_params=False).
            "root_fqns": list(units[0]._handle.flat_param._fqns),
            "block_fqns": [list(unit._handle.flat_param._fqns) for unit in units[1:]],
        }
    return out


def precision_worker(rank: int, world_size: int) -> dict:
    """The dtype that T5's attention projections compute in under each policy, and the master dtype."""
    out = {}
    for name in POLICIES:
        model, parallelism = sharded(tiny_t5(), _fsdp_config({}), Precision(name))
        attention = next(m for m in model.modules() if isinstance(m, T5Attention))
        seen = {}

        def hook(module, inputs, output, seen=seen):
            seen["weight"] = module.weight.dtype
            seen["output"] = output.dtype

        handle = attention.q.register_forward_hook(hook)
        batch = make_batch(rank)
        with torch.no_grad():
            model(
                input_ids=batch["source_ids"],
                attention_mask=batch["source_mask"],
                labels=batch["target_ids"].masked_fill(batch["target_mask"] == 0, -100),
            )
        handle.remove()
        out[name] = {
            "compute_weight": str(seen["weight"]),
            "compute_output": str(seen["output"]),
            "sharded_master": str(next(model.parameters()).dtype),
            "reduce": str(POLICIES[name].reduce_dtype),
        }
    return out


def checkpoint_worker(rank: int, world_size: int, path: str, fsdp_version: int = 1) -> dict:
    """Train 2 steps, save the rank-0 full state dict, reload it into a plain model, compare logits. Then
    export the model from the shards to `path`.hf in files of at most EXPORT_FILE_BYTES; rank 0 returns the
    gathered state dict to compare it with."""
    config = _fsdp_config({"fsdp_activation_checkpointing": True, "fsdp_version": fsdp_version})
    model, parallelism = sharded(tiny_t5(), config, FP32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    settings = StepSettings(parallelism, spec=SEQ2SEQ)
    for step in range(2):
        train_step(model, make_batch(batch_seed(step, rank)), optimizer, None, world_size, settings)
    saved = save_full_model(model, parallelism, CPU, rank == 0, path)
    tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    model_config = tiny_t5(on_meta=True).config
    files = write_model_folder(
        sharded_model_state(model), model_config, SEQ2SEQ, tokenizer, f"{path}.hf", EXPORT_FILE_BYTES, rank == 0
    )
    gathered = parallelism.full_state_dict(model, CPU)
    probe = make_batch(seed=777)
    model.eval()
    with torch.no_grad():
        fsdp_logits = forward_logits(model, probe)
    out = {"saved": saved, "export_files": files, "gathered": gathered}
    if rank == 0:
        plain = T5ForConditionalGeneration(T5Config.from_pretrained(EMBEDDED_MODEL_DIR, dropout_rate=0.0))
        result = plain.load_state_dict(load_full_model_state(path), strict=True)
        plain.eval()
        with torch.no_grad():
            plain_logits = forward_logits(plain, probe)
        out.update(
            missing=list(result.missing_keys),
            unexpected=list(result.unexpected_keys),
            max_logit_diff=(plain_logits - fsdp_logits).abs().max().item(),
            logit_scale=fsdp_logits.abs().max().item(),
            tied=plain.lm_head.weight.data_ptr() == plain.shared.weight.data_ptr(),
        )
    return out


def self_closing_stager_worker(rank: int, world_size: int, output_root: str) -> dict:
    """FSDP2 background saves (--async_checkpoint) under the DefaultStager of torch 2.11 and 2.12, which closes
    itself at the end of every stage: emulated here by its public `close` after each `stage`. Three saves
    through the checkpoint manager, with a stager per save (what the manager does before torch 2.13) and with
    one stager for the run (the control, which those versions break). The checkpoints completed, or the error."""
    original_stage = DefaultStager.stage

    def stage_then_close(stager, state_dict, **kwargs):
        staged = original_stage(stager, state_dict, **kwargs)
        stager.close()
        return staged

    info = DistInfo(rank, rank, world_size, CPU, "gloo")
    tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    fsdp = _fsdp_config({"fsdp_version": 2, "checkpoint_type": layout.SHARDED})
    checkpointing = CheckpointConfig(save_every_n_steps=0, keep_last_n=3, async_checkpoint=True)
    out = {}
    for stager_per_save in (True, False):
        output_dir = os.path.join(output_root, f"per_save_{stager_per_save}")
        model, parallelism = sharded(tiny_t5(), fsdp, FP32)
        manager = plain_manager(model, parallelism, fsdp, checkpointing, output_dir, info, tokenizer)
        optimizer, settings = manager.optimizer, StepSettings(parallelism, spec=SEQ2SEQ)
        with (
            mock.patch.object(DefaultStager, "stage", stage_then_close),
            mock.patch.object(background_writing, "STAGER_SERVES_ONE_SAVE", stager_per_save),
            manager as checkpoints,
        ):
            try:
                for step in (1, 2, 3):
                    train_step(model, make_batch(batch_seed(step, rank)), optimizer, None, world_size, settings)
                    checkpoints.save(TrainProgress(epoch=1, samples_consumed=step, global_step=step))
                checkpoints.finish_pending()
                dist.barrier()  # rank 0 completes (renames) the last one
                out[stager_per_save] = sorted(os.listdir(layout.checkpoint_root(output_dir)))
            except Exception as err:  # the control's failure, returned to be asserted
                out[stager_per_save] = f"{type(err).__name__}: {err}"
    return out


def plain_manager(
    model: nn.Module, parallelism: Parallelism, fsdp, checkpointing, output_dir: str, info, tokenizer
) -> CheckpointManager:
    """The checkpoint manager of a sharded tiny model without LoRA, with AdamW at LR and a constant schedule
    (`manager.optimizer`)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return CheckpointManager(
        checkpointing=checkpointing,
        fsdp=fsdp,
        output_dir=output_dir,
        model=model,
        parallelism=parallelism,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        scaler=None,
        model_config=model.config,
        spec=SEQ2SEQ,
        tokenizer=tokenizer,
        info=info,
        lora=LoraConfig(),
        base_model=EMBEDDED_MODEL_DIR,
    )


def forward_logits(model, batch: dict) -> torch.Tensor:
    labels = batch["target_ids"].masked_fill(batch["target_mask"] == 0, -100)
    return model(input_ids=batch["source_ids"], attention_mask=batch["source_mask"], labels=labels).logits


class ItemsDataset(Dataset):
    """Unpadded items of different lengths, as SummarizationDataset returns them with dynamic padding."""

    def __init__(self, n: int):
        self.items = []
        for i in range(n):
            batch = make_batch(seed=500 + i, rows=1)
            src_len, tgt_len = int(batch["source_mask"].sum()), int(batch["target_mask"].sum())
            self.items.append(
                {
                    "source_ids": batch["source_ids"][0, :src_len],
                    "source_mask": batch["source_mask"][0, :src_len],
                    "target_ids": batch["target_ids"][0, :tgt_len],
                    "target_mask": batch["target_mask"][0, :tgt_len],
                }
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def validation_worker(rank: int, world_size: int, n_samples: int, batch_size: int) -> dict:
    """validate() over an uneven split vs a hand-computed token mean over the unique samples."""
    plain = tiny_t5()
    reference_model = copy.deepcopy(plain).eval()
    model, parallelism = sharded(plain, _fsdp_config({}), FP32)
    dataset = ItemsDataset(n_samples)
    sampler = PaddedEvalSampler(len(dataset), rank, world_size)
    collate = functools.partial(pad_collate, pad_token_id=0)
    loader = build_loader(dataset, sampler, batch_size, collate_fn=collate, num_workers=0, device=CPU)

    class NoBar:
        def update(self, n):
            pass

    loss = validate(
        model, loader, device=CPU, num_real_samples=sampler.num_real_samples, progress=NoBar(), spec=SEQ2SEQ
    )
    out = {"reported": loss, "indices": sampler.indices, "num_real": sampler.num_real_samples}
    if rank == 0:
        sums, counts = [], []
        with torch.no_grad():
            for item in dataset.items:
                batch = {key: value.unsqueeze(0) for key, value in item.items()}
                token_losses, labels = SEQ2SEQ.token_losses(reference_model, batch)
                sums.append(token_losses.sum().item())
                counts.append((labels != -100).sum().item())
        out["hand_token_mean"] = sum(sums) / sum(counts)
        out["mean_of_sample_means"] = sum(s / c for s, c in zip(sums, counts, strict=True)) / len(sums)
        # What a padded DistributedSampler would report: the repeated samples counted again.
        repeated = [i for r in range(world_size) for i in PaddedEvalSampler(n_samples, r, world_size).indices]
        out["with_duplicates"] = sum(sums[i] for i in repeated) / sum(counts[i] for i in repeated)
    dist.barrier()
    return out


def bf16_worker(rank: int, world_size: int, steps: int) -> dict:
    """bf16 (bfSixteen) per-step losses of both backends."""
    return {
        version: fsdp_run(
            _fsdp_config({"fsdp_version": version}), rank, world_size, steps, Precision("bfSixteen")
        )[0]
        for version in (1, 2)
    }


def rank0_loading_worker(rank: int, world_size: int, fsdp_version: int = 2) -> dict:
    """Only rank 0 has the weights (FSDP2: in its model; FSDP1: in the embedded model's safetensors file,
    every rank on meta); after wrapping, every rank's full state dict must equal them."""
    config = _fsdp_config({"fsdp_version": fsdp_version, "cpu_ram_efficient_loading": True})
    if fsdp_version == 2:
        reference = tiny_t5(seed=123)  # what rank 0 "loaded"
        model, parallelism = sharded(tiny_t5(seed=123) if rank == 0 else tiny_t5(on_meta=True), config, FP32)
        held = None
    else:
        # Live host tensor bytes each time FSDP1 materialises a module, before the reference exists, over those
        # live before loading (a process that ran other work may hold some: only what loading holds counts).
        before = _live_host_tensor_bytes()
        held = []
        original = UnitMaterializer.__call__

        calls = []

        def measured(materializer, module):
            calls.append(module)
            if len(calls) % 8 == 0:  # every 8th module (a gc walk each): the growth a leak makes shows
                held.append(_live_host_tensor_bytes())
            original(materializer, module)

        UnitMaterializer.__call__ = measured
        try:
            model, parallelism = sharded(
                tiny_t5(on_meta=True), config, FP32, weights_source=str(EMBEDDED_MODEL_DIR)
            )
        finally:
            UnitMaterializer.__call__ = original
        held = max(held) - before
        reference = T5ForConditionalGeneration.from_pretrained(EMBEDDED_MODEL_DIR)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        "max_diff": max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items()),
        "keys_equal": sorted(full) == sorted(reference.state_dict()),
        "tied": _lm_head_is_shared(model),
        "any_meta": any(p.is_meta for p in model.parameters()),
        "held_bytes": held,
        "model_bytes": 4 * sum(p.numel() for p in reference.parameters()),
    }


def _live_host_tensor_bytes() -> int:
    """Bytes of every live CPU tensor's storage in this process that a collection sees (those frozen with the
    imports aside: T5_training.kept_for_the_whole_process), each storage once."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            try:
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a fake tensor that an earlier scenario's torch.compile keeps: no memory
                continue
    return sum(storages.values())


def _lm_head_is_shared(model) -> bool:
    """One parameter behind lm_head and shared: FSDP2 keeps the modules, FSDP1 flattens them (one view
    each, of the same flat-parameter slice when the tie survived)."""
    inner = getattr(model, "module", model)
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            return inner.lm_head.weight.data_ptr() == inner.shared.weight.data_ptr()
    return inner.lm_head.weight is inner.shared.weight


def generation_worker(rank: int, world_size: int, output_dir: str, n_samples: int, batch_size: int) -> dict:
    """ROUGE evaluation of one fp32 model under FSDP1 and FSDP2 (greedy and 2 beams), plus direct generate
    calls whose lengths differ by rank. Rank 0 also returns plain single-process generate on the same model."""
    from transformers import T5Tokenizer

    from configs.data import DataConfig
    from configs.evaluation import EvalConfig
    from configs.training import TrainConfig
    from utils.data.loaders import build_eval_set
    from utils.distributed.process_group import DistInfo
    from utils.eval.evaluator import Evaluator
    from utils.eval.generation import generate

    info = DistInfo(rank, rank, world_size, CPU, "gloo")
    tokenizer = T5Tokenizer.from_pretrained(str(EMBEDDED_MODEL_DIR))
    data, train = DataConfig(), TrainConfig(val_batch_size=batch_size)
    evaluation = EvalConfig(eval_num_samples=n_samples, max_new_tokens=12)
    eval_set = build_eval_set(tokenizer, FORMAT, data, train, evaluation, info, "validation")

    def settings_with(beams: int) -> dict:
        return SEQ2SEQ.generation_kwargs(dataclasses.replace(evaluation, num_beams=beams), data.max_target_length)

    out = {"records": {}, "uneven": {}}
    for beams in (1, 2):
        settings = settings_with(beams)
        assert settings["num_beams"] == beams and settings["max_new_tokens"] == 12
        for version in (1, 2):
            model, parallelism = sharded(tiny_t5(seed=7), _fsdp_config({"fsdp_version": version}), FP32)
            folder = f"{output_dir}/fsdp{version}-beams{beams}"
            where = functools.partial(layout.predictions_file, folder)
            evaluator = Evaluator(eval_set=eval_set, parallelism=parallelism, spec=SEQ2SEQ, generation=settings,
                                  metric="rouge", predictions_file=where, info=info)  # fmt: skip
            out["records"][(version, beams)] = evaluator.evaluate(model, 1, 5)
            # Lengths that differ by rank: rank r stops after 3 + 6 r new tokens, the others keep stepping.
            uneven = {**settings, "max_new_tokens": 3 + 6 * rank}
            ids = generate(model, parallelism, SEQ2SEQ.prompts(make_batch(rank, rows=2)), uneven)
            out["uneven"][(version, beams)] = ids.shape[1]
    if rank == 0:
        plain = tiny_t5(seed=7).eval()
        dataset = eval_set.dataset
        out["plain"] = {}
        for beams in (1, 2):
            settings = settings_with(beams)
            texts = []
            for index in range(len(dataset)):
                item = dataset[index]
                source, mask = item["source_ids"][None], item["source_mask"][None]
                with torch.no_grad():
                    ids = plain.generate(input_ids=source, attention_mask=mask, use_cache=True,
                                         **settings)  # fmt: skip
                texts.append(tokenizer.decode(ids[0], skip_special_tokens=True).strip())
            out["plain"][beams] = texts
        out["references"] = [dataset.reference(i) for i in range(len(dataset))]
    return out


def _split_rows(batch: dict, parts: int) -> list[dict]:
    rows = next(iter(batch.values())).shape[0] // parts
    return [{key: value[i * rows : (i + 1) * rows] for key, value in batch.items()} for i in range(parts)]


def accumulation_reference(steps: int, world_size: int, max_norm: float) -> tuple[list, list, dict]:
    """Unsharded: token-mean loss over every rank's 4 rows, plain clip_grad_norm_, AdamW."""
    model = tiny_t5()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(steps):
        parts = [make_batch(batch_seed(step, rank), rows=4) for rank in range(world_size)]
        batch = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
        token_losses, labels = SEQ2SEQ.token_losses(model, batch)
        loss = token_losses.sum() / (labels != -100).sum()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf")).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.clone() for k, v in model.state_dict().items()}


def accumulation_worker(rank: int, world_size: int, steps: int) -> dict:
    """Per-step losses, gradient norms and final weights of 2 micro-batches of 2 rows accumulated, for each
    backend, gradient-sync mode and clipping setting; the unsharded references on rank 0."""
    from utils.train.step import GRAD_NORM

    out = {"runs": {}, "references": {}}
    for max_norm in (0.0, 0.05):
        if rank == 0:
            out["references"][max_norm] = accumulation_reference(steps, world_size, max_norm)
        for version in (1, 2):
            for sync in (True, False):
                model, parallelism = sharded(tiny_t5(), _fsdp_config({"fsdp_version": version}), FP32)
                optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
                settings = StepSettings(
                    parallelism, max_grad_norm=max_norm, sync_each_micro_batch=sync, spec=SEQ2SEQ
                )
                records: list[dict] = []
                step_log = StepLog(every=steps, on_flush=records.extend)
                for step in range(steps):
                    micro = _split_rows(make_batch(batch_seed(step, rank), rows=4), 2)
                    step_log.add(step + 1, LR, train_step(model, micro, optimizer, None, world_size, settings))
                step_log.flush()
                state = parallelism.full_state_dict(model, CPU)
                out["runs"][(max_norm, version, sync)] = {
                    "losses": [r["loss"] for r in records],
                    "norms": [r["grad_norm"] for r in records],
                    "state": state if rank == 0 else None,
                }
                assert GRAD_NORM == 4
    return out


def decay_groups_worker(rank: int, world_size: int) -> dict:
    """Names of the parameters in each AdamW group, with weight decay, for FSDP2 and FSDP1 (orig params)."""
    from configs.training import TrainConfig
    from utils.train import optim

    out = {}
    train = TrainConfig(weight_decay=0.1)
    for version, overrides in ((1, {"use_orig_params": True}), (2, {"fsdp_version": 2})):
        model, parallelism = sharded(tiny_t5(), _fsdp_config(overrides), FP32)
        names = {id(p): n for n, p in model.named_parameters()}
        # As T5_training.fsdp_main builds it.
        optimizer = torch.optim.AdamW(optim.parameter_groups(model, train.weight_decay), lr=train.lr)
        out[version] = [(group["weight_decay"], sorted(names[id(p)] for p in group["params"]))
                        for group in optimizer.param_groups]  # fmt: skip
    return out


def _reduced_gradients(version: int, policy: str, batch: dict, all_tokens: torch.Tensor, world_size: int) -> dict:
    """name -> full fp64 gradient after one backward of train_step's per-rank loss (the token sum over the
    all-ranks token count, x world size) and FSDP's gradient reduction. Collective."""
    config = _fsdp_config({"fsdp_version": version, "use_orig_params": version == 1})
    model, parallelism = sharded(tiny_t5(), config, Precision(policy))
    token_losses, _ = SEQ2SEQ.token_losses(model, batch)
    (token_losses.sum() * world_size / all_tokens).backward()
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model, with_grads=True):
            named = model.named_parameters()
            return {n.replace("_fsdp_wrapped_module.", ""): p.grad.double().clone() for n, p in named}
    return {name: p.grad.full_tensor().double() for name, p in model.named_parameters()}


def reduction_worker(rank: int, world_size: int) -> dict:
    """Relative error of FSDP's reduced gradients under bf16 compute, with the reduction in bf16 (bfSixteen)
    and in fp32 (bfSixteen_fp32_reduce), for both backends. The exact value is the fp64 average of each
    rank's own bf16 gradient, each taken from a run where every rank sees the same batch (the average of
    equal values is exact in any dtype), so it is FSDP's own computation with the rounding of the sum only."""
    batches = [make_batch(batch_seed(0, r)) for r in range(world_size)]
    all_tokens = sum(batch["target_mask"].sum() for batch in batches).float()
    out = {}
    for version in (1, 2):
        exact_policy = "bfSixteen_fp32_reduce"
        singles = [_reduced_gradients(version, exact_policy, b, all_tokens, world_size) for b in batches]
        exact = {name: sum(grads[name] for grads in singles) / world_size for name in singles[0]}
        norm = math.sqrt(sum((value**2).sum() for value in exact.values()))
        for policy in ("bfSixteen", "bfSixteen_fp32_reduce"):
            grads = _reduced_gradients(version, policy, batches[rank], all_tokens, world_size)
            error = math.sqrt(sum(((grads[name] - value) ** 2).sum() for name, value in exact.items()))
            out[(version, policy)] = error / norm
    return out


@contextlib.contextmanager
def _nan_loss(enabled: bool):
    """This rank's token losses (and so its gradients) become NaN while the context is open."""
    original = SEQ2SEQ.token_losses

    def poisoned(model, batch):
        token_losses, labels = original(model, batch)
        return token_losses * float("nan"), labels

    with mock.patch.object(SEQ2SEQ, "token_losses", poisoned if enabled else original):
        yield


def _guarded_run(version: int, rank: int, world_size: int, steps: list[int], bad_step: int, stop: bool) -> dict:
    """train_step over `steps` with rank 1's loss NaN at `bad_step`: the step records, the final weights (rank
    0), and the error a stopping step log raised (None if none)."""
    model, parallelism = sharded(tiny_t5(), _fsdp_config({"fsdp_version": version}), FP32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    settings = step_module.StepSettings(parallelism, skip_nonfinite=not stop, spec=SEQ2SEQ)
    records: list[dict] = []
    step_log = StepLog(every=len(steps), on_flush=records.extend, stop_on_nonfinite=stop)
    error = None
    try:
        for step in steps:
            with _nan_loss(step == bad_step and rank == 1):
                stats = train_step(
                    model, make_batch(batch_seed(step, rank)), optimizer, None, world_size, settings
                )
            step_log.add(step + 1, LR, stats)
        step_log.flush()
    except TrainingDivergedError as err:
        error = str(err)
    return {"records": records, "state": parallelism.full_state_dict(model, CPU), "error": error}


def nonfinite_worker(rank: int, world_size: int, steps: int = 4, bad_step: int = 1) -> dict:
    """For each backend: a run whose step `bad_step` is NaN on rank 1 only, skipped; the same run without
    that step at all; the same run with a step log that stops."""
    out = {}
    for version in (1, 2):
        every = list(range(steps))
        out[version] = {
            "skipped": _guarded_run(version, rank, world_size, every, bad_step, stop=False),
            "left_out": _guarded_run(version, rank, world_size, [s for s in every if s != bad_step], -1, False),
            "stopped": _guarded_run(version, rank, world_size, every, bad_step, stop=True),
        }
    return out


@contextlib.contextmanager
def layers_compiled_by(backend: str, on_graph):
    """The parallelism's compile_layers (utils/fsdp/shard.py) compiling with torch.compile `backend`, calling
    `on_graph()` for each graph it compiles (recompiles and graph breaks included)."""
    import torch._dynamo

    from utils.fsdp import parallelism as parallelism_module

    def counting_backend(graph, example_inputs):
        on_graph()
        return torch._dynamo.lookup_backend(backend)(graph, example_inputs)

    original = parallelism_module.compile_layers
    parallelism_module.compile_layers = functools.partial(original, backend=counting_backend)
    try:
        yield
    finally:
        parallelism_module.compile_layers = original


def compile_worker(rank: int, world_size: int, steps: int, backend: str) -> dict:
    """fp32 per-step losses and final weights with every T5Block compiled (torch.compile `backend`, through
    utils/fsdp/shard.py's own compile_layers), for FSDP1 (original parameters) and FSDP2; then, on FSDP2, an
    evaluation: a no-grad forward twice, generation at two lengths. Where each graph was compiled (the step, or the
    evaluation's phase; counted by the backend's calls, recompiles and graph breaks included); the unsharded,
    uncompiled reference on rank 0."""
    import torch._dynamo

    from utils.eval.generation import generate

    phase: list = [0]
    compiled_at: list = []
    out = {"reference": reference_run(steps, world_size) if rank == 0 else None}
    with layers_compiled_by(backend, lambda: compiled_at.append(phase[0])):
        for version, overrides in ((1, {"use_orig_params": True}), (2, {"fsdp_version": 2})):
            torch._dynamo.reset()
            compiled_at.clear()
            model, parallelism = sharded(tiny_t5(), _fsdp_config({**overrides, "compile": True}), FP32)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            losses = []
            for step in range(steps):
                phase[0] = step
                losses += train_wrapped(model, parallelism, optimizer, rank, world_size, step + 1, first=step)
            state = parallelism.full_state_dict(model, CPU)
            if version == 2:  # the evaluation's graphs are the blocks', alike on both backends: counted once
                model.eval()
                for label in ("validation", "validation again"):
                    phase[0] = label
                    with torch.no_grad():
                        SEQ2SEQ.token_losses(model, make_batch(batch_seed(steps, rank)))
                for label, new_tokens in (("generation", 6), ("generation, other lengths", 9)):
                    phase[0] = label
                    prompts = SEQ2SEQ.prompts(make_batch(batch_seed(steps, rank)))
                    generate(model, parallelism, prompts, {"max_new_tokens": new_tokens})
            out[version] = {"losses": losses, "state": state if rank == 0 else None, "compiled_at": compiled_at[:]}
    return out


# r=1: an adapter's A (1 x d_model) has its one row on rank 0 and none on rank 1, the uneven and empty
# shards the export's gather of the adapters must handle.
LORA = LoraConfig(
    peft="lora", lora_r=1, lora_alpha=8, lora_dropout=0.0, lora_target_modules="q,v", merge_lora=False
)
LORA_BASE = str(EMBEDDED_MODEL_DIR)  # what the adapter's config names as its base


def lora_t5() -> nn.Module:
    """tiny_t5 with LoRA on q and v; the adapters' random A drawn from one seed, as every rank does."""
    model = tiny_t5()
    torch.manual_seed(7)
    return apply_lora(model, LORA, LORA_BASE, SEQ2SEQ)


LORA_VARIANTS = {
    "FSDP1": {},
    "FSDP1 + checkpointing": {"fsdp_activation_checkpointing": True},
    "FSDP1 use_orig_params": {"use_orig_params": True},
    "FSDP1 NO_SHARD": {"sharding_strategy": "NO_SHARD"},
    "FSDP2": {"fsdp_version": 2},
    "FSDP2 + checkpointing": {"fsdp_version": 2, "fsdp_activation_checkpointing": True},
}


# The exports lora_worker writes: {variant: merged too}. NO_SHARD's state dict holds plain tensors.
LORA_EXPORTS = {"FSDP1": True, "FSDP2": True, "FSDP1 use_orig_params": False, "FSDP1 NO_SHARD": True}


def lora_worker(rank: int, world_size: int, steps: int, export_dir: str) -> dict:
    """LoRA under each backend: per-step losses, the full state dict (rank 0), and the AdamW state elements
    this rank holds; for LORA_EXPORTS, the adapter (and merged model) exported from the shards to
    export_dir/<variant>/. Rank 0 also returns the unsharded reference and the initial weights."""
    out = {}
    tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    for name, overrides in LORA_VARIANTS.items():
        model, parallelism = sharded(lora_t5(), _fsdp_config(overrides), FP32)
        # As reference_run: AdamW (its default weight decay) over what trains. parameter_groups keeps the
        # same parameters (the torchrun LoRA runs of tests/test_lora.py use it).
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        losses = train_wrapped(model, parallelism, optimizer, rank, world_size, steps)
        state = parallelism.full_state_dict(model, CPU)
        out[name] = {"losses": losses, "state": state, "optim": optim_state_numel_local(optimizer)}
        if name in LORA_EXPORTS:
            settings = dataclasses.replace(LORA, merge_lora=LORA_EXPORTS[name])
            adapters, merged = lora_exports(sharded_model_state(model), settings, CPU)
            if rank == 0:
                model_config = tiny_t5(on_meta=True).config
                folder = f"{export_dir}/{name}/hf_adapter"
                write_adapter_folder(adapters, model_config, SEQ2SEQ, settings, LORA_BASE, tokenizer, folder)
            if merged is not None:
                model_config = tiny_t5(on_meta=True).config
                write_model_folder(
                    merged, model_config, SEQ2SEQ, tokenizer, f"{export_dir}/{name}/hf_model", 10**9, rank == 0
                )
    if rank == 0:
        out["reference"] = reference_run(steps, world_size, lora_t5())
        out["initial"] = {k: v.clone() for k, v in lora_t5().state_dict().items()}
    return out


def source_parity_worker(rank: int, world_size: int, sources: dict, steps: int) -> dict:
    """For FSDP1 and FSDP2: the first `steps` training batches of each source (`name -> DataConfig fields`),
    built by utils/data/loaders.py: build_loaders, and the per-step reported losses of tiny_t5 trained on them.
    Every source builds its caches on this process group (LOCAL_RANK 0 builds, the other rank waits)."""
    from configs.data import DataConfig
    from configs.evaluation import EvalConfig
    from configs.training import TrainConfig
    from utils.data.loaders import build_loaders, move_batch
    from utils.distributed.process_group import DistInfo

    info = DistInfo(rank, rank, world_size, CPU, "gloo")
    tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    train = TrainConfig(batch_size_training=4, run_validation=False)
    out = {"batches": {}, "losses": {}}
    for name, fields in sources.items():
        data = DataConfig(num_train_samples=32, max_source_length=64, max_target_length=16, **fields)
        loaders = build_loaders(
            tokenizer=tokenizer, data_format=FORMAT, data=data, train=train, evaluation=EvalConfig(), info=info
        )
        batches = [batch for _, batch in zip(range(steps), loaders.train, strict=False)]
        out["batches"][name] = batches
        for version in (1, 2):
            model, parallelism = sharded(tiny_t5(seed=3), _fsdp_config({"fsdp_version": version}), FP32)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            records: list[dict] = []
            step_log = StepLog(every=steps, on_flush=records.extend)
            settings = StepSettings(parallelism, spec=SEQ2SEQ)
            for step, batch in enumerate(batches):
                step_log.add(
                    step + 1, LR, train_step(model, move_batch(batch, CPU), optimizer, None, world_size, settings)
                )
            step_log.flush()
            out["losses"][(name, version)] = [record["loss"] for record in records]
    return out


FAMILY_CHECKPOINT_TYPES = {1: layout.FULL, 2: layout.SHARDED}  # a resume through each type, one per backend


def family_worker(rank: int, world_size: int, folder: str, steps: int, output_root: str) -> dict:
    """Another family (a scripts/make_tiny_family.py folder: an encoder-decoder or a decoder-only model), loaded
    as a run loads it, per backend: the losses of `steps` fp32 steps, saved by the checkpoint manager halfway;
    the final full state (rank 0); the model exported from the shards to output_root/fsdp<version>/hf_model;
    the second half again, resumed from the checkpoint into an empty skeleton (load_model(on_meta=True), as a
    resumed run builds it), with its computed buffers (RoPE's inv_freq); and the losses of a run loaded by
    rank 0 alone (--cpu_ram_efficient_loading) with activation checkpointing. The unsharded model's losses and
    state on rank 0."""
    reference = load_model(folder, dropout_rate=0.0)
    vocab = reference.config.vocab_size
    spec = spec_for(reference.config)
    fresh_buffers = {name: buffer.clone() for name, buffer in reference.named_buffers()}
    packed_reference = copy.deepcopy(reference) if spec is CAUSAL else None
    out = {"reference": reference_run(steps, world_size, reference, vocab, spec) if rank == 0 else None}
    if packed_reference is not None and rank == 0:  # packed blocks, documents kept apart by position ids
        out["packed_reference"] = reference_run(steps, world_size, packed_reference, vocab, spec, packed=True)
    tokenizer = load_tokenizer(folder)
    info = DistInfo(rank, rank, world_size, CPU, "gloo")

    def checkpointer(version: int, on_meta: bool) -> CheckpointManager:
        model = load_model(folder, on_meta=on_meta, dropout_rate=0.0)
        fsdp = _fsdp_config({"fsdp_version": version, "checkpoint_type": FAMILY_CHECKPOINT_TYPES[version]})
        model_config = model.config
        model, parallelism = sharded(model, fsdp, FP32, restores=on_meta)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        return CheckpointManager(
            checkpointing=CheckpointConfig(save_every_n_steps=0, keep_last_n=1),
            fsdp=fsdp,
            output_dir=f"{output_root}/fsdp{version}",
            model=model,
            parallelism=parallelism,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=None,
            model_config=model_config,
            spec=spec,
            tokenizer=tokenizer,
            info=info,
            lora=LoraConfig(),
            base_model=folder,
        )

    def buffers_as_fresh(model: nn.Module) -> bool:
        return all(torch.equal(buffer.cpu(), fresh_buffers[name.replace("_fsdp_wrapped_module.", "")])
                   for name, buffer in model.named_buffers())  # fmt: skip

    half = steps // 2
    for version in (1, 2):
        run = checkpointer(version, on_meta=False)
        losses = train_wrapped(run.model, run.parallelism, run.optimizer, rank, world_size, half, vocab, spec=spec)
        checkpoint = run.save(TrainProgress(epoch=1, samples_consumed=half, global_step=half))
        losses += train_wrapped(
            run.model, run.parallelism, run.optimizer, rank, world_size, steps, vocab, first=half, spec=spec
        )
        run.export_hf()
        resumed = checkpointer(version, on_meta=True)
        resumed.load(resolve_start(checkpoint, f"{output_root}/fsdp{version}"))
        resumed_buffers = buffers_as_fresh(resumed.model)
        resumed_losses = train_wrapped(
            resumed.model,
            resumed.parallelism,
            resumed.optimizer,
            rank,
            world_size,
            steps,
            vocab,
            first=half,
            spec=spec,
        )
        fsdp = _fsdp_config({"fsdp_version": version, "cpu_ram_efficient_loading": True,
                             "fsdp_activation_checkpointing": True})  # fmt: skip
        skeleton = version == 1 or rank != 0
        rank0_loaded, parallelism = sharded(load_model(folder, on_meta=skeleton, dropout_rate=0.0), fsdp, FP32,
                                            weights_source=folder)  # fmt: skip
        rank0_buffers = buffers_as_fresh(rank0_loaded)
        optimizer = torch.optim.AdamW(rank0_loaded.parameters(), lr=LR)
        rank0_loaded_losses = train_wrapped(
            rank0_loaded, parallelism, optimizer, rank, world_size, steps, vocab, spec=spec
        )
        packed_losses = None
        if spec is CAUSAL:
            packed = checkpointer(version, on_meta=False)
            packed_losses = train_wrapped(
                packed.model,
                packed.parallelism,
                packed.optimizer,
                rank,
                world_size,
                steps,
                vocab,
                spec=spec,
                packed=True,
            )
        out[version] = {
            "losses": losses,
            "checkpoint": checkpoint,
            "resumed_losses": resumed_losses,
            "resumed_buffers_as_fresh": resumed_buffers,
            "rank0_loaded_losses": rank0_loaded_losses,
            "packed_losses": packed_losses,
            "rank0_loaded_buffers_as_fresh": rank0_buffers,
            "state": run.parallelism.full_state_dict(run.model, CPU),  # rank 0's, {} elsewhere
            "resumed_state": resumed.parallelism.full_state_dict(resumed.model, CPU),
        }
    return out


# ------------------------------------------------------------------ long work on one rank, full disks, shared dirs


def busy_for(seconds: float) -> None:
    """Legitimate work that takes `seconds`: the CPU kept busy (a long write or read shows progress alike)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


def short_timeouts(seconds: float) -> None:
    """This group's collectives and its store give up after `seconds` (as --dist_timeout_s would set them)."""
    _set_pg_timeout(datetime.timedelta(seconds=seconds))
    default_store().set_timeout(datetime.timedelta(seconds=seconds))


def progress_bounded_worker(rank: int, world_size: int, timeout_s: float) -> dict:
    """Rank 0's part of a progress-bounded block, while rank 1 waits: busy for 3x the timeout; asleep (no progress)
    for 3x; failing; refusing an input of its own (a UserError). What each rank saw and how long it waited."""
    from configs.errors import DataError

    def refuse():
        raise DataError("data/train.csv is not on this node: copy it there")

    short_timeouts(timeout_s)
    seen = {}
    for case, part in (
        ("busy", lambda: busy_for(3 * timeout_s)),
        ("asleep", lambda: time.sleep(3 * timeout_s)),
        ("failing", lambda: 1 / 0),
        ("refusing", refuse),
    ):
        started = time.monotonic()
        try:
            with progress_bounded(f"the {case} case"):
                if rank == 0:
                    part()
            seen[case] = "done"
        except (PeerStalled, PeerFailed, ZeroDivisionError, DataError) as err:
            seen[case] = f"{type(err).__name__}: {err}"
            seen[f"{case}_refusal"] = getattr(err, "refusal", None)
        seen[f"{case}_s"] = time.monotonic() - started
        _set_pg_timeout(datetime.timedelta(seconds=60))  # the next case starts together (rank 0 may still sleep)
        dist.barrier()
        short_timeouts(timeout_s)
    return seen


def long_rank0_work_worker(rank: int, world_size: int, output_dir: str, timeout_s: float) -> dict:
    """With collectives that give up after `timeout_s`: rank 0 reads the model alone (FSDP2 rank-0-only
    loading), writes a FULL checkpoint and checks its share of it on resume, each taking 3x the timeout, while
    rank 1 waits. Then the control: the same wait in a plain barrier."""
    short_timeouts(timeout_s)
    info = DistInfo(rank, rank, world_size, CPU, "gloo")
    fsdp = _fsdp_config({"fsdp_version": 2, "cpu_ram_efficient_loading": True, "checkpoint_type": layout.FULL})
    seconds = {}

    started = time.monotonic()
    with progress_bounded("model loading"):  # as T5_training.fsdp_main loads the model
        if rank == 0:
            busy_for(3 * timeout_s)  # a large from_pretrained
        model = tiny_t5(seed=5) if rank == 0 else tiny_t5(on_meta=True)
    model, parallelism = sharded(model, fsdp, FP32)
    seconds["loading"] = time.monotonic() - started

    tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    checkpointing = CheckpointConfig(save_every_n_steps=0, keep_last_n=2)
    real_hashed_file = checkpoint_manager.hashed_file

    @contextlib.contextmanager
    def slow_hashed_file(*args, **kwargs):
        busy_for(3 * timeout_s / 2)  # model.pt and optimizer.pt: 3x the timeout in all
        with real_hashed_file(*args, **kwargs) as stream:
            yield stream

    manager = plain_manager(model, parallelism, fsdp, checkpointing, output_dir, info, tokenizer)
    optimizer, settings = manager.optimizer, StepSettings(parallelism, spec=SEQ2SEQ)
    train_step(model, make_batch(batch_seed(1, rank)), optimizer, None, world_size, settings)
    started = time.monotonic()
    with mock.patch.object(checkpoint_manager, "hashed_file", slow_hashed_file if rank == 0 else real_hashed_file):
        saved = manager.save(TrainProgress(epoch=1, samples_consumed=1, global_step=1))
    seconds["save"] = time.monotonic() - started

    real_problem_with = integrity.problem_with
    checked = []

    def slow_problem_with(*args, **kwargs):
        if not checked:
            busy_for(3 * timeout_s)  # the first piece: a large file on slow storage
        checked.append(args[1])
        return real_problem_with(*args, **kwargs)

    started = time.monotonic()
    with mock.patch.object(integrity, "problem_with", slow_problem_with if rank == 0 else real_problem_with):
        start = resolve_start("true", output_dir)
    seconds["check"] = time.monotonic() - started

    started = time.monotonic()
    try:
        if rank == 0:
            busy_for(3 * timeout_s)
        dist.barrier()
        control = "done"
    except RuntimeError as err:
        control = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    seconds["control"] = time.monotonic() - started
    return {"seconds": seconds, "saved": saved, "start": start.path, "control": control}


def disk_full_worker(rank: int, world_size: int, output_root: str) -> dict:
    """A disk that fills up during a checkpoint save, after a first complete one: a FULL save (rank 0 writes),
    a SHARDED one (rank 1's shard fails), and an FSDP1 background one (written by a thread). Each rank's error,
    and what checkpoints are left."""
    info = DistInfo(rank, rank, world_size, CPU, "gloo")
    tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    real_write = integrity.HashingFile.write
    full = {"fail": False}

    def write(stream, data):
        if full["fail"] and (rank == 1 or stream.hashes.bytes > 1000):  # a part written before the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(stream, data)

    out = {}
    for case, overrides, background in (
        ("FULL", {"checkpoint_type": layout.FULL}, False),
        ("SHARDED", {"checkpoint_type": layout.SHARDED}, False),
        ("background", {"checkpoint_type": layout.SHARDED}, True),
    ):
        fsdp = _fsdp_config({"fsdp_version": 1, **overrides})
        output_dir = os.path.join(output_root, case)
        model, parallelism = sharded(tiny_t5(), fsdp, FP32)
        checkpointing = CheckpointConfig(save_every_n_steps=0, keep_last_n=2, async_checkpoint=background)
        manager = plain_manager(model, parallelism, fsdp, checkpointing, output_dir, info, tokenizer)
        optimizer, settings = manager.optimizer, StepSettings(parallelism, spec=SEQ2SEQ)
        full["fail"] = False
        with manager, mock.patch.object(integrity.HashingFile, "write", write):
            train_step(model, make_batch(batch_seed(1, rank)), optimizer, None, world_size, settings)
            manager.save(TrainProgress(epoch=1, samples_consumed=1, global_step=1))
            manager.finish_pending()
            dist.barrier()
            full["fail"] = rank == 0 if case == "FULL" else rank == 1
            try:
                manager.save(TrainProgress(epoch=1, samples_consumed=2, global_step=2))
                manager.finish_pending()
                out[case] = "saved"
            except Exception as err:  # what the run would end with
                out[case] = f"{type(err).__name__}: {err}"
            full["fail"] = False
        dist.barrier()
        out[f"{case}_left"] = sorted(os.listdir(layout.checkpoint_root(output_dir)))
    return out


def checkpoint_size_worker(rank: int, world_size: int, output_root: str) -> dict:
    """The checkpoint manager's size of a checkpoint before any is written (the one a full disk's message gives),
    for sharded and replicated models."""
    info = DistInfo(rank, rank, world_size, CPU, "gloo")
    tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    out = {}
    for name, overrides in (
        ("FSDP1 FULL_SHARD", {}),
        ("FSDP1 NO_SHARD", {"sharding_strategy": "NO_SHARD"}),
        ("FSDP2 NO_SHARD", {"fsdp_version": 2, "sharding_strategy": "NO_SHARD"}),
    ):
        fsdp = _fsdp_config(overrides)
        model, parallelism = sharded(tiny_t5(), fsdp, FP32)
        output_dir = os.path.join(output_root, name.replace(" ", "_"))
        with plain_manager(model, parallelism, fsdp, CheckpointConfig(), output_dir, info, tokenizer) as manager:
            out[name] = manager._checkpoint_bytes()
    return out


def start_checks_worker(rank: int, world_size: int, root: str) -> dict:
    """The checks a multi-node run makes at start. The run lock's, that every rank sees output_dir: each rank in
    a working directory of its own, as a node is, given a relative --output_dir (each its own folder) and then
    an absolute one (shared). The background saves' room: rank 1's host reads 1 MB free in /dev/shm (faked)."""
    seen = {}
    with mock.patch.object(background_writing, "free_shared_memory", lambda: 2**20 if rank == 1 else 10**12):
        try:
            background_writing.check_room_to_stage(50 * 10**6, shared=True)
            seen["room"] = "enough"
        except ConfigError as err:
            seen["room"] = str(err)
    here = os.path.join(root, f"node_{rank}")
    os.makedirs(here)
    os.chdir(here)  # put back by the rank pool after the scenario
    for case, output_dir in (("relative", "out"), ("absolute", os.path.join(root, "shared_out"))):
        try:
            with claimed_output_dir(output_dir):
                seen[case] = "claimed"
        except ConfigError as err:
            seen[case] = str(err)
        dist.barrier()
    return seen


# What makes a CUDA host wait for the device: reading a value back (.item(), float(), bool()), a tensor made
# from Python data (torch.tensor: a copy from pageable memory, which waits for the stream), and ops whose
# output size depends on the values (nonzero, boolean-mask indexing). On CPU they cost nothing, but the same
# ops run on a GPU, so counting them here tells what a GPU step waits for.
HOST_READ_OPS = {"_local_scalar_dense", "lift_fresh", "nonzero", "masked_select"}


class HostReads(TorchDispatchMode):
    """Each op of HOST_READ_OPS that runs inside it: (op, the package's line that asked for it, the library
    file under it that made the op, or "")."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        boolean_index = name == "index" and any(
            index is not None and index.dtype == torch.bool for index in (args[1] if len(args) > 1 else [])
        )
        if name in HOST_READ_OPS or boolean_index:
            self.reads.append((name, *self.callers()))
        return func(*args, **(kwargs or {}))

    @staticmethod
    def callers() -> tuple[str, str]:
        """The innermost frame of the package's own code (not the tests'), and the innermost file of a library
        other than torch (transformers, peft) below it."""
        frames = traceback.extract_stack()[:-3]
        libraries = [f for f in frames if "site-packages" in f.filename and "/torch/" not in f.filename]
        own = [
            f
            for f in frames
            if f.filename.startswith(str(REPO_ROOT))
            and not {"tests", "site-packages"} & set(Path(f.filename).parts)
        ]
        package = f"{Path(own[-1].filename).name}:{own[-1].lineno} ({own[-1].line})" if own else ""
        library = libraries[-1].filename.split("site-packages/")[-1] if libraries else ""
        return package, library


def host_reads_worker(rank: int, world_size: int, kernel: str = "sdpa") -> dict:
    """For each FSDP version, the host reads of a training step as the trainer takes it (2 accumulated
    micro-batches, clipping, the non-finite check, FLOPs counted, the step's statistics recorded), after a first
    step that sets FSDP up, and of a validation pass of 3 batches that watches for a stop request; the model's
    attention is `kernel`."""
    t5_attention.register()
    out = {}
    for version in (1, 2):
        config = _fsdp_config({"fsdp_version": version, "fsdp_activation_checkpointing": True})
        model, parallelism = sharded(tiny_t5(attn_implementation=kernel), config, FP32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        settings = step_module.StepSettings(
            parallelism,
            max_grad_norm=1.0,
            sync_each_micro_batch=False,
            skip_nonfinite=True,
            flops=Seq2SeqFlops.from_config(tiny_t5(on_meta=True).config),
            recompute=True,
            spec=SEQ2SEQ,
        )
        step_log = StepLog(every=100, on_flush=lambda records: None)
        steps = HostReads()
        for step in range(2):
            micro_batches = [move_batch(make_batch(batch_seed(step, rank) + k), CPU) for k in range(2)]
            with steps if step else contextlib.nullcontext():
                stats = train_step(model, micro_batches, optimizer, None, world_size, settings)
                step_log.add(step + 1, LR, stats)
        step_log.flush()  # a host read by design, once per --log_every_n_steps: outside the recording
        loader = [make_batch(batch_seed(9, rank) + k) for k in range(3)]
        validation = HostReads()
        with validation:
            validate(model, loader, device=CPU, num_real_samples=9,
                     progress=ProgressLines(3, "validation", "batch"), stop_requested=lambda: False,
                     spec=SEQ2SEQ)  # fmt: skip
        out[version] = {"steps": steps.reads, "validation": validation.reads}
    return out


GATHER_TOKENS = (2, 4)  # new tokens of two generations: their difference in all-gathers is per token
GATHER_VARIANTS = {  # name: (FSDP overrides, precision)
    "FSDP1": ({"fsdp_version": 1}, FP32),
    "FSDP2": ({"fsdp_version": 2}, FP32),
    "FSDP1 HYBRID_SHARD, original parameters": (
        {"sharding_strategy": "HYBRID_SHARD", "use_orig_params": True},
        FP32,
    ),
    "FSDP2 bf16": ({"fsdp_version": 2}, Precision("bfSixteen_fp32_reduce")),
}


def generation_gathers_worker(rank: int, world_size: int) -> dict:
    """For each of GATHER_VARIANTS, with and without --gather_for_generation: the all-gathers of a greedy
    generation of each of GATHER_TOKENS new tokens, its token ids, whether every unit is sharded again after it,
    and the loss of a training step after it."""
    from scripts.gpu_check import AllGatherCount
    from utils.eval.generation import gathered_for_generation, generate

    out = {}
    settings = {"num_beams": 1, "do_sample": False}
    for name, (overrides, precision) in GATHER_VARIANTS.items():
        for keep in (False, True):
            model, parallelism = sharded(tiny_t5(seed=3), _fsdp_config(overrides), precision)
            model.eval()
            counts, ids = {}, {}
            for tokens in GATHER_TOKENS:
                counter = AllGatherCount()
                with counter, gathered_for_generation(model, parallelism, keep):
                    ids[tokens] = generate(
                        model,
                        parallelism,
                        SEQ2SEQ.prompts(make_batch(rank, rows=2)),
                        {**settings, "max_new_tokens": tokens, "min_new_tokens": tokens},
                    ).tolist()
                counts[tokens] = counter.count
            model.train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            out[(name, keep)] = {
                "whole_numel": parallelism.param_numel_whole(model),
                "all_gathers": counts,
                "ids": ids,
                "sharded_after": all_units_sharded(model),
                "losses_after": train_wrapped(model, parallelism, optimizer, rank, world_size, 1),
            }
    return out


def all_units_sharded(model: nn.Module) -> bool:
    """No unit holds its gathered parameters: FSDP1's unsharded buffers freed, FSDP2's parameters DTensors."""
    if isinstance(model, FSDP):
        buffers = [fsdp1_unsharded_flat_parameter(unit) for unit in FSDP.fsdp_modules(model)]
        return all(b is None or b.untyped_storage().size() == 0 for b in buffers)
    return all(isinstance(p, DTensor) for p in model.parameters())


def stop_check_worker(rank: int, world_size: int, request_at: int, batches: int) -> int | None:
    """The batch at which StopCheck raises StopAgreed on this rank (None: the pass ended) when rank 1 is asked
    to stop before batch `request_at`."""
    check = StopCheck(lambda: rank == 1 and batch >= request_at, CPU)
    for batch in range(batches):  # noqa: B007 - the stop request reads it
        try:
            check()
        except StopAgreed:
            return batch
    return None


def causal_lora_worker(rank: int, world_size: int, folder: str, targets: str, export_dir: str) -> dict:
    """LoRA on a decoder-only model under FSDP2: 3 steps, then the merged model written from the shards to
    export_dir/hf_model; rank 0 returns the gathered trained PEFT model's state dict (PEFT's names)."""
    torch.manual_seed(0)
    lora = LoraConfig(peft="lora", lora_r=4, lora_alpha=8, lora_target_modules=targets, merge_lora=True)
    model = apply_lora(load_model(folder, dropout_rate=0.0), lora, folder, CAUSAL)
    model_config = model.config
    model, parallelism = sharded(model, _fsdp_config({"fsdp_version": 2}), FP32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_wrapped(model, parallelism, optimizer, rank, world_size, 3, model_config.vocab_size, spec=CAUSAL)
    _, merged = lora_exports(sharded_model_state(model), lora, CPU, transposed_layers(model))
    write_model_folder(
        merged, model_config, CAUSAL, load_tokenizer(folder), f"{export_dir}/hf_model", 10**9, rank == 0
    )
    return {"state": parallelism.full_state_dict(model, CPU)}


def rope_precision_worker(rank: int, world_size: int, folder: str) -> dict:
    """A decoder-only model's RoPE frequencies (inv_freq, a computed buffer) after a bf16 forward under each
    backend: their dtype, and whether they equal a fresh model's. The weights compute in bf16 either way."""
    fresh = load_model(folder, dropout_rate=0.0)
    expected = {name: buffer.clone() for name, buffer in fresh.named_buffers() if name.endswith("inv_freq")}
    out = {}
    for version in (1, 2):
        model, parallelism = sharded(load_model(folder, dropout_rate=0.0), _fsdp_config({"fsdp_version": version}),
                            Precision("bfSixteen"))  # fmt: skip
        batch = causal_batch(seed=rank, vocab=fresh.config.vocab_size)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        buffers = {name.replace("_fsdp_wrapped_module.", ""): buffer for name, buffer in model.named_buffers()}
        out[version] = {
            "compute": str(logits.dtype),
            "dtypes": sorted({str(buffers[name].dtype) for name in expected}),
            "as_fresh": all(torch.equal(buffers[name].cpu(), value) for name, value in expected.items()),
        }
    return out


def unprefixed_rank0_loading_worker(rank: int, world_size: int, folder: str) -> dict:
    """FSDP1's rank-0-only loading (every rank on meta, each unit read by name from the safetensors file) of a
    folder whose file stores names without the model's base prefix, as GPT-2's hub files do (wte.weight, not
    transformer.wte.weight): every rank's full state dict against the model transformers loads from it."""
    config = _fsdp_config({"fsdp_version": 1, "cpu_ram_efficient_loading": True})
    model, parallelism = sharded(
        load_model(folder, on_meta=True, dropout_rate=0.0), config, FP32, weights_source=folder
    )
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    reference = load_model(folder, dropout_rate=0.0).state_dict()
    return {
        "keys_equal": sorted(full) == sorted(reference),
        "max_diff": max((full[name] - value).abs().max().item() for name, value in reference.items()),
    }


def causal_compile_worker(rank: int, world_size: int, folder: str, steps: int) -> dict:
    """fp32 per-step losses of a decoder-only model with every decoder layer compiled (aot_eager, through
    utils/fsdp/shard.py's compile_layers), for FSDP1 (original parameters) and FSDP2, on plain rows and on
    packed blocks, and the graphs compiled for each; the unsharded, uncompiled reference's on rank 0."""
    import torch._dynamo

    fresh = load_model(folder, dropout_rate=0.0)
    vocab = fresh.config.vocab_size
    out: dict = {}
    graphs: list = []
    with layers_compiled_by("aot_eager", lambda: graphs.append(1)):
        for packed in (False, True):
            if rank == 0:
                out[("reference", packed)] = reference_run(steps, world_size, copy.deepcopy(fresh), vocab, CAUSAL,
                                                           packed=packed)[0]  # fmt: skip
            for version, overrides in ((1, {"use_orig_params": True}), (2, {"fsdp_version": 2})):
                torch._dynamo.reset()
                graphs.clear()
                model, parallelism = sharded(
                    copy.deepcopy(fresh), _fsdp_config({**overrides, "compile": True}), FP32
                )
                optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
                losses = train_wrapped(
                    model, parallelism, optimizer, rank, world_size, steps, vocab, spec=CAUSAL, packed=packed
                )
                out[(version, packed)] = {"losses": losses, "graphs": len(graphs)}
    return out


def unwritable_on_one_rank_worker(rank: int, world_size: int, output_dir: str, failing_rank: int) -> str | None:
    """check_writable on every rank, where `failing_rank`'s probe (-1: none) meets a full quota, injected at its
    fsync as a quota of that node's disk would: each rank's ConfigError message, or None."""
    fsync = os.fsync

    def quota_exceeded(descriptor: int) -> None:
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    if rank == failing_rank:
        os.fsync = quota_exceeded
    try:
        check_writable(output_dir, evaluating=False, saves_checkpoints=True)
    except ConfigError as err:
        return str(err)
    finally:
        os.fsync = fsync
    return None
