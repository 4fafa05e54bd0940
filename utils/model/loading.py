"""The model and tokenizer of a run, from a hub name (t5-small ... t5-11b, google/mt5-base,
facebook/bart-large-cnn, meta-llama/Llama-2-7b-hf) or a local folder: any encoder-decoder that
AutoModelForSeq2SeqLM, or decoder-only model that AutoModelForCausalLM, loads with AutoTokenizer (the model
spec, utils/spec.py, says which; docs/models.md).

Where the model comes from is decided before anything is read (resolved_name): a folder that exists; a path
that cannot be a hub id (absolute, ./, ../, ~, two or more '/', a trailing '/'), which must exist; else a
hub id, which rank 0 looks up once with one request and no retries. Where the hub cannot be reached, the HF
cache's copy is read as HF_HUB_OFFLINE=1 would, and without one the run stops in seconds with the offline
fixes, instead of huggingface_hub's minutes of retries. A name that is neither a folder nor on the hub, but
close to a model folder that exists ('output/hf_model' for 'outputs/hf_model'), says "no such folder".

A checkpoint is taken only whole: a model of neither kind (an encoder only), a config.json whose architecture is
another family's than its model_type, a tokenizer that does not fit the model (check_tokenizer: more tokens
than embeddings, other special tokens, or no vocabulary at all), and weights missing from the checkpoint (the
model would train partly from a random initialisation) each stop the run with one message before anything
is trained or cached. Weights the model does not use get one warning naming them.

With rank-0-only loading (--cpu_ram_efficient_loading) some or all ranks build only a skeleton on the
meta device, which allocates nothing; utils/model/rank0_loading.py fills it with rank 0's weights while or
after it is sharded. A run that resumes a checkpoint builds the skeleton on every rank: the checkpoint fills
the shards (utils/checkpoint/manager.py), so the pretrained weights are never read. A run started from a
full-model .pt (--resume file.pt) takes its weights from that file instead of the pretrained ones.
"""

import contextlib
import copy
import functools
import json
import os
import zipfile
from dataclasses import dataclass

import torch
import transformers
from safetensors import safe_open
from torch import nn
from transformers import (
    AutoConfig,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)
from transformers.utils import cached_file

from configs.errors import FAILURES, CheckpointError, ConfigError, error_summary
from configs.recipe import RecipeConfig
from utils.base import layout
from utils.base.log import get_logger
from utils.distributed.process_group import is_rank0, rank0_decides
from utils.model import t5_attention
from utils.model.source import (
    HUB_HINT,
    check_local_model_dir,
    hub_model_source,
    is_adapter_folder,
    looks_like_local_path,
)
from utils.observe.memory import MemoryBaseline, current_rss_bytes, peak_rss_bytes, reset_peak_rss
from utils.spec import ModelSpec, spec_for

PROBE_TEXT = "hello world how are you"  # any vocabulary of a text model has these words (or their letters)
MAX_KEYS_NAMED = 8  # a message names this many weights, then counts the rest
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
WEIGHT_FILES = (INDEX_FILE, SINGLE_FILE, "pytorch_model.bin.index.json", "pytorch_model.bin")


@dataclass
class LoadedModel:
    model: nn.Module  # unwrapped; on the meta device where rank-0-only loading leaves it empty
    tokenizer: PreTrainedTokenizerBase
    weights_source: str  # where rank-0-only loading reads the weights: the model, or a full .pt
    param_numel_total: int  # the model's parameters, tied weights once
    rss_before: int  # this rank's resident memory before the model was built (the peak was reset there)

    def memory_baseline(self) -> MemoryBaseline:
        """Call once the model is sharded (and a resumed checkpoint restored): this rank's RSS high-water mark
        since before the model was built, over the RSS then. Loading is not measured around from_pretrained
        alone, because transformers 5 memory-maps safetensors and the weights become resident only when FSDP
        copies and shards them."""
        return MemoryBaseline(peak_rss_bytes() - self.rss_before, self.param_numel_total)


def model_config_overrides(recipe: RecipeConfig) -> dict:
    """The model-config fields the run sets: the attention kernel, and the dropout if given (by --dropout_rate,
    T5's name; load_model gives it the family's own, e.g. BART's `dropout`)."""
    overrides = {"attn_implementation": recipe.attn_implementation}
    return overrides if recipe.dropout_rate is None else {**overrides, "dropout_rate": recipe.dropout_rate}


# The dropouts of the families whose config has no `dropout_rate`, one per place: BART's three, Llama's one
# (attention_dropout), GPT-2's three.
DROPOUTS = ("dropout", "attention_dropout", "activation_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")


def family_overrides(config: PretrainedConfig, overrides: dict) -> dict:
    """`overrides` with the dropout under this family's field names: T5's family has one, `dropout_rate`;
    BART's, Llama's and GPT-2's their own (DROPOUTS), each set to it."""
    if "dropout_rate" not in overrides or hasattr(config, "dropout_rate"):
        return overrides
    overrides = dict(overrides)
    rate = overrides.pop("dropout_rate")
    return {**overrides, **{name: rate for name in DROPOUTS if hasattr(config, name)}}


def load_model_for_run(
    model_name: str,
    on_meta: bool,
    weights_file: str | None,
    overrides: dict,
    tokenizer: PreTrainedTokenizerBase,
    evaluating: bool = False,
    rank0_fills: bool = False,
) -> LoadedModel:
    """The unwrapped model, with the weights of `weights_file` (a full .pt) if given, and the model-config
    `overrides` (model_config_overrides); `tokenizer` (load_tokenizer, loaded once per run) goes with it.
    `evaluating` (--evaluate_only): an adapter folder is its base with the adapter merged in (evaluated_model).
    `rank0_fills`: FSDP1's rank-0-only loading, whose rank 0 reads the pretrained weights into the skeleton unit
    by unit while it is sharded; rank 0 checks their shapes here, before (check_weights_fit)."""
    reset_peak_rss()
    rss_before = current_rss_bytes()
    base, adapter = evaluated_model(model_name, evaluating)
    model = load_model(base, on_meta=on_meta, **overrides)
    if rank0_fills and weights_file is None and is_rank0():
        check_weights_fit(resolved_name(base), model)
    if overrides.get("attn_implementation") == t5_attention.NAME:
        t5_attention.fuse_norms(model)  # before LoRA and sharding, so every rank's model has the same modules
    if adapter and not on_meta:  # a skeleton is the base's shape; rank 0's merged weights fill it
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, os.path.expanduser(adapter)).merge_and_unload()
        model.requires_grad_(True)  # PEFT froze the base; every rank's model must be alike (load_model's skeleton)
    merged = f" (a LoRA adapter, merged into its base {base})" if adapter else ""
    get_logger().info(
        "model %s%s: %.2fM parameters, vocab %d",
        model_name, merged, sum(p.numel() for p in model.parameters()) / 1e6, len(tokenizer),
    )  # fmt: skip
    if weights_file is not None and not on_meta:
        # A full state dict goes into the unwrapped model; FSDP then shards it (the tutorial's way).
        load_full_model_weights(model, weights_file)
    numel = sum(p.numel() for p in model.parameters())
    return LoadedModel(model, tokenizer, weights_file or model_name, numel, rss_before)


def resolved_name(model_name: str) -> str:
    """What from_pretrained reads: a local folder, checked and expanded (a mistyped path fails here, not as a
    hub lookup); else a hub id as is, or its HF cache copy where the hub cannot be reached (hub_source)."""
    if looks_like_local_path(model_name):
        check_local_model_dir(model_name)
        return os.path.expanduser(model_name)
    return hub_source(model_name)


@functools.cache  # one lookup per process: every later read of the model (config, weights) takes its answer
def hub_source(model_id: str) -> str:
    """A hub id as from_pretrained should read it, decided by rank 0 for every rank (collective the first time
    for an id: load_tokenizer, which every rank calls at the same point, is the first reader of the model)."""
    return rank0_decides(lambda: hub_model_source(model_id))


def adapter_base_of(folder: str) -> str | None:
    """The base model a --peft lora run's adapter folder (is_adapter_folder) names in adapter_config.json; None
    for any other."""
    if not looks_like_local_path(folder) or not is_adapter_folder(folder):
        return None
    path = os.path.join(os.path.expanduser(folder), layout.ADAPTER_CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            base = json.load(f).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{path} cannot be read as PEFT's adapter config: {err}") from None
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path} names no base model (base_model_name_or_path): set it to the base's folder")
    return base


def evaluated_model(model_name: str, evaluating: bool) -> tuple[str, str | None]:
    """(the model to load, the adapter folder to merge into it or None). A --peft lora run's adapter folder
    given to --evaluate_only is its base with the adapter merged in, as scripts/summarize.py reads it; to
    train, it stays refused (check_local_model_dir says what to give instead)."""
    base = adapter_base_of(model_name) if evaluating else None
    return (model_name, None) if base is None else (base, model_name)


def base_config(folder: str, base: str) -> tuple[PretrainedConfig, ModelSpec]:
    """The config and spec of the base an adapter folder names (load_model_config), or a ConfigError that says
    where the name comes from."""
    try:
        return load_model_config(base)
    except ConfigError as err:
        raise ConfigError(
            f"the base model {folder}/{layout.ADAPTER_CONFIG_FILE} names cannot be loaded ({err}); a folder moved "
            "from another machine: set base_model_name_or_path there to the base's folder here"
        ) from None


def load_adapter_model(folder: str) -> tuple[nn.Module, PreTrainedTokenizerBase, str, ModelSpec]:
    """A --peft lora run's adapter folder as a model for generation: its base (checked as --model_name is)
    with the adapter merged in through PEFT, the run's generation and summarization settings, and the
    tokenizer saved with it (checked against the base); and the base's name and spec."""
    from peft import PeftModel

    base = adapter_base_of(folder)
    local = os.path.expanduser(folder)
    config, spec = base_config(folder, base)
    tokenizer = AutoTokenizer.from_pretrained(local)
    check_tokenizer(folder, tokenizer, config, spec)
    check_weights_fit(resolved_name(base), skeleton(config, spec))
    model = spec.model_class.from_pretrained(resolved_name(base), dtype=torch.float32)
    model = PeftModel.from_pretrained(model, local).merge_and_unload()
    settings = os.path.join(local, layout.ADAPTER_SUMMARIZATION_FILE)
    if os.path.isfile(settings):
        with open(settings, encoding="utf-8") as f:
            params = getattr(model.config, "task_specific_params", None) or {}
            model.config.task_specific_params = {**params, spec.params_key: json.load(f)}
        model.generation_config = GenerationConfig.from_pretrained(local)
    else:  # written by an earlier version, which kept the run's settings in the merged model alone
        get_logger().warning(
            "%s holds no %s: summarising with the base model's own settings, not the run's", folder,
            layout.ADAPTER_SUMMARIZATION_FILE,
        )  # fmt: skip
    return model, tokenizer, base, spec


def load_tokenizer(
    model_name: str,
    evaluating: bool = False,
    config: PretrainedConfig | None = None,
    spec: ModelSpec | None = None,
) -> PreTrainedTokenizerBase:
    """The model's tokenizer alone (seconds), so the data can be read and checked before the model loads. The
    model's config is checked first (load_model_config), and the tokenizer against it (check_tokenizer): a
    model this package cannot train, or a tokenizer that does not fit it, stops the run before any data is
    read or cached. Collective for a hub name the first time (rank 0 looks it up: hub_source). `evaluating`:
    an adapter folder's own tokenizer, checked against its base's config (evaluated_model). `config`, `spec`:
    that checked config and its spec (run_model_config), where the caller has them already."""
    if config is None:
        config, spec = run_model_config(model_name, evaluating)
    _, adapter = evaluated_model(model_name, evaluating)
    model_name = os.path.expanduser(adapter) if adapter else resolved_name(model_name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"could not load the tokenizer of {model_name!r}: {str(err).rstrip('.')}. {HUB_HINT}"
        ) from None
    if spec.pads_by_length and tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # Llama's and GPT-2's tokenizers have no padding token. Padding is masked by length everywhere
        # (causal_lm_dataset.py), so the EOS token serves, and a completion's own EOS stays in its labels.
        tokenizer.pad_token = tokenizer.eos_token
        get_logger().info("the tokenizer has no padding token: padding with its EOS token %r", tokenizer.eos_token)
    check_tokenizer(model_name, tokenizer, config, spec)
    return tokenizer


def run_model_config(model_name: str, evaluating: bool = False) -> tuple[PretrainedConfig, ModelSpec]:
    """The checked config and the spec (load_model_config) of the model a run trains, or with `evaluating`
    evaluates (an adapter folder: its base's, evaluated_model)."""
    base, adapter = evaluated_model(model_name, evaluating)
    return base_config(adapter, base) if adapter else load_model_config(model_name)


def check_tokenizer(
    model_name: str, tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig, spec: ModelSpec
) -> None:
    """ConfigError unless the tokenizer fits the model: no more tokens than the embedding has rows (T5's
    embedding is padded beyond its tokenizer, so fewer is fine), the padding and end-of-sequence tokens the
    model's config names, the decoder's start token among its tokens, and a vocabulary that knows plain words.
    A folder (or HF cache entry) with a config.json but no tokenizer files gets, from transformers, a
    tokenizer of special tokens alone (T5: 104), which turns every word into <unk> without an error."""
    size = len(tokenizer)
    problems = []
    if size > config.vocab_size:
        problems.append(
            f"it has more tokens than the model has embeddings: ids {config.vocab_size} to {size - 1} would "
            "index past the embedding (tokens added to it, chat markers say, need the embedding resized: "
            "model.resize_token_embeddings(len(tokenizer)), then save both)"
        )
    for role, what in (("pad", "padding"), ("eos", "end-of-sequence")):
        own, models = getattr(tokenizer, f"{role}_token_id"), getattr(config, f"{role}_token_id", None)
        if role == "pad" and spec.pads_by_length:
            models = None  # a decoder-only model never reads padding: it is masked by length (EOS may pad)
        if own is None:
            problems.append(f"it has no {what} token")
        elif isinstance(models, int) and own != models:
            problems.append(f"its {what} token is id {own}, the model's {role}_token_id is {models}")
    start = config.decoder_start_token_id if spec.reads_decoder_start else None
    if start is not None and start >= size:
        problems.append(f"the model's decoder_start_token_id {start} is not one of its ids")
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False).input_ids
    if not set(tokenizer.decode(ids, skip_special_tokens=True).split()) & set(PROBE_TEXT.split()):
        tokens = " ".join(tokenizer.convert_ids_to_tokens(ids))
        problems.append(f"it knows no word of {PROBE_TEXT!r} ({tokens}): its vocabulary is missing")
    if problems:
        files = ", ".join(getattr(tokenizer, "vocab_files_names", {}).values())
        raise ConfigError(
            f"the tokenizer of {model_name!r} ({type(tokenizer).__name__}, {size} tokens) does not fit the model "
            f"({config.model_type}, vocab_size {config.vocab_size}): {'; '.join(problems)}. Put the tokenizer "
            f"the model was trained with beside its config.json (tokenizer.save_pretrained(folder) writes "
            f"{files or 'its files'}), or download the model whole."
        )


def load_model_config(model_name: str, **config_overrides) -> tuple[PretrainedConfig, ModelSpec]:
    """The model's config, checked to be of a kind this package trains (its spec, utils/spec.py: spec_for) and
    of an architecture that is its model_type's, with
    `config_overrides` (model_config_overrides) set. The KV cache is off: it only serves generation, and with
    activation checkpointing it breaks recomputation ("a different number of tensors was saved",
    docs/pitfalls.md #4). It must be off at load time: the encoder and decoder stacks keep their own copies of
    the config."""
    model_name = resolved_name(model_name)
    try:
        config = AutoConfig.from_pretrained(model_name)
    except (OSError, ValueError) as err:
        raise ConfigError(f"could not load model {model_name!r}: {str(err).rstrip('.')}. {HUB_HINT}") from None
    spec = spec_for(config, model_name)  # a model of another kind is refused here
    check_attention_fits(config, spec, config_overrides.get("attn_implementation"))
    if spec.reads_decoder_start and config.decoder_start_token_id is None:
        raise ConfigError(
            f"model {model_name!r} ({config.model_type}) has no decoder_start_token_id in its config.json: "
            "training needs the token its decoder starts from (mBART: the target language's id). Set it there."
        )
    config = AutoConfig.from_pretrained(model_name, use_cache=False, **family_overrides(config, config_overrides))
    if config_overrides.get("attn_implementation") == t5_attention.NAME and config.dropout_rate > 0:
        get_logger().info(
            "%s with dropout_rate %g: training's self-attention takes SDPA's float-mask path (FlexAttention has "
            "no attention dropout); --dropout_rate 0 runs FlexAttention on GPUs",
            t5_attention.NAME, config.dropout_rate,
        )  # fmt: skip
    return config, spec


# The class attribute by which transformers says a model class has the kernel (it raises at load otherwise)
KERNEL_SUPPORT = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}


def check_attention_fits(config: PretrainedConfig, spec: ModelSpec, attn_implementation: str | None) -> None:
    """ConfigError where the kernel does not fit the family; `t5_flex` made a name transformers knows."""
    if attn_implementation is None:
        return
    t5_attention.validate_family(config.model_type, attn_implementation)
    model_class = spec.model_mapping[type(config)]
    flag = KERNEL_SUPPORT.get(attn_implementation)
    if flag is not None and not getattr(model_class, flag, False):
        instead = "sdpa (the default)" if getattr(model_class, KERNEL_SUPPORT["sdpa"], False) else "eager"
        raise ConfigError(
            f"--attn_implementation {attn_implementation}: transformers {transformers.__version__} has no "
            f"{attn_implementation} kernel for {model_class.__name__}. Use {instead}."
        )
    if attn_implementation == t5_attention.NAME:
        t5_attention.register()


def load_model(model_name: str, on_meta: bool = False, **config_overrides) -> nn.Module:
    """The pretrained model (its spec's class: AutoModelForSeq2SeqLM, AutoModelForCausalLM) in host memory, or
    (on_meta) only its skeleton
    on the meta device; `config_overrides` replace fields of its config (dropout, attn_implementation).
    ConfigError when the checkpoint lacks weights of the model: it would train partly from random ones."""
    config, spec = load_model_config(model_name, **config_overrides)
    model_name = resolved_name(model_name)
    if on_meta:
        model = skeleton(config, spec)
        if forces_tie(config) and holds_own_head(model_name, model):
            config.tie_word_embeddings = False  # as skeleton() builds it from now on (the export's tied names)
            untie_head(model)
        # As from_pretrained returns it, every weight trainable: built from a config, PEGASUS's sinusoidal
        # position table is frozen, and one frozen weight makes FSDP1 wrap every module apart, as LoRA's
        # adapters (policies/wrapping.py), so a restored run would have other units than the one it continues.
        model.requires_grad_(True)
        return model
    # transformers' own check ends in a traceback on every rank
    check_weights_fit(model_name, skeleton(config, spec))
    try:
        # In fp32 whatever the config's dtype says (Llama's bf16, Llama 2's fp16: transformers 5 loads in it):
        # FSDP shards and AdamW updates fp32 master weights; --mixed_precision computes in bf16.
        model, info = spec.model_class.from_pretrained(
            model_name, config=config, output_loading_info=True, dtype=torch.float32
        )
    except OSError as err:
        raise ConfigError(f"could not load model {model_name!r}: {str(err).rstrip('.')}. {HUB_HINT}") from None
    if info["missing_keys"] or info["mismatched_keys"]:
        mismatched = [name for name, *_ in info["mismatched_keys"]]
        raise ConfigError(
            f"model {model_name!r} lacks weights of its {type(model).__name__}: "
            f"{named_keys(sorted(info['missing_keys']) + mismatched)} are missing or of another shape. It "
            "would train them from a random initialisation. Is the folder complete and saved by this family's "
            "class (config.json's model_type)?"
        )
    if forces_tie(config) and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        model.config.tie_word_embeddings = False  # as loaded; checkpoints and the export record it (skeleton)
    if info["unexpected_keys"]:
        get_logger().warning(
            "model %s: the checkpoint holds weights its %s does not use, left out: %s",
            model_name, type(model).__name__, named_keys(sorted(info["unexpected_keys"])),
        )  # fmt: skip
    return model


def skeleton(config: PretrainedConfig, spec: ModelSpec) -> nn.Module:
    """The model of `config` (`spec`'s class of it) on the meta device: its parameters' names, shapes and ties,
    no memory, as from_pretrained would build it. For the T5 family (whose config class forces the tie,
    docs/pitfalls.md #32) tie_word_embeddings False unties the lm_head only: built so, T5 would also untie its
    embed_tokens from `shared`, which no T5 checkpoint does. Its non-persistent buffers (RoPE's inv_freq) are
    computed, in host memory: no checkpoint or weights file holds them, so nothing would fill them
    (computed_buffers)."""
    untie = forces_tie(config) and not config.tie_word_embeddings
    if untie:
        config = copy.deepcopy(config)
        config.tie_word_embeddings = True
    with weights_on_meta():
        model = spec.model_class.from_config(config, dtype=torch.float32)  # as load_model's
    if untie:
        untie_head(model)
    return model


@contextlib.contextmanager
def weights_on_meta():
    """Inside, the models built have their parameters and persistent buffers on the meta device (what a weights
    file or a checkpoint fills) and their non-persistent buffers computed in host memory. Each parameter is
    moved to meta as its module registers it, before the module initialises it: building costs an allocation
    per parameter (untouched pages), not its initialisation."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        with _persistent_buffers_on_meta():
            yield
    finally:
        nn.Module.register_parameter = register


@contextlib.contextmanager
def _persistent_buffers_on_meta():
    """Inside, a persistent buffer a module registers goes to the meta device (BART's final_logits_bias: a
    weights file holds it); a non-persistent one stays where it was computed."""
    register = nn.Module.register_buffer

    def register_on_meta(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True):
        on_meta = tensor is not None and persistent and not tensor.is_meta
        register(module, name, tensor.to("meta") if on_meta else tensor, persistent)

    nn.Module.register_buffer = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_buffer = register


def computed_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's non-persistent buffers that are not on the meta device (RoPE's inv_freq), by name: to put
    back after `to_empty`, which leaves every tensor uninitialised (utils/model/rank0_loading.py)."""
    kept = {}
    for prefix, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None and not buffer.is_meta:
                kept[f"{prefix}.{name}" if prefix else name] = buffer.clone()
    return kept


def forces_tie(config: PretrainedConfig) -> bool:
    """Whether transformers' config class reads every config as tied (T5, mT5, UMT5 in transformers 5),
    whatever tie_word_embeddings says: its untied checkpoints are told apart by their weights instead."""
    try:
        return type(config)(tie_word_embeddings=False).tie_word_embeddings
    except (TypeError, ValueError):  # a config that needs more to build (encoder-decoder): honours the flag
        return False


def saved_config(folder: str) -> PretrainedConfig:
    """The config a checkpoint or an export saved, with its tie_word_embeddings as written: transformers 5
    reads every T5-family config as tied (docs/pitfalls.md #32), where T5 v1.1, flan-t5, mT5 and UMT5 hold
    an lm_head of their own."""
    config = AutoConfig.from_pretrained(folder)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config.tie_word_embeddings = json.load(f).get("tie_word_embeddings", True)
    return config


def holds_own_head(model_name: str, model: nn.Module) -> bool:
    """Whether the checkpoint has an lm_head of its own though the model ties it to the embedding: T5 v1.1,
    flan-t5, mT5 and UMT5 do, and transformers 5 builds every T5 tied (docs/pitfalls.md #32), untying when it
    loads both weights and they differ. A skeleton must be untied the same way (tie_word_embeddings False), or
    the two would share one tensor. Read from the checkpoint's weight names, not its weights: a checkpoint
    that stores an lm_head equal to its embedding (which transformers ties) is taken as untied."""
    head = model.get_output_embeddings()
    if head is None or head.weight is not model.get_input_embeddings().weight:
        return False
    head_name = next(name for name, module in model.named_modules() if module is head) + ".weight"
    return head_name in checkpoint_weight_names(model_name)


def checkpoint_weight_names(model_name: str) -> set[str]:
    """The weight names of a model's checkpoint (a folder's, or a hub model's through the HF cache): from its
    index, else its safetensors header, else its PyTorch .bin (memory-mapped, nothing read but the names)."""
    for file in WEIGHT_FILES:
        path = cached_file_or_none(model_name, file)
        if path is None:
            continue
        if file.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                return set(json.load(f)["weight_map"])
        if file.endswith(".safetensors"):
            with safe_open(path, framework="pt") as weights:
                return set(weights.keys())
        return set(bin_weights(path))
    raise ConfigError(f"model {model_name!r} has no weights file ({', '.join(WEIGHT_FILES)}). {HUB_HINT}")


def stored_shapes(model_name: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The shape and file name of each weight of a model's checkpoint, from its safetensors headers (every file
    its index names, or model.safetensors), else its PyTorch .bin files memory-mapped: no tensor is read. Empty
    where it has no weights file (from_pretrained says so)."""
    for file in WEIGHT_FILES:
        path = cached_file_or_none(model_name, file)
        if path is None:
            continue
        files = [file]
        if file.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        shapes = {}
        for name in files:
            found = cached_file_or_none(model_name, name)  # one the index names but lacks: from_pretrained says it
            for weight, shape in weight_shapes(found).items() if found else ():
                shapes[weight] = (shape, name)
        return shapes
    return {}


def weight_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in one weights file: a safetensors file's header, or a .bin memory-mapped."""
    if path.endswith(".safetensors"):
        with safe_open(path, framework="pt") as weights:
            return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    return {name: tuple(tensor.shape) for name, tensor in bin_weights(path).items()}


def bin_weights(path: str) -> dict[str, torch.Tensor]:
    """A PyTorch .bin weights file's tensors, memory-mapped (nothing read but what is touched) where it is in
    torch's zip format; a file of the older format (torch.save's _use_new_zipfile_serialization=False), which
    cannot be mapped, is read whole, as from_pretrained reads it."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))


def check_weights_fit(model_name: str, model: nn.Module) -> None:
    """ConfigError naming the first of the model's weights (in its own order) that the checkpoint holds in
    another shape, with both shapes: a config.json that says another size (d_ff, d_model, vocab_size) than its
    weights hold. `model`: built from that config, on the meta device (skeleton); the checkpoint's headers are
    read, not its tensors. Weights the checkpoint lacks or adds are load_model's to say."""
    stored = stored_shapes(model_name)
    prefix = f"{model.base_model_prefix}."
    for name, tensor in model.state_dict().items():
        # A checkpoint may store names without the model's base prefix (GPT-2's), as from_pretrained accepts.
        spelling = next((key for key in (name, name.removeprefix(prefix)) if key in stored), None)
        if spelling is None:
            continue
        shape, file = stored[spelling]
        if tuple(shape) != tuple(tensor.shape):
            raise ConfigError(
                f"the weights of model {model_name!r} do not fit its config.json: {spelling} is {list(shape)} in "
                f"{file}, and {list(tensor.shape)} in the {type(model).__name__} that config.json describes. Put "
                "back the config.json saved with these weights (save_pretrained writes both), or give the folder "
                "these weights came from."
            )


def cached_file_or_none(model_name: str, name: str) -> str | None:
    """The path of a model's file (downloaded to the HF cache for a hub name), or None where the model has no
    such file; any other failure (no network, no permission) is a ConfigError that says so."""
    try:
        return cached_file(resolved_name(model_name), name)
    except OSError as err:
        if "does not appear to have a file named" in str(err):  # transformers' words for a missing file
            return None
        raise ConfigError(f"cannot read {name} of {model_name!r}: {str(err).splitlines()[0]}") from None


def untie_head(model: nn.Module) -> None:
    """Give the model's lm_head a weight of its own (on the model's device, uninitialised on meta), leaving
    the other ties (T5's embed_tokens to shared) as they are."""
    head = model.get_output_embeddings()
    head.weight = nn.Parameter(torch.empty_like(head.weight))


def named_keys(keys: list[str]) -> str:
    """The first MAX_KEYS_NAMED of `keys`, and how many more."""
    named = ", ".join(keys[:MAX_KEYS_NAMED])
    return named if len(keys) <= MAX_KEYS_NAMED else f"{named} and {len(keys) - MAX_KEYS_NAMED} more"


def load_full_model_state(path: str) -> dict:
    """A saved .pt as a plain state dict; weights_only=True: only tensors are unpickled, never objects.
    Memory-mapped: the tensors are read from the file as they are copied, and the ranks of one host share
    its pages."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def load_full_model_weights(model: nn.Module, file: str) -> None:
    """A full state dict (.pt) into the *unwrapped* model, before FSDP wraps it. Strict: every key must match."""
    try:
        model.load_state_dict(load_full_model_state(file), strict=True)
    except FAILURES as err:  # any failure means this file cannot seed this model
        raise CheckpointError(
            f"cannot load model weights from {file}: {error_summary(err)}. It is corrupt or was saved from "
            "another model shape; pick another checkpoint or --model_name."
        ) from None
