"""What the test modules share of the functions run on each rank of a spawned gloo group by
tests/dist_harness.run_ranks: the tiny models, their batches, the unsharded reference and the sharded runs. A
rank function that one module alone runs lives in that module.

Models are the embedded tiny T5's architecture with dropout off, so that sharded and unsharded runs see the
same computation and any difference comes from FSDP itself.
"""

import contextlib
import copy
import dataclasses
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer

from configs.checkpointing import CheckpointConfig
from configs.fsdp import FSDPConfig
from configs.lora import LoraConfig
from configs.paths import EMBEDDED_MODEL_DIR
from policies.mixed_precision import Precision
from utils.base import layout
from utils.checkpoint.final_models import FinalModels
from utils.checkpoint.hf_export import write_model_folder
from utils.checkpoint.manager import CheckpointManager
from utils.checkpoint.progress import TrainProgress
from utils.checkpoint.start import resolve_start
from utils.checkpoint.state_dicts import save_full_model, sharded_model_state
from utils.data.loaders import IGNORED
from utils.distributed.process_group import DistInfo
from utils.fsdp.parallelism import Parallelism, parallelism_for
from utils.model import t5_attention
from utils.model.loading import load_full_model_state, load_model, load_tokenizer
from utils.spec import CAUSAL, SEQ2SEQ, ModelSpec, spec_for
from utils.train import step as step_module
from utils.train.step import StepSettings, train_step
from utils.train.step_log import StepLog

CPU = torch.device("cpu")
VOCAB = 1100
LR = 1e-3
FP32 = Precision("fp32_policy")
EXPORT_FILE_BYTES = 100_000  # the tiny model's 1.2 MB over several files, as --export_max_file_gb splits


def tiny_t5(
    seed: int = 0, on_meta: bool = False, attn_implementation: str = "sdpa", blocks: int | None = None
) -> T5ForConditionalGeneration:
    """The embedded tiny T5's shape, randomly initialised from `seed` (or on the meta device); `blocks`: that many
    T5Blocks in each stack instead of its 2."""
    stacks = {} if blocks is None else {"num_layers": blocks, "num_decoder_layers": blocks}
    config = T5Config.from_pretrained(EMBEDDED_MODEL_DIR, dropout_rate=0.0, use_cache=False, **stacks)
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
        export_from_shards(model, export_folder, rank)
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


def export_from_shards(model: nn.Module, folder: str, rank: int) -> int:
    """The sharded tiny T5 written from its shards to `folder` as a model folder, in files of at most
    EXPORT_FILE_BYTES; the number of weights files."""
    tokenizer = T5Tokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    model_config = tiny_t5(on_meta=True).config
    state = sharded_model_state(model)
    return write_model_folder(state, model_config, SEQ2SEQ, tokenizer, folder, EXPORT_FILE_BYTES, rank == 0)


def full_state_against(model: nn.Module, reference: dict) -> dict:
    """This rank's gathered full state dict of `model` against `reference`: the same names, and the largest
    difference."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        "keys_equal": sorted(full) == sorted(reference),
        "max_diff": max((full[name] - value).abs().max().item() for name, value in reference.items()),
    }


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
    files = export_from_shards(model, f"{path}.hf", rank)
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
        tokenizer=tokenizer,
        info=info,
    )


def forward_logits(model, batch: dict) -> torch.Tensor:
    labels = batch["target_ids"].masked_fill(batch["target_mask"] == 0, -100)
    return model(input_ids=batch["source_ids"], attention_mask=batch["source_mask"], labels=labels).logits


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


# r=1: an adapter's A (1 x d_model) has its one row on rank 0 and none on rank 1, the uneven and empty
# shards the export's gather of the adapters must handle.
LORA = LoraConfig(
    peft="lora", lora_r=1, lora_alpha=8, lora_dropout=0.0, lora_target_modules="q,v", merge_lora=False
)
LORA_BASE = str(EMBEDDED_MODEL_DIR)  # what the adapter's config names as its base


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
            tokenizer=tokenizer,
            info=info,
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
        FinalModels(run, spec=spec, lora=LoraConfig(), base_model=folder).export_hf()
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
