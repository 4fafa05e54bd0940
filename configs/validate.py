"""Every rule that ties settings together, or a setting to the launch: checked right after parsing.

`check_settings` runs on every rank before the process group, the model or the data exist, so a refused
combination costs seconds, not the minutes of reading an 11B model. Each refusal is a ConfigError that
names the flags and the fix. Rules about single values (types, bounds, choices) are the CLI's
(configs/cli.py); rules that need the data or the file system (split sizes, --resume paths) run when those
are first read.
"""

import importlib.util
from collections.abc import Collection

from configs.checkpointing import CheckpointConfig
from configs.data import DataConfig
from configs.errors import ConfigError
from configs.evaluation import METRIC_KEYS, EvalConfig
from configs.fsdp import HYBRID, FSDPConfig, hybrid_group_size, wraps_in_fsdp
from configs.lora import LoraConfig
from configs.observability import ObserveConfig
from configs.paths import EMBEDDED_DATA_DIR
from configs.recipe import RecipeConfig
from configs.run import RunConfig
from configs.training import TrainConfig

FLOAT8_MIN_CAPABILITY = (8, 9)
TENSORBOARD_HINT = "--tensorboard true needs the tensorboard package: pip install tensorboard"


def check_settings(
    config: RunConfig,
    world_size: int,
    device_type: str | None = None,
    compute_capability: tuple[int, int] = (0, 0),
) -> None:
    """Raise ConfigError for the first combination that cannot run as asked on `world_size` ranks of
    `device_type` ("cuda" or "cpu"; on CUDA, of `compute_capability`). None: the device is not known yet (the
    entry point checks the settings before it imports torch, which says whether there is a GPU, then again with
    the device), so the rules about the device wait."""
    fsdp = config.fsdp
    check_precision(fsdp, device_type)
    check_float8(fsdp, config.lora)
    if device_type is not None:
        check_device_settings(fsdp, device_type)
        check_attention(config.recipe, device_type)
        check_float8_device(fsdp, device_type, compute_capability)
    if wraps_in_fsdp(fsdp, world_size):
        check_wrapping(config, world_size)
    else:
        check_unwrapped(fsdp)
    check_activation_checkpointing(fsdp)
    check_checkpointing(config.checkpointing, config.fsdp)
    check_data_source(config.data, config.evaluation)
    check_evaluation(config.evaluation, config.train)
    check_schedule(config.recipe)
    check_optional_packages(config.observe, config.lora)
    check_profile(config.observe, config.recipe)
    check_lora(config.lora)
    check_loss_chunks(config.recipe, config.lora)


def check_wrapping(config: RunConfig, world_size: int) -> None:
    """The rules of FSDP's own settings, where FSDP wraps the model."""
    fsdp = config.fsdp
    if fsdp.fsdp_version == 2:
        check_fsdp2_settings(fsdp)
    check_hybrid_sharding(fsdp, world_size)
    check_decay_groups(config.train, fsdp)
    check_compile(fsdp)
    check_units_inside_per_op_checkpoints(fsdp, config.lora)


def check_precision(fsdp_config: FSDPConfig, device_type: str | None) -> None:
    check_reduce_dtype(fsdp_config)
    if fsdp_config.allow_emulated_bf16 and (not fsdp_config.mixed_precision or fsdp_config.use_fp16):
        raise ConfigError(
            "--allow_emulated_bf16 true applies to bf16 training (--mixed_precision true --use_fp16 false); "
            "leave it false for fp32 or fp16"
        )
    if not fsdp_config.use_fp16:
        return
    if not fsdp_config.mixed_precision:
        raise ConfigError("--use_fp16 true needs --mixed_precision true (fp16 is a mixed-precision mode)")
    if device_type not in (None, "cuda"):
        raise ConfigError(
            "--use_fp16 true needs a CUDA GPU (fp16 with a gradient scaler); on CPU use bf16 "
            "(--use_fp16 false) or fp32 (--mixed_precision false)"
        )


def check_reduce_dtype(fsdp_config: FSDPConfig) -> None:
    """--reduce_dtype chooses between the bf16 policies; elsewhere the policy fixes the reduction dtype."""
    reduce = fsdp_config.reduce_dtype
    if reduce == "auto":
        return
    if not fsdp_config.mixed_precision or fsdp_config.use_fp16:
        raise ConfigError(
            f"--reduce_dtype {reduce} applies to bf16 training (--mixed_precision true --use_fp16 false); "
            "fp32 and fp16 training reduce in their own dtype: leave --reduce_dtype auto"
        )
    if reduce == "fp32" and fsdp_config.bf16_policy == "bfSixteen_working":
        raise ConfigError(
            "--bf16_policy bfSixteen_working computes in fp32 in order to reduce in bf16; with --reduce_dtype "
            "fp32 nothing would be bf16. Use --mixed_precision false (fp32), or --bf16_policy bfSixteen "
            "--reduce_dtype fp32 (bf16 compute, fp32 reduction)."
        )


def check_device_settings(fsdp_config: FSDPConfig, device_type: str) -> None:
    """Settings that need GPUs, refused on a CPU group rather than silently ignored."""
    if device_type == "cuda":
        return
    if fsdp_config.fsdp_cpu_offload:
        raise ConfigError(
            "--fsdp_cpu_offload true needs GPUs: on a CPU group the parameters already live in host memory"
        )
    if fsdp_config.sync_module_states and fsdp_config.fsdp_version == 1:
        raise ConfigError(
            "--sync_module_states true needs GPUs: FSDP1 refuses it for CPU tensors. For rank-0-only "
            "loading on CPU use --cpu_ram_efficient_loading true instead (either --fsdp_version)."
        )


def check_float8(fsdp_config: FSDPConfig, lora: LoraConfig) -> None:
    """torchao's float8 training is installed, and trains the model's own Linear layers."""
    if not fsdp_config.float8:
        return
    if lora.peft == "lora":
        raise ConfigError(
            "--float8 true trains the model's Linear layers in float8; with --peft lora those are frozen and only "
            "the small adapters train, which torchao's float8 training (converted Linear layers) does not cover "
            "here. Drop --float8, or train without --peft lora."
        )
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("--float8 true needs the torchao package: pip install torchao")


def check_float8_device(fsdp_config: FSDPConfig, device_type: str, compute_capability: tuple[int, int]) -> None:
    """Float8 matmuls (torch._scaled_mm on float8 tensor cores) need compute capability 8.9: Ada, Hopper and
    later."""
    if not fsdp_config.float8:
        return
    if device_type != "cuda":
        raise ConfigError(
            "--float8 true needs CUDA GPUs of compute capability 8.9 or newer (Ada, Hopper, Blackwell: float8 "
            "tensor cores); this run is on CPU. Drop --float8."
        )
    if compute_capability < FLOAT8_MIN_CAPABILITY:
        major, minor = compute_capability
        raise ConfigError(
            f"--float8 true needs GPUs of compute capability 8.9 or newer (Ada, Hopper, Blackwell: float8 tensor "
            f"cores); this GPU's is {major}.{minor}. Drop --float8."
        )


def check_attention(recipe: RecipeConfig, device_type: str) -> None:
    if recipe.attn_implementation == "flex_attention" and device_type != "cuda":
        raise ConfigError(
            "--attn_implementation flex_attention needs a GPU: torch's FlexAttention has no backward on CPU. "
            "Use sdpa (the default) or eager."
        )


def check_fsdp2_settings(fsdp_config: FSDPConfig) -> None:
    """Refuse the FSDP1 settings that mean nothing under FSDP2, instead of silently dropping them."""
    if fsdp_config.sync_module_states:
        raise ConfigError(
            "--sync_module_states is FSDP1's; with --fsdp_version 2 use --cpu_ram_efficient_loading true "
            "(rank 0's weights broadcast after sharding)"
        )
    if fsdp_config.wrap_policy != "transformer":
        raise ConfigError(
            "--wrap_policy size_based has no FSDP2 equivalent (FSDP2 has no auto-wrap policies; each stack "
            "layer is sharded). Use --wrap_policy transformer with --fsdp_version 2."
        )
    if fsdp_config.backward_prefetch == "BACKWARD_POST":
        raise ConfigError(
            "--backward_prefetch BACKWARD_POST has no FSDP2 equivalent; FSDP2 prefetches like BACKWARD_PRE "
            "(or not at all with --backward_prefetch NONE)."
        )
    if not fsdp_config.limit_all_gathers:
        raise ConfigError(
            "--limit_all_gathers false has no FSDP2 equivalent: FSDP2 manages all-gather memory itself. "
            "Leave it true with --fsdp_version 2."
        )


def check_hybrid_sharding(fsdp_config: FSDPConfig, world_size: int) -> None:
    """The shard group must divide the world; FSDP1 must not get one-rank groups.

    With a shard group of one rank, FSDP1 falls back to NO_SHARD inside the group and never all-reduces
    across the groups: the ranks train different models without any error (measured: losses 0.4-1% off
    after 4 steps on 2 and 4 ranks). FSDP2 handles a replicate x 1 mesh correctly (tested).
    """
    strategy = fsdp_config.sharding_strategy
    if strategy not in HYBRID:
        return
    group = hybrid_group_size(world_size, fsdp_config.hybrid_shard_group_size)
    if group == 1 and fsdp_config.fsdp_version == 1:
        raise ConfigError(
            f"--sharding_strategy {strategy} with a shard group of 1 rank: FSDP1 would silently stop "
            "synchronising gradients across groups. Use --sharding_strategy NO_SHARD (pure replication), "
            "a --hybrid_shard_group_size above 1, or --fsdp_version 2."
        )


def check_unwrapped(fsdp_config: FSDPConfig) -> None:
    """With --single_rank_fsdp false one rank trains the model unwrapped: what only FSDP does is refused (FSDP's
    other settings, its version, strategy and the rest, mean nothing there)."""
    if fsdp_config.fsdp_cpu_offload:
        raise ConfigError(
            "--fsdp_cpu_offload true is FSDP's (each unit copied to the GPU as it runs); with --single_rank_fsdp "
            "false the model is not wrapped. Leave --single_rank_fsdp true to offload, or pass --fsdp_cpu_offload "
            "false (an accelerate config's fsdp_offload_params sets it too)."
        )
    if fsdp_config.cpu_ram_efficient_loading:
        raise ConfigError(
            "--cpu_ram_efficient_loading true spares the other ranks a copy of the weights; one rank reads them "
            "once anyway, and with --single_rank_fsdp false no FSDP unit would fill a skeleton. Pass "
            "--cpu_ram_efficient_loading false (an accelerate config's fsdp_cpu_ram_efficient_loading sets it "
            "too)."
        )


def check_activation_checkpointing(fsdp_config: FSDPConfig) -> None:
    """The scope says what activation checkpointing recomputes: without checkpointing there is none to say; and
    per op, torch.compile does not compile the layers (or, compiling the checkpoints, miscomputes T5:
    docs/pitfalls.md #51)."""
    if fsdp_config.activation_checkpointing_scope == "ops" and not fsdp_config.fsdp_activation_checkpointing:
        raise ConfigError(
            "--activation_checkpointing_scope ops says what activation checkpointing recomputes, and "
            "--fsdp_activation_checkpointing false turns it off: add --fsdp_activation_checkpointing true, or "
            "drop --activation_checkpointing_scope"
        )
    if fsdp_config.activation_checkpointing_scope == "ops" and fsdp_config.compile:
        raise ConfigError(
            "--compile true with --activation_checkpointing_scope ops: a layer compiled inside a per-op "
            "checkpoint runs uncompiled (torch's selective-checkpoint mode keeps dynamo out), and compiling "
            "the checkpoint itself gave T5 a wrong gradient (docs/memory.md). Use "
            "--activation_checkpointing_scope blocks with --compile true, or ops without it."
        )


def check_units_inside_per_op_checkpoints(fsdp_config: FSDPConfig, lora: LoraConfig) -> None:
    """FSDP1 units inside the checkpointed layers (LoRA's adapters, size_based units) run their hooks again in a
    per-op checkpoint's recompute, where torch 2.13 checks that every op comes back as often as in the forward:
    their profiler ranges do not (measured with LoRA: the backward stops with "encountered during backward but
    not found in storage")."""
    if fsdp_config.activation_checkpointing_scope != "ops" or fsdp_config.fsdp_version != 1:
        return
    if lora.peft == "lora" or fsdp_config.wrap_policy == "size_based":
        inside = "--peft lora" if lora.peft == "lora" else "--wrap_policy size_based"
        raise ConfigError(
            f"--activation_checkpointing_scope ops with FSDP1 and {inside}: FSDP1 makes units inside the "
            "checkpointed layers, whose hooks torch's per-op recompute does not replay as in the forward (the "
            "backward fails). Use --fsdp_version 2, or --activation_checkpointing_scope blocks."
        )


def check_checkpointing(checkpointing: CheckpointConfig, fsdp_config: FSDPConfig) -> None:
    if checkpointing.save_every_n_steps and not checkpointing.keep_last_n:
        raise ConfigError(
            f"--save_every_n_steps {checkpointing.save_every_n_steps} with --keep_last_n 0: no checkpoint "
            "would be written. Keep at least one (--keep_last_n 1) or drop --save_every_n_steps."
        )
    if checkpointing.async_checkpoint and fsdp_config.checkpoint_type != "SHARDED_STATE_DICT":
        raise ConfigError(
            f"--async_checkpoint true writes sharded checkpoints in the background; --checkpoint_type "
            f"{fsdp_config.checkpoint_type} gathers the model on rank 0 and writes it at once. Add "
            "--checkpoint_type SHARDED_STATE_DICT, or drop --async_checkpoint."
        )


def check_data_source(data: DataConfig, evaluation: EvalConfig | None = None) -> None:
    """One source of rows: files, a named dataset, or a --data_dir (the embedded sample by default)."""
    files = [f"--{name}" for name in ("train_file", "validation_file", "test_file") if getattr(data, name)]
    given = [*files[:1], *(["--dataset_name"] if data.dataset_name else [])]
    if data.data_dir != str(EMBEDDED_DATA_DIR):
        given.append("--data_dir")
    if len(given) > 1:
        raise ConfigError(
            f"{' and '.join(given)} name two sources of data: give one (files, a --dataset_name, or a --data_dir)"
        )
    if data.dataset_config_name and not data.dataset_name:
        raise ConfigError("--dataset_config_name is the config of --dataset_name: give the dataset's name too")
    if data.packing and data.group_by_length:
        raise ConfigError(
            "--packing true and --group_by_length true: packed blocks hold rows of every length; drop one"
        )
    if data.packing_strategy != "documents" and not data.packing:
        raise ConfigError(f"--packing_strategy {data.packing_strategy} says how to pack: add --packing true")
    evaluation = evaluation or EvalConfig()
    if data.dataset_text_field and (evaluation.evaluate_only or evaluation.metric_for_best != "val_loss"):
        what = "--evaluate_only" if evaluation.evaluate_only else f"--metric_for_best {evaluation.metric_for_best}"
        raise ConfigError(
            f"--dataset_text_field: whole texts have no reference for generation to be scored against, so {what} "
            "has no score to give; their measure is the validation loss (--metric_for_best val_loss)"
        )
    if data.dataset_text_field and data.source_prefix:
        raise ConfigError(
            f"--dataset_text_field trains on whole texts, which have no prompt for --source_prefix "
            f"{data.source_prefix!r} to go before: drop it, or put it in the texts"
        )
    if data.dataset_text_field and (data.text_column or data.summary_column):
        raise ConfigError(
            "--dataset_text_field names the one column of whole texts; --text_column and --summary_column name a "
            "prompt's and its completion's: give one or the other"
        )
    if data.length_key != "source" and not data.group_by_length:
        raise ConfigError(
            f"--length_key {data.length_key} is what --group_by_length sorts by: add --group_by_length true"
        )


def check_evaluation(evaluation: EvalConfig, train_config: TrainConfig) -> None:
    """--run_validation is the switch of all evaluation (the validation loss and generation); --eval_rouge the
    switch of generation inside it, scored by --eval_metric. Choices that need a score need generation and
    that score; periodic evaluation needs evaluation."""
    if evaluation.evaluate_only:
        if not evaluation.eval_rouge:
            raise ConfigError("--evaluate_only true generates and scores outputs: it needs --eval_rouge true")
        return
    if evaluation.eval_split == "train":
        raise ConfigError(
            "--eval_split train: training evaluates on a split it does not train on (auto, validation or test); "
            "the train split is scored by --evaluate_only true"
        )
    best = evaluation.metric_for_best
    generates = train_config.run_validation and evaluation.eval_rouge
    if best != "val_loss" and not generates:
        raise ConfigError(
            f"--metric_for_best {best} needs generated outputs: --run_validation true (all evaluation) "
            "and --eval_rouge true (generation); or choose --metric_for_best val_loss"
        )
    if best != "val_loss" and best not in METRIC_KEYS[evaluation.eval_metric]:
        metric = next(name for name, keys in METRIC_KEYS.items() if best in keys)
        raise ConfigError(
            f"--metric_for_best {best} is a score of --eval_metric {metric}, but --eval_metric is "
            f"{evaluation.eval_metric}: choose one of {', '.join(METRIC_KEYS[evaluation.eval_metric])} or "
            f"val_loss, or --eval_metric {metric}"
        )
    if evaluation.eval_every_n_steps and not train_config.run_validation:
        raise ConfigError(
            "--eval_every_n_steps evaluates the validation loss and generation inside epochs, but "
            "--run_validation false turns all evaluation off: drop --eval_every_n_steps, or use "
            "--run_validation true"
        )
    if evaluation.eval_on_start and evaluation.evaluate_only:
        raise ConfigError(
            "--eval_on_start true evaluates before training; --evaluate_only trains nothing: drop one"
        )
    if evaluation.eval_on_start and not train_config.run_validation:
        raise ConfigError(
            "--eval_on_start true evaluates before training, but --run_validation false turns all evaluation "
            "off: drop --eval_on_start, or use --run_validation true"
        )


def check_optional_packages(observe: ObserveConfig, lora: LoraConfig) -> None:
    """A feature whose package is not installed fails here, on every rank, naming the pip line."""
    if observe.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(TENSORBOARD_HINT)
    if lora.peft == "lora" and importlib.util.find_spec("peft") is None:
        raise ConfigError("--peft lora needs the peft package: pip install peft")
    if observe.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb true needs the wandb package: pip install wandb")
    if observe.mlflow and importlib.util.find_spec("mlflow") is None:
        raise ConfigError("--mlflow true needs the mlflow package: pip install mlflow (or mlflow-skinny)")


def check_profile(observe: ObserveConfig, recipe: RecipeConfig) -> None:
    """The profiled steps must be steps the run trains (--max_steps is the one bound known before the data)."""
    start, count = observe.profile_start_step, observe.profile_num_steps
    last = start + count - 1
    if start and recipe.max_steps and last > recipe.max_steps:
        raise ConfigError(
            f"--profile_start_step {start} --profile_num_steps {count} profiles steps {start}-{last}, past "
            f"--max_steps {recipe.max_steps}: choose steps up to {recipe.max_steps}, or a higher --max_steps"
        )


OUTPUT_HEAD = "lm_head"  # transformers' name of every model's output head (get_output_embeddings)
LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "merge_lora")


def check_lora(lora: LoraConfig) -> None:
    """The LoRA settings that cannot run. Every FSDP setting can: FSDP1's adapters become units of their own
    (policies/wrapping.py), rank-0-only loading builds them as a loaded model's (utils/model/lora.py), and
    compiled they train as eagerly (tests/test_lora.py)."""
    if lora.peft != "lora":
        defaults = LoraConfig()
        given = [name for name in LORA_FIELDS if getattr(lora, name) != getattr(defaults, name)]
        if given:
            raise ConfigError(f"--{given[0]} sets up LoRA adapters: it needs --peft lora")
        return
    if lora.lora_dropout >= 1:
        raise ConfigError("--lora_dropout 1 drops every input of the adapters, which would never train: use < 1")
    if not [name for name in lora.lora_target_modules.split(",") if name.strip()]:
        raise ConfigError("--lora_target_modules is empty: give the linear layers to adapt, e.g. q,v")


def check_loss_chunks(recipe: RecipeConfig, lora: LoraConfig) -> None:
    """The chunked loss runs inside the output head (utils/loss.py), which transformers names lm_head: a LoRA
    layer there would run its own forward instead."""
    targets = [name.strip() for name in lora.lora_target_modules.split(",")]
    if recipe.loss_chunk_tokens and lora.peft == "lora" and OUTPUT_HEAD in targets:
        raise ConfigError(
            f"--loss_chunk_tokens {recipe.loss_chunk_tokens} computes the loss inside the output head "
            f"({OUTPUT_HEAD}), which --lora_target_modules would adapt: leave {OUTPUT_HEAD} out of "
            "--lora_target_modules, or give --loss_chunk_tokens 0"
        )


def check_schedule(recipe: RecipeConfig) -> None:
    """Warmup belongs to the per-step schedules, and is given one way."""
    warmup = recipe.warmup_steps or recipe.warmup_ratio
    if warmup and recipe.lr_scheduler == "step":
        raise ConfigError(
            "--warmup_steps/--warmup_ratio need a per-step schedule: --lr_scheduler constant, linear or cosine "
            "(the tutorial's step schedule changes the LR once per epoch)"
        )
    if recipe.warmup_steps and recipe.warmup_ratio:
        raise ConfigError("give --warmup_steps or --warmup_ratio, not both")


def implied_settings(config: RunConfig, given: Collection[str]) -> dict[str, tuple[object, str]]:
    """{field: (value, why)} for the settings that others decide where the user gave none (`given`: the fields set
    by a flag, a --config file, accelerate launch or a resume's record). --weight_decay under FSDP1 needs
    --use_orig_params true (check_decay_groups), which it turns on, as accelerate's default
    (fsdp_use_orig_params: true) has it; a false given stays, and is refused there."""
    train_config, fsdp_config = config.train, config.fsdp
    if not needs_orig_params(train_config, fsdp_config) or "use_orig_params" in given:
        return {}
    why = (
        f"--use_orig_params true, for --weight_decay {train_config.weight_decay:g}: FSDP1 spares the layer norms "
        "the decay only with the original parameters (accelerate's default fsdp_use_orig_params: true too)"
    )
    return {"use_orig_params": (True, why)}


def needs_orig_params(train_config: TrainConfig, fsdp_config: FSDPConfig) -> bool:
    """Weight decay skips the layer norms, which needs per-parameter optimizer groups: FSDP1 exposes the
    original parameters only with use_orig_params (its flat parameters mix norms and matrices)."""
    return bool(train_config.weight_decay) and fsdp_config.fsdp_version == 1 and not fsdp_config.use_orig_params


def check_decay_groups(train_config: TrainConfig, fsdp_config: FSDPConfig) -> None:
    """needs_orig_params, where --use_orig_params false was given (implied_settings turns it on otherwise)."""
    if needs_orig_params(train_config, fsdp_config):
        raise ConfigError(
            f"--weight_decay {train_config.weight_decay:g} decays the matrices but not the layer norms, which "
            "FSDP1 can do only with --use_orig_params true (a little more gradient memory); give it true, or "
            "use --fsdp_version 2"
        )


def check_compile(fsdp_config: FSDPConfig) -> None:
    """FSDP1 flattens parameters, which torch.compile cannot trace through, unless it keeps the originals."""
    if fsdp_config.compile and fsdp_config.fsdp_version == 1 and not fsdp_config.use_orig_params:
        raise ConfigError(
            "--compile true with FSDP1 needs --use_orig_params true (compiled blocks must see their own "
            "parameters, not FSDP1's flat ones); add it, or use --fsdp_version 2"
        )
