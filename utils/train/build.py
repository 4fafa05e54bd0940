"""One run's parts, made in the tutorial's order from its settings: the one place a run is wired.

    run = build_run(config, info)        # start -> precision -> parallelism -> spec -> data -> model -> FSDP
                                         #   -> AdamW and the LR scheduler -> the checkpoints, final models
    progress = run.checkpoints.load(run.start)
    trainer = run.trainer(run.throughput(), memory_baseline)

The entry point (T5_training.fsdp_main), the tests and the scripts call it; `parallelism=` and `spec=` replace
the ones the settings and the model would choose (a test's own, or one not in the package yet).
"""

import dataclasses
import functools
import os

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from configs import accelerate_env
from configs.errors import ConfigError
from configs.evaluation import METRIC_NAMES
from configs.run import RunConfig
from policies.mixed_precision import Precision, resolve_precision
from policies.wrapping import layer_classes
from utils.base import layout
from utils.base.log import get_logger
from utils.checkpoint.final_models import FinalModels
from utils.checkpoint.inputs import checked_inputs, checked_splits, recorded_encoding
from utils.checkpoint.manager import CheckpointManager
from utils.checkpoint.run_lock import check_writable
from utils.checkpoint.start import StartPoint, resolve_start
from utils.data.cache import resumed_encoding
from utils.data.loaders import EvalSet, Loaders, build_loaders
from utils.distributed import process_group
from utils.distributed.progress_bounded import progress_bounded
from utils.eval.evaluator import Evaluator
from utils.eval.generation import TurnEnd, turn_end
from utils.fsdp.parallelism import Parallelism, parallelism_for
from utils.loss import chunk_the_loss
from utils.model import loading, lora, neftune
from utils.observe import flops
from utils.observe.memory import MemoryBaseline
from utils.spec import ModelSpec
from utils.train import optim
from utils.train.trainer import Trainer


@dataclasses.dataclass
class Run:
    """What build_run made: each part once, handed to what uses it."""

    config: RunConfig
    info: process_group.DistInfo
    start: StartPoint  # where the run starts from (afresh, a .pt, a checkpoint)
    torchrun_job: str | None  # the torchrun job this run belongs to (its record names it)
    precision: Precision
    parallelism: Parallelism
    spec: ModelSpec
    tokenizer: object
    turn_end: TurnEnd  # where generation stops besides the EOS (--eos_token)
    loaders: Loaders
    loaded: loading.LoadedModel  # the unwrapped model as loaded, and what loading cost
    model: nn.Module  # wrapped by the parallelism
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: ShardedGradScaler | None
    checkpoints: CheckpointManager
    final_models: FinalModels

    def throughput(self) -> flops.Throughput:
        """How steps are counted in FLOPs and rated against the device's peak in the compute dtype (a GEMM probe
        on CPU). Collective."""
        config, precision = self.config, self.precision
        peak, source = flops.device_peak_flops(
            self.info.device, precision.compute_dtype, config.observe.peak_tflops, tf32=precision.tf32
        )
        model_config = self.loaded.model.config  # the unwrapped model's
        counter = self.spec.flop_counter(model_config, frozen_weights=config.lora.peft == "lora")
        if counter is None:
            get_logger().warning(
                "no MFU: the FLOPs of a %s model are not counted here (docs/models.md)", model_config.model_type
            )
        elif peak:
            get_logger().info("MFU against a peak of %.4g TFLOP/s per device (%s)", peak / 1e12, source)
        else:
            get_logger().warning("no MFU: %s", source)
        return flops.Throughput(
            counter, flops.recomputes_blocks(config.fsdp), self.info.world_size, peak, source,
            recompute_head=bool(config.recipe.loss_chunk_tokens),
        )  # fmt: skip

    @functools.cached_property
    def generation(self) -> dict:
        """generate's settings (the spec's generation_kwargs of these settings)."""
        return self.spec.generation_kwargs(self.config.evaluation, self.config.data.max_target_length)

    @functools.cached_property
    def prompt_room(self) -> int | None:
        """The most prompt tokens generation may read (ModelSpec.prompt_room): once per run, for it builds the
        model's skeleton on the meta device to tell a table of positions."""
        return self.spec.prompt_room(self.loaded.model.config, self.generation["max_new_tokens"])

    def evaluator(self, predictions_file, eval_set: EvalSet | None = None) -> Evaluator:
        """The generation evaluation of the evaluation split (or of `eval_set`), its predictions written where
        `predictions_file(split, step)` says."""
        config = self.config
        return Evaluator(
            eval_set=eval_set or self.loaders.evaluation, parallelism=self.parallelism, spec=self.spec,
            generation=self.generation, prompt_room=self.prompt_room,
            metric=config.evaluation.eval_metric, predictions_file=predictions_file, info=self.info,
            gather_for_generation=config.evaluation.gather_for_generation,
            compute_dtype=self.precision.compute_dtype, turn_end=self.turn_end,
        )  # fmt: skip

    def trainer(self, throughput: flops.Throughput, memory_baseline: MemoryBaseline) -> Trainer:
        """The training loop over these parts (after the restore, which `memory_baseline` measured)."""
        config = self.config
        predictions_file = functools.partial(layout.predictions_file, config.train.output_dir)
        evaluator = final_evaluator = None
        if self.loaders.evaluation is not None:
            evaluator = self.evaluator(predictions_file)
        if self.loaders.final is not None and self.loaders.final.evaluation is not None:
            final_evaluator = self.evaluator(predictions_file, self.loaders.final.evaluation)
        return Trainer(
            model=self.model, parallelism=self.parallelism, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=self.scaler, loaders=self.loaders, checkpoints=self.checkpoints, final_models=self.final_models,
            evaluator=evaluator, final_evaluator=final_evaluator, info=self.info, train=config.train,
            recipe=config.recipe, evaluation=config.evaluation, observe=config.observe, throughput=throughput,
            memory_baseline=memory_baseline, spec=self.spec,
            recomputes=config.fsdp.fsdp_activation_checkpointing or bool(config.recipe.loss_chunk_tokens),
        )  # fmt: skip


def build_run(
    config: RunConfig,
    info: process_group.DistInfo,
    *,
    parallelism: Parallelism | None = None,
    spec: ModelSpec | None = None,
) -> Run:
    """The run's parts, in the tutorial's order (collective: every rank builds its own). `parallelism` and
    `spec`: instead of the ones the settings and the model choose."""
    train, recipe, evaluation = config.train, config.recipe, config.evaluation
    torch.manual_seed(train.seed)
    # Every folder of output_dir the run will write, probed on every rank before anything is read or moved: a
    # read-only checkpoints/ is said now, not at the first save after training.
    saves_checkpoints = config.checkpointing.keep_last_n > 0
    check_writable(train.output_dir, evaluating=evaluation.evaluate_only, saves_checkpoints=saves_checkpoints)
    # Where the run starts from (afresh, a .pt, a checkpoint folder): rank 0 looks at output_dir once, every
    # rank checks the checkpoint's files. A torchrun restart of this run continues from its newest intact
    # checkpoint (utils/checkpoint/start.py).
    job, attempt = process_group.torchrun_attempt()
    attempt = process_group.group_attempt(attempt, info.device)
    # --evaluate_only changes nothing of a run: it refuses a damaged checkpoint instead of setting it aside.
    start = resolve_start(
        config.checkpointing.resume, train.output_dir, job, attempt, not evaluation.evaluate_only
    )
    # What the run reads (its data files, the model folder's config and tokenizer), fingerprinted for its
    # checkpoints; a resume on changed ones is refused here, before anything loads (utils/checkpoint/inputs.py).
    # --evaluate_only changes nothing of a run, and may score any data.
    inputs = None
    if not evaluation.evaluate_only:
        inputs = checked_inputs(
            start, data=config.data, model_name=train.model_name, lora=config.lora.peft == "lora",
            accept_changed=config.checkpointing.accept_changed_inputs,
        )  # fmt: skip
    precision = resolve_precision(
        config.fsdp, info.device, functools.partial(process_group.any_rank, device=info.device)
    )
    if precision.fallback:
        get_logger().info("%s", precision.fallback)
    precision.set_matmul_precision()
    # How the model is spread over the ranks (FSDP1, the tutorial's; FSDP2; or one rank unwrapped): chosen
    # once; loading, the step, generation and the checkpoints ask it (utils/fsdp/parallelism.py).
    parallelism = parallelism or parallelism_for(config.fsdp, info.world_size)

    # The model's config, checked (a model this package cannot train stops the run here), and its spec
    # (utils/spec.py): what this kind of model trains on and is scored by. Its Dataset is read here; the
    # tokenizer, the model, the step, the trainer, evaluation, the FLOP count and the export ask it from here on.
    evaluating = evaluation.evaluate_only
    checked_config, chosen_spec = loading.run_model_config(train.model_name, evaluating=evaluating)
    spec = spec or chosen_spec
    spec.check_data(config.data, checked_config)  # what only some models read (--packing: a decoder-only one)
    # --max_seq_len within the model's positions (a decoder-only model's); the run and its record read this
    data = spec.fitted_data(config.data, checked_config, resumed=start.is_checkpoint)
    config = dataclasses.replace(config, data=data)
    # A resume reads its rows as its run tokenised them (recorded by its checkpoints), so that its data position
    # stays exact: a run started before decoder-only rows were bounded by --max_seq_len keeps its bounds.
    encoding = None
    if start.is_checkpoint:
        encoding = resumed_encoding(recorded_encoding(start), spec.data_format.dataset_type.encoding)
    # Datasets and loaders (the spec's Dataset and collate; the tutorial's, summarization_dataset.py): the data
    # is read and checked before the model loads, so a data error costs seconds, not the minutes of loading a
    # large model.
    # A node that builds its data cache (utils/data/shared_cache.py) is waited for by its progress, not
    # --dist_timeout_s: the other nodes may have theirs already.
    tokenizer = loading.load_tokenizer(train.model_name, evaluating=evaluating, config=checked_config, spec=spec)
    turn = turn_end(tokenizer, config.data.eos_token, train.model_name)  # a text it cannot write: refused now
    with progress_bounded("data loading"):
        loaders = build_loaders(
            tokenizer=tokenizer, data_format=spec.data_format, data=config.data, train=train,
            evaluation=evaluation, info=info, encoding=encoding,
        )  # fmt: skip
    log_evaluation_plan(config, loaders)
    if inputs is not None:  # how its rows were tokenised and which splits it reads, which a resume keeps
        inputs = checked_splits(start, {**inputs, "encoding": loaders.encoding.version}, loaders.plan.record())

    # The model: pretrained weights (a skeleton on the meta device where rank-0-only loading fills it
    # later, or where a checkpoint does), the weights of a .pt, and LoRA adapters. Where rank 0 alone reads
    # them, the others wait for as long as it makes progress, not --dist_timeout_s.
    with progress_bounded("model loading"):
        loaded = build_model(config, info, start, tokenizer, parallelism, spec)
    log_layer_classes_of_accelerate(loaded.model)
    model_config = loaded.model.config
    # Checkpoints and hf_model/ carry how to summarise with this model (scripts/summarize.py reads it).
    model_config.task_specific_params = {
        **(getattr(model_config, "task_specific_params", None) or {}),
        spec.params_key: spec.saved_params(config.data, evaluation, loaders.cleaning),
    }

    # FSDP: FullyShardedDataParallel (--fsdp_version 1, the tutorial's) or fully_shard (2).
    model = parallelism.wrap(
        loaded.model, precision=precision, device=info.device, weights_source=loaded.weights_source,
        restores=start.is_checkpoint,
    )  # fmt: skip
    parallelism.describe(model, precision)

    # AdamW and the LR scheduler, built after sharding: the optimizer must hold FSDP's sharded parameters.
    # fp16 needs a gradient scaler; the sharded one agrees on inf/NaN across ranks, so all skip the same steps.
    scaler = ShardedGradScaler(device=info.device.type) if precision.needs_grad_scaler else None
    fused = optim.uses_fused_adamw(info.device.type, recipe.on_nonfinite, has_grad_scaler=scaler is not None)
    optimizer = torch.optim.AdamW(optim.parameter_groups(model, train.weight_decay), lr=train.lr, fused=fused)
    batches_per_epoch = len(loaders.train) if loaders.train is not None else 1  # --evaluate_only trains none
    total_steps = optim.total_optimizer_steps(recipe, train.epochs, batches_per_epoch)
    scheduler = optim.lr_scheduler(optimizer, train.gamma, recipe, total_steps)

    # The checkpoint manager owns every resumable save and load; it restores where the run starts from, and is
    # closed however the run ends (a background save still being written is finished, or said to be abandoned).
    # The final models (the --save_model .pt, hf_model/) are written from the same model.
    checkpoints = CheckpointManager(
        checkpointing=config.checkpointing, fsdp=config.fsdp, output_dir=train.output_dir, model=model,
        parallelism=parallelism, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
        model_config=model_config, tokenizer=tokenizer, info=info, inputs=inputs,
    )  # fmt: skip
    base_model = lora.adapter_base(train.model_name)  # what a LoRA adapter names as its base
    final_models = FinalModels(
        checkpoints, spec=spec, lora=config.lora, base_model=base_model,
        whole_texts=bool(config.data.dataset_text_field),
    )  # fmt: skip
    return Run(
        config=config, info=info, start=start, torchrun_job=job, precision=precision, parallelism=parallelism,
        spec=spec, tokenizer=tokenizer, turn_end=turn, loaders=loaders, loaded=loaded, model=model,
        optimizer=optimizer, scheduler=scheduler, scaler=scaler, checkpoints=checkpoints,
        final_models=final_models,
    )  # fmt: skip


def log_evaluation_plan(config: RunConfig, loaders: Loaders) -> None:
    """One line saying what is evaluated (the split, the rows generation will really score), and which setting
    switches what off; one more where a split is scored once after training."""
    train, evaluation = config.train, config.evaluation
    if evaluation.evaluate_only:
        return
    if not train.run_validation:
        get_logger().info(
            "evaluation: none (--run_validation false switches off the validation loss and generation)"
        )
        return
    metric = METRIC_NAMES[evaluation.eval_metric]

    def scores(eval_set, switch: str = " (--eval_rouge false switches it off)") -> str:
        if eval_set is not None:
            return f"{metric} of {len(eval_set.dataset)} generated outputs{switch}"
        if config.data.dataset_text_field:
            return f"perplexity, no {metric} (--dataset_text_field: whole texts have no reference to score)"
        return f"no {metric} (--eval_rouge false)"

    when = "after each epoch"
    if evaluation.eval_every_n_steps:
        when += f" and every {evaluation.eval_every_n_steps} steps"
    split, plan = loaders.plan.evaluation, loaders.plan
    if split != "validation":
        when += f" on the {split} split (--eval_split {split}: it chooses the best model; val_loss is its loss)"
    get_logger().info(
        "evaluation %s: %s loss and %s; --run_validation false switches all evaluation off",
        when, split, scores(loaders.evaluation),
    )  # fmt: skip
    if loaders.final is not None:
        get_logger().info(
            "evaluation after training: the %s split's loss and %s, once, by the last step's model "
            "(hf_model_last/ where an earlier epoch was the best; --eval_split auto: the data has no validation "
            "split of its own, so the %d rows held out of train choose the best model; --eval_split %s evaluates "
            "on it instead)",
            plan.final, scores(loaders.final.evaluation, switch=""), plan.held_out_rows, plan.final,
        )  # fmt: skip


def log_layer_classes_of_accelerate(model: nn.Module) -> None:
    """One line where accelerate launch's config names other layer classes than the model's own, which are the
    units (configs/accelerate_env.py checks the name, and does not use it)."""
    named = accelerate_env.layer_classes_named(os.environ)
    own = sorted(cls.__name__ for cls in layer_classes(model))
    if named and sorted(name.lower() for name in named) != [name.lower() for name in own]:  # checked so too
        get_logger().info(
            "accelerate's fsdp_transformer_layer_cls_to_wrap names %s; this %s's layers are %s, and those are "
            "the FSDP units (the config's value is checked, not used)",
            ", ".join(named), type(model).__name__, ", ".join(own),
        )  # fmt: skip


def build_model(
    config: RunConfig,
    info: process_group.DistInfo,
    start: StartPoint,
    tokenizer,
    parallelism: Parallelism,
    spec: ModelSpec,
) -> loading.LoadedModel:
    """The unwrapped model: pretrained (or a skeleton for rank-0-only loading), with the weights a .pt or a
    full checkpoint brings, and LoRA adapters. A LoRA run's own .pt (adapters included) is loaded after the
    adapters are added."""
    train, lora_config = config.train, config.lora
    uses_lora = lora_config.peft == "lora"
    restores = start.is_checkpoint
    on_meta = parallelism.builds_on_meta(info.is_main, restores)
    weights_file = start.weights_file
    adapter_weights = weights_file if uses_lora and weights_file and lora.holds_adapters(weights_file) else None
    plain_pt = weights_file and not adapter_weights  # a plain model's .pt file
    if uses_lora and plain_pt and not lora_config.merge_lora:
        raise ConfigError(
            f"--peft lora from the weights of {start.path}: the adapter would name {train.model_name} as its "
            "base, whose weights differ. Add --merge_lora true (the merged hf_model/ stands alone)."
        )
    overrides = loading.model_config_overrides(config.recipe)
    weights = None if adapter_weights else weights_file
    evaluated_adapter = loading.evaluated_model(train.model_name, config.evaluation.evaluate_only)[1]
    if evaluated_adapter and (restores or weights_file):
        raise ConfigError(
            f"--model_name {train.model_name} is a LoRA adapter to evaluate, and --resume names weights too "
            f"({start.path}): give one. --resume false scores the adapter merged into its base."
        )
    if evaluated_adapter and parallelism.fills_units_from_files:
        raise ConfigError(
            f"--model_name {train.model_name} is a LoRA adapter, merged into its base in memory; FSDP1's "
            "rank-0-only loading fills each unit from the model's files instead. Add --cpu_ram_efficient_loading "
            "false, or --fsdp_version 2 (rank 0 merges, then broadcasts)."
        )
    loaded = loading.load_model_for_run(
        train.model_name, on_meta, weights, overrides, tokenizer, evaluating=config.evaluation.evaluate_only,
        rank0_fills=parallelism.fills_units_from_files and not restores,
    )  # fmt: skip
    if uses_lora:
        # FSDP1's rank-0-only loading fills a LoRA run's .pt adapters too, read by name as the base weights are.
        adapters_read = bool(adapter_weights) and parallelism.fills_units_from_files and not restores
        loaded.model = lora.apply_lora(
            loaded.model, lora_config, lora.adapter_base(train.model_name), spec, adapters_on_meta=adapters_read
        )
        if adapters_read:
            loaded.weights_source = adapter_weights
        trainable, total = lora.trainable_share(loaded.model)
        targets = ",".join(lora.target_modules(lora_config, loaded.model))
        get_logger().info(
            "LoRA r=%d alpha=%d on %s: %d of %d parameters train (%.2f%%)",
            lora_config.lora_r, lora_config.lora_alpha, targets, trainable, total, 100 * trainable / total,
        )  # fmt: skip
        if adapter_weights and not on_meta:
            loading.load_full_model_weights(loaded.model, adapter_weights)
        loaded.param_numel_total = total
    alpha = config.recipe.neftune_noise_alpha
    # On the unwrapped model (LoRA's base): FSDP keeps the embedding modules it hooks. It noises training alone.
    if alpha and not config.evaluation.evaluate_only:
        hooked = neftune.add_embedding_noise(loaded.model, alpha, spec)
        get_logger().info("NEFTune: noise of alpha %g on the input embeddings while training (%s)", alpha,
                          ", ".join(hooked))  # fmt: skip
    chunk_tokens = config.recipe.loss_chunk_tokens
    # Before FSDP, which gathers the head's weight only in its unit's forward: the chunked loss runs there.
    if chunk_tokens:
        chunk_the_loss(loaded.model, chunk_tokens)
        get_logger().info(
            "the loss: cross-entropy per chunk of %d tokens inside the output head, never the whole logits; "
            "backward computes each chunk's logits again", chunk_tokens,
        )  # fmt: skip
    return loaded
