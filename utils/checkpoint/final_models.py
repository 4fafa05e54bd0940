"""A run's final models, apart from its resumable checkpoints: the --save_model .pt (the tutorial's full state
dict) and the Hugging Face folders written from the shards (hf_model/, hf_model_last/; with --peft lora the
adapter, and with --merge_lora the merged model). Which epoch's model goes where is utils/train/policies.py's."""

import os
import time

from configs.lora import LoraConfig
from utils.base import layout
from utils.base.log import get_logger
from utils.checkpoint.hf_export import (
    generation_stops_said,
    lora_exports,
    run_generation_config,
    summarization_settings,
    write_adapter_folder,
    write_model_folder,
)
from utils.checkpoint.manager import CheckpointManager
from utils.checkpoint.state_dicts import fsdp1_state_dict_warnings_ignored, save_full_model, sharded_model_state
from utils.distributed.hang_report import WHERE
from utils.distributed.progress_bounded import progress_bounded
from utils.model.lora import transposed_layers
from utils.spec import ModelSpec


class FinalModels:
    """The final models of the run whose checkpoints `checkpoints` writes (the same model, folder, config and
    tokenizer; a background write of theirs in flight is finished first), with what only the export reads: the
    spec (model class, architecture, saved settings), LoRA, the adapter's base (utils/model/lora.py:
    adapter_base). Every method that writes is collective."""

    def __init__(
        self,
        checkpoints: CheckpointManager,
        *,
        spec: ModelSpec,
        lora: LoraConfig,
        base_model: str,
        whole_texts: bool = False,
    ):
        self.checkpoints = checkpoints
        self.whole_texts = whole_texts  # --dataset_text_field: texts whose turns only --eos_token can mark
        self.model, self.parallelism, self.info = checkpoints.model, checkpoints.parallelism, checkpoints.info
        self.output_dir, self.model_config, self.tokenizer = (
            checkpoints.output_dir, checkpoints.model_config, checkpoints.tokenizer
        )  # fmt: skip
        self.spec, self.base_model = spec, base_model
        self.lora = lora if lora.peft == "lora" else None
        self.run_id = layout.time_stamp()  # names this run's .pt files

    @fsdp1_state_dict_warnings_ignored()
    def save_full_model(self, epoch: int, val_loss: float | None) -> str | None:
        """The tutorial's full state dict .pt, named by run, epoch and loss (rank 0 writes it)."""
        self.checkpoints.finish_pending()
        name = layout.best_model_filename(self.run_id, epoch, val_loss)
        path = os.path.join(self.output_dir, name)
        with progress_bounded("the full model's save (rank 0 writes it)"):
            return save_full_model(self.model, self.parallelism, self.info.device, self.info.is_main, path)

    @fsdp1_state_dict_warnings_ignored()
    def export_hf(self, last: bool = False) -> str | None:
        """Write output_dir/hf_model (or, `last`, hf_model_last) from the shards: every rank writes its own
        rows, no rank gathers the model (utils/checkpoint/hf_export.py). With --peft lora, the adapter folder
        (and with --merge_lora the merged model). Returns the folder on rank 0."""
        WHERE.enter("export")
        self.checkpoints.finish_pending()
        started = time.perf_counter()
        is_main = self.info.is_main
        folder = os.path.join(self.output_dir, layout.HF_LAST_DIR if last else layout.HF_DIR)
        state = sharded_model_state(self.model)
        if self.lora is not None:  # the adapter beside where the model goes, and the merged model if asked for
            adapters, state = lora_exports(state, self.lora, self.info.device, transposed_layers(self.model))
            adapter_folder = os.path.join(
                self.output_dir, layout.HF_ADAPTER_LAST_DIR if last else layout.HF_ADAPTER_DIR
            )
            if is_main:
                write_adapter_folder(adapters, self.model_config, self.spec, self.lora, self.base_model,
                                     self.tokenizer, adapter_folder)  # fmt: skip
                get_logger().info("LoRA adapter written: %s (PeftModel.from_pretrained-loadable)", adapter_folder)
            if state is None:
                return adapter_folder if is_main else None
        max_file_bytes = int(self.checkpoints.checkpointing.export_max_file_gb * 1e9)
        files = write_model_folder(
            state, self.model_config, self.spec, self.tokenizer, folder, max_file_bytes, is_main
        )
        get_logger().info(
            "model written from the shards: %s (%d safetensors file(s), %.1f s; from_pretrained-loadable)",
            folder, files, time.perf_counter() - started,
        )  # fmt: skip
        return folder if is_main else None

    def generation_stops(self) -> str:
        """Where generate() stops on the exported model, as its generation_config.json says (the closing line);
        for whole texts without --eos_token, that it runs on into the texts' next turn where another text ends
        one (the tokenizer's EOS between turns would stop it: GPT-2's <|endoftext|>)."""
        generation_config = run_generation_config(self.model_config, self.spec, self.tokenizer)
        said = generation_stops_said(generation_config, self.tokenizer)
        if self.whole_texts and "eos_token" not in summarization_settings(self.model_config, self.spec):
            said += (
                " alone: where the texts end a turn with another text, it writes on into the next turn "
                "(--eos_token names that text: the Llama 2 guide's <|endoftext|>)"
            )
        return said

    def final_folder(self, last: bool) -> str:
        """The export's folder name: hf_model (hf_model_last), or with LoRA and no merge the adapter's."""
        if self.lora is not None and not self.lora.merge_lora:
            return layout.HF_ADAPTER_LAST_DIR if last else layout.HF_ADAPTER_DIR
        return layout.HF_LAST_DIR if last else layout.HF_DIR
