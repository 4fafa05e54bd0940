"""The model as a Hugging Face folder, written from the shards: no rank ever holds the whole model.

`AutoModelForSeq2SeqLM.from_pretrained(folder)` (a decoder-only model's: `AutoModelForCausalLM`) and
`AutoTokenizer.from_pretrained(folder)` load it;
no pickles, no remote code. The folder holds what save_pretrained writes: config.json,
generation_config.json, the tokenizer, and the weights in safetensors files of at most
--export_max_file_gb (`model.safetensors`, or `model-00001-of-0000N.safetensors`... with
`model.safetensors.index.json`), tied weights once (`tied_names`).

- At the end of a run (`write_model_folder`, collective): every rank writes its own rows of every tensor
  (torch.distributed.checkpoint's HuggingFaceStorageWriter), then the ranks stitch the rows into the final
  files, one tensor at a time, each rank its share of the files. A rank's extra memory is its serialized
  part of one small batch of tensors, then one full tensor; the gather this replaces put the whole model on
  rank 0 (44 GB for t5-11b in fp32), and save_pretrained's serialization as much again. FSDP1's sharded
  state dict is a copy of the rank's shards (FSDP2's is not), one per tied name, made while each unit is
  gathered in turn: with FSDP1 that comes on top (docs/checkpoints.md has the figures).
- With --peft lora (`lora_exports`): the adapters alone are gathered (they are small) and PEFT writes
  them (`write_adapter_folder`); the merged model is W + scaling * B @ A, each rank computing its own rows
  of W, then written as above.
- Afterwards, from a checkpoint (`convert_checkpoint`, one process, no process group): the same folder,
  each output file read from the checkpoint and written in turn.
"""

import copy
import json
import math
import os
import shutil
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoTokenizer, GenerationConfig

from configs.errors import FAILURES, CheckpointError, UserError, error_summary
from configs.lora import LoraConfig
from policies.private_api import consolidate_safetensors_files_on_every_rank
from utils.base import layout
from utils.base.files import atomic_path, tmp_path
from utils.base.log import get_logger, progress_bar, warnings_ignored
from utils.checkpoint.integrity import find_damage
from utils.checkpoint.safe_dcp import SafeFileSystemReader
from utils.checkpoint.start import read_train_state
from utils.checkpoint.state_dicts import (
    fsdp1_state_dict_warnings_ignored,
    full_tensor_everywhere,
    local_rows,
    with_local_rows,
)
from utils.eval.generation import NO_TURN_END, stops_of, turn_end
from utils.model.loading import saved_config, skeleton
from utils.model.lora import ADAPTER_NAME, PEFT_PREFIX, apply_lora, base_weight_name
from utils.spec import GENERATION_KEYS, ModelSpec, spec_for

# Each rank serializes its rows of a batch of tensors in memory before writing them (DCP's safetensors
# writer; about twice the batch's bytes while it does): batches of about this many bytes per rank keep that
# small (a replicated tensor, with NO_SHARD or across HYBRID_SHARD's replicas, is written whole by one
# rank), at the cost of more files in the intermediate folder: about model size / 32 MiB of them, whatever
# the number of ranks. Stitching opens every one of them at once, so there are never more than
# MAX_PART_FILES (the batches grow instead: t5-11b in fp32, 172 MB per rank).
RANK_PART_BYTES = 32 * 2**20
MAX_PART_FILES = 256
# convert_checkpoint reads a checkpoint in one process on purpose (no_dist=True); DCP says so at every read.
SINGLE_PROCESS_READ_WARNING = (UserWarning, "torch.distributed is disabled, unavailable or uninitialized")
RANK_PARTS_DIR = "rank_parts"  # inside the folder being written, deleted once the final files are stitched


def file_plan(sizes: dict[str, int], max_file_bytes: int) -> dict[str, int]:
    """Which file (numbered from 1) each tensor goes to: in order, a new file whenever the next tensor would
    overflow the current one (save_pretrained's rule: a tensor larger than the limit gets a file of its own)."""
    plan, index, used = {}, 1, 0
    for name, size in sizes.items():
        if used and used + size > max_file_bytes:
            index, used = index + 1, 0
        plan[name] = index
        used += size
    return plan


def tensor_bytes(shape, dtype: torch.dtype) -> int:
    """The bytes of a full tensor of this shape and dtype (a sharded tensor's whole, not this rank's part)."""
    return math.prod(shape) * dtype.itemsize


def tied_names(model_config, spec: ModelSpec) -> set[str]:
    """The names save_pretrained leaves out because they are another parameter: T5's `embed_tokens` (and,
    with tie_word_embeddings, `lm_head`) are `shared.weight`, BART's `lm_head` is `model.shared.weight`, and
    from_pretrained ties them to it again."""
    seen, tied = set(), set()
    for name, parameter in skeleton(model_config, spec).named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            tied.add(name)
        seen.add(id(parameter))
    return tied


@fsdp1_state_dict_warnings_ignored()
def lora_exports(
    state: dict, lora: LoraConfig, device: torch.device, transposed: frozenset[str] = frozenset()
) -> tuple[dict, dict | None]:
    """From a PEFT model's sharded state dict: the adapters whole, on every rank (on the CPU), and, with
    --merge_lora, the merged model's state dict (plain transformers names) as this rank's rows. Collective.

    The merge is PEFT's `merge_and_unload` arithmetic, W + (B @ A) * scaling, done by each rank on its own
    rows of W: B @ A is computed whole (one layer's weight size at a time) and its rows are sliced, so the
    result is bit for bit PEFT's. The `transposed` layers (lora.transposed_layers: GPT-2's Conv1D, stored (in,
    out), PEFT's fan_in_fan_out) take (B @ A) transposed."""
    adapters = {name: full_tensor_everywhere(tensor, device) for name, tensor in state.items() if ".lora_" in name}
    if not lora.merge_lora:
        return {name: tensor.cpu() for name, tensor in adapters.items()}, None
    scaling = lora.lora_alpha / lora.lora_r  # PEFT's scaling without rsLoRA (utils/model/lora.py sets none)
    merged = {}
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        if name.endswith(".base_layer.weight"):
            layer = name.removesuffix(".base_layer.weight")
            a = adapters[f"{layer}.lora_A.{ADAPTER_NAME}.weight"]
            b = adapters[f"{layer}.lora_B.{ADAPTER_NAME}.weight"]
            local, first_row = local_rows(tensor)
            if local is not None:
                delta = (b @ a) * scaling
                if layer in transposed:
                    delta = delta.T
                rows = delta[first_row : first_row + local.shape[0]]
                tensor = with_local_rows(tensor, local + rows.to(local.device))  # FSDP2's CPU offload
        merged[base_weight_name(name)] = tensor
    return {name: tensor.cpu() for name, tensor in adapters.items()}, merged


@fsdp1_state_dict_warnings_ignored()
def write_model_folder(
    state: dict, model_config, spec: ModelSpec, tokenizer, folder: str, max_file_bytes: int, is_main: bool
) -> int:
    """Write the HF folder `folder` from every rank's shards of the model state dict (transformers names).
    Collective. The folder appears whole or not at all: an existing one is replaced once the new one is
    complete. Empties `state` once every rank's rows are written. Returns the number of weights files."""
    tied = tied_names(model_config, spec)
    parts_state = {name: tensor for name, tensor in state.items() if name not in tied}
    sizes = {name: tensor_bytes(tensor.size(), tensor.dtype) for name, tensor in parts_state.items()}
    dtype = next(iter(parts_state.values())).dtype
    plan = file_plan(sizes, max_file_bytes)
    files = max(plan.values())
    world_size = dist.get_world_size()
    part_bytes = max(RANK_PART_BYTES * world_size, math.ceil(sum(sizes.values()) * world_size / MAX_PART_FILES))
    # Rank 0 removes what an export that crashed left behind, and renames the folder into place at the end.
    with atomic_path(folder) if is_main else nullcontext(tmp_path(folder)) as tmp:
        dist.barrier()  # nobody writes into the temporary folder before rank 0 has cleared it
        parts = os.path.join(tmp, RANK_PARTS_DIR)
        writer = HuggingFaceStorageWriter(
            parts, fqn_to_index_mapping=file_plan(sizes, part_bytes), save_distributed=True
        )
        dcp.save(parts_state, storage_writer=writer)
        # FSDP1's sharded state dict is a copy of this rank's shards: freed before the files are stitched.
        parts_state.clear()
        state.clear()
        # Each rank stitches the final files whose number modulo the world size is its rank; rank 0 then
        # writes model.safetensors.index.json.
        consolidate_safetensors_files_on_every_rank(parts, tmp, plan)
        if is_main:
            shutil.rmtree(parts)
            if files == 1:  # save_pretrained's name for a single file, and no index
                stitched = os.path.join(tmp, "model-00001-of-00001.safetensors")  # DCP's name
                os.replace(stitched, os.path.join(tmp, layout.hf_weights_file(1, 1)))
                os.remove(os.path.join(tmp, layout.HF_WEIGHTS_INDEX))
            write_model_description(model_config, spec, tokenizer, dtype, tmp)
    return files


def write_model_description(model_config, spec: ModelSpec, tokenizer, dtype: torch.dtype, folder: str) -> None:
    """What save_pretrained writes besides the weights (config.json with the architecture and dtype,
    generation_config.json), and the tokenizer."""
    config = copy.deepcopy(model_config)
    # Training runs without the KV cache (activation checkpointing needs that); whoever loads the folder
    # generates, which wants it.
    config.use_cache = True
    config.architectures = [spec.architecture(config)]
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(folder)
    run_generation_config(config, spec, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def summarization_settings(config, spec: ModelSpec) -> dict:
    """The run's summarization settings (cleaning, prefix, lengths, generation) its model config carries."""
    return (getattr(config, "task_specific_params", None) or {}).get(spec.params_key, {})


def run_generation_config(config, spec: ModelSpec, tokenizer=None) -> GenerationConfig:
    """generation_config.json with the run's generation settings, so `generate()` summarises as evaluated: up
    to the run's lengths, and ending at every stop token evaluation ended at (the tokenizer's EOS too), and at
    the run's --eos_token (its id among eos_token_id, or a stop string: utils/eval/generation.py, turn_end)."""
    generation_config = GenerationConfig.from_model_config(config)
    summarization = summarization_settings(config, spec)
    generation = {key: summarization[key] for key in GENERATION_KEYS if key in summarization}
    if generation.get("num_beams", 1) == 1:
        generation.pop("length_penalty", None)  # a beam-search setting; transformers refuses it otherwise
    generation_config.update(use_cache=True, **generation)
    turn = turn_end(tokenizer, summarization.get("eos_token", "")) if tokenizer is not None else NO_TURN_END
    stops = sorted({*stops_of(generation_config, tokenizer), *turn.ids})
    if stops != stops_of(generation_config, None):  # the config names another EOS than the tokenizer's
        generation_config.eos_token_id = stops
    if turn.strings:
        generation_config.stop_strings = list(turn.strings)
    return generation_config


def generation_stops_said(generation_config: GenerationConfig, tokenizer) -> str:
    """How generate() stops on a model with `generation_config` (run_generation_config's), in words: its stop
    tokens, and its stop strings, which generate matches only when given the tokenizer (without it, it raises;
    a text-generation pipeline passes its own only when asked: transformers 5.24)."""
    ids = stops_of(generation_config, None)
    said = " or ".join(repr(token) for token in tokenizer.convert_ids_to_tokens(ids)) or "its length limit alone"
    strings = generation_config.stop_strings or []
    if strings:
        said += (
            f", and at the text {' or '.join(repr(text) for text in strings)} (stop_strings in "
            "generation_config.json, which generate() reads through its tokenizer: give it tokenizer=tokenizer, "
            "a pipeline call tokenizer=pipe.tokenizer)"
        )
    return said


def write_adapter_folder(
    adapters: dict, model_config, spec: ModelSpec, lora: LoraConfig, base_model: str, tokenizer, folder: str
) -> None:
    """Rank 0: PEFT's adapter folder (adapter_config.json naming `base_model`, adapter_model.safetensors)
    from the gathered adapters, the tokenizer, and the run's generation and summarization settings. PEFT's
    save_pretrained writes it, from a PEFT model on the meta device: its module names and configuration, no
    weights (the live one's names carry FSDP1's wrappers, which PEFT's key matching does not know)."""
    config = copy.deepcopy(model_config)
    config.use_cache = True
    with torch.device("meta"):
        peft_skeleton = apply_lora(skeleton(config, spec), lora, base_model, spec)
    with atomic_path(folder) as tmp:
        peft_skeleton.save_pretrained(tmp, state_dict=adapters, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # What a whole model's config.json and generation_config.json carry, for scripts/summarize.py.
        run_generation_config(config, spec, tokenizer).save_pretrained(tmp)
        with open(os.path.join(tmp, layout.ADAPTER_SUMMARIZATION_FILE), "w", encoding="utf-8") as f:
            json.dump(summarization_settings(config, spec), f, indent=1)


def convert_checkpoint(checkpoint: str, output: str, max_file_bytes: int) -> str:
    """Write the HF folder `output` from a checkpoint folder (its weights, model config and tokenizer), one
    output file at a time: host memory for one file (--max_file_gb), not the model."""
    if not os.path.isfile(os.path.join(checkpoint, layout.STATE_FILE)):
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint folder (no {layout.STATE_FILE})")
    problem = find_damage(checkpoint, read_train_state(checkpoint))  # every file, in this one process
    if problem is not None:
        raise CheckpointError(f"{checkpoint} is damaged: {problem}. Convert another checkpoint.")
    config = saved_config(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(checkpoint, layout.TOKENIZER_DIR))
    try:
        shapes, read = _checkpoint_tensors(checkpoint)
        if any(name.startswith(PEFT_PREFIX) for name in shapes):
            raise CheckpointError(
                f"{checkpoint} was written by a --peft lora run; this script converts plain models. A LoRA run "
                f"writes its adapter to output_dir/{layout.HF_ADAPTER_DIR}/ and, with --merge_lora true, the "
                f"merged model to output_dir/{layout.HF_DIR}/ when it ends."
            )
        spec = spec_for(config)
        tied = tied_names(config, spec)
        shapes = {name: shape for name, shape in shapes.items() if name not in tied}
        sizes = {name: tensor_bytes(shape, dtype) for name, (shape, dtype) in shapes.items()}
        plan = file_plan(sizes, max_file_bytes)
        files = max(plan.values())
        with atomic_path(output) as tmp:
            os.makedirs(tmp)
            weight_map = {}
            with progress_bar(files, "writing safetensors files", unit="file") as bar:
                for index in range(1, files + 1):
                    names = [name for name, number in plan.items() if number == index]
                    file = layout.hf_weights_file(index, files)
                    save_file(read(names), os.path.join(tmp, file), metadata={"format": "pt"})
                    weight_map.update(dict.fromkeys(names, file))
                    bar.update(1)
            if files > 1:
                index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
                with open(os.path.join(tmp, layout.HF_WEIGHTS_INDEX), "w", encoding="utf-8") as f:
                    json.dump(index, f, indent=2)
            write_model_description(config, spec, tokenizer, next(iter(shapes.values()))[1], tmp)
    except UserError:
        raise
    except FAILURES as err:  # one message naming the checkpoint
        raise CheckpointError(f"cannot convert {checkpoint}: {error_summary(err)}") from None
    get_logger().info("wrote %s: %d weights file(s)", output, files)
    return output


def _checkpoint_tensors(checkpoint: str):
    """({name: (shape, dtype)} of a checkpoint's model, and read(names) -> {name: tensor}), without reading
    the weights yet. A SHARDED_STATE_DICT checkpoint written by any number of ranks is read by DCP, only the
    tensors asked for; a FULL_STATE_DICT model.pt is memory-mapped."""
    if read_train_state(checkpoint)["checkpoint_type"] == layout.FULL:
        file = os.path.join(checkpoint, layout.MODEL_FILE)
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        shapes = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in state.items()}
        return shapes, lambda names: {name: state[name] for name in names}
    metadata = SafeFileSystemReader(checkpoint).read_metadata()
    prefix = f"{layout.MODEL_SECTION}."
    shapes = {
        key.removeprefix(prefix): (tuple(entry.size), entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)
    }

    def read(names: list[str]) -> dict:
        template = {name: torch.empty(shapes[name][0], dtype=shapes[name][1]) for name in names}
        with warnings_ignored(SINGLE_PROCESS_READ_WARNING):
            reader = SafeFileSystemReader(checkpoint)
            dcp.load({layout.MODEL_SECTION: template}, storage_reader=reader, no_dist=True)
        return template

    return shapes, read
