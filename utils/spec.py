"""The model spec: what differs between an encoder-decoder and a decoder-only model, chosen once from the
model's config and handed to whatever needs it.

    spec = spec_for(config, model_name)   # SEQ2SEQ for an encoder-decoder, CAUSAL for a decoder-only model

It names the model class loading builds, how the tokenizer's padding and the decoder's start token are read,
the Dataset and collate the data is read with (data_format), how a batch becomes per-token losses (the step
and validation), the tokens a batch trains on and reads (the loss's mean, the rates), how its FLOPs are
counted (MFU), which way each metric improves (the best model), what generation reads of a batch, the
generation settings and the parameters saved with the model (evaluation, hf_model/), and the LoRA task type.
Loading, the data, the step, the trainer, evaluation and the export are handed it instead of assuming an
encoder-decoder: a decoder-only model is the second class here (CausalSpec), not branches through them.
"""

import dataclasses
import inspect
import math

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_MASKED_LM_MAPPING,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
)

import causal_lm_dataset
import summarization_dataset
from configs.data import DEFAULT_MAX_SEQ_LEN, DataConfig
from configs.errors import ConfigError
from configs.evaluation import EvalConfig
from utils.base.log import get_logger
from utils.data.loaders import IGNORED, DataFormat
from utils.distributed.process_group import is_rank0
from utils.loss import token_cross_entropy
from utils.observe.flops import CausalFlops, FlopCounter, Seq2SeqFlops

GENERATION_KEYS = ("num_beams", "max_new_tokens", "length_penalty", "no_repeat_ngram_size", "do_sample")
LOWER_IS_BETTER = frozenset({"val_loss"})  # every other metric (the ROUGE scores, accuracy) is higher-better


class ModelSpec:
    """What every spec shares: the generation settings, the parameters saved with the model, and which way each
    metric improves. A spec class names the rest (Seq2SeqSpec, CausalSpec)."""

    model_class: type  # the transformers auto class loading builds
    model_mapping: dict  # that auto class's mapping: config class -> model class
    data_format: DataFormat  # the Dataset and collate its data is read with
    pads_by_length: bool  # padding is masked by length, never read: EOS may pad, the model's pad id is not checked
    reads_decoder_start: bool  # the decoder starts from config.decoder_start_token_id, which must be given
    lora_task_type: str  # peft's TaskType
    params_key: str  # the model config's task_specific_params entry the run's settings go in

    def check_model(self, model_name: str, config: PretrainedConfig) -> None:
        """ConfigError unless the spec's auto class has a class for this config, and the architecture
        config.json names (if any) belongs to its model_type: a folder of one family is never loaded into
        another's class."""
        if type(config) not in self.model_mapping:
            raise ConfigError(
                f"model {model_name!r} is a {config.model_type} model, which neither AutoModelForSeq2SeqLM nor "
                "AutoModelForCausalLM loads: this package fine-tunes encoder-decoders (T5, BART, ...) and "
                "decoder-only models (Llama, Mistral, Qwen, GPT-2, ...). Pick one of those for --model_name."
            )
        for architecture in getattr(config, "architectures", None) or []:
            named = getattr(transformers, architecture, None)
            family = getattr(named, "config_class", None)
            if family is not None and family is not type(config):
                raise ConfigError(
                    f"model {model_name!r}: its config.json names the architecture {architecture} (a "
                    f"{family.model_type} model) but its model_type is {config.model_type}: the weights would "
                    "not fit the class. Fix model_type or architectures in config.json to the family that "
                    "saved it."
                )

    def architecture(self, config: PretrainedConfig) -> str:
        """The class name an export's config.json gives as its architecture."""
        return self.model_mapping[type(config)].__name__

    def generation_kwargs(self, evaluation: EvalConfig, max_target_length: int) -> dict:
        """The keyword arguments of `generate` for these settings (GENERATION_KEYS; also saved as
        hf_model/generation_config.json). Summaries are as long as the model was trained to write unless
        --max_new_tokens says otherwise."""
        return {
            "num_beams": evaluation.num_beams,
            "max_new_tokens": evaluation.max_new_tokens or max_target_length,
            "length_penalty": evaluation.length_penalty,
            "no_repeat_ngram_size": evaluation.no_repeat_ngram_size,
            "do_sample": False,
        }

    def prompt_room(self, config: PretrainedConfig, max_new_tokens: int) -> int | None:  # noqa: ARG002
        """The most prompt tokens generation may read (None: any): an encoder-decoder's prompt is its source,
        cut at --max_source_length (CausalSpec's)."""
        return None

    def saved_params(self, data: DataConfig, evaluation: EvalConfig, cleaning: str) -> dict:
        """How this run prepares a source text (its cleaning, named as in utils/data/cache.py's CLEANINGS, the
        prefix, the length) and generates its output. Saved in the model config's
        `task_specific_params[params_key]` (summarization's where T5's published checkpoints keep theirs), so
        checkpoints and hf_model/ carry it and scripts/summarize.py needs no flags. With --eos_token, the text
        generation stops at besides the EOS (the export's generation_config.json: utils/eval/generation.py)."""
        return {
            "cleaning": cleaning,
            "prefix": data.source_prefix,
            "max_source_length": data.max_source_length,
            **self.generation_kwargs(evaluation, data.max_target_length),
            **({"eos_token": data.eos_token} if data.eos_token else {}),
        }

    @staticmethod
    def is_better(metric_name: str, value: float, best: float | None) -> bool:
        """Lower is better for val_loss, higher for the scores. A NaN or infinite value is never better (a
        diverged epoch must not become the exported model), and replaces a best that is not finite."""
        if not math.isfinite(value):
            return False
        if best is None or not math.isfinite(best):
            return True
        return value < best if metric_name in LOWER_IS_BETTER else value > best


class Seq2SeqSpec(ModelSpec):
    """An encoder-decoder (T5, flan-t5, mT5, UMT5, BART, PEGASUS, ...) writing a target from a source: the
    tutorial's summarization. Its batches hold source_ids / source_mask and target_ids / target_mask
    (summarization_dataset.py); the decoder reads the targets shifted right, and every real target token is
    trained on."""

    model_class = AutoModelForSeq2SeqLM
    model_mapping = MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING
    data_format = summarization_dataset.FORMAT  # the tutorial's Dataset
    pads_by_length = False  # the model's padding token is the tokenizer's (T5's decoder starts from it)
    reads_decoder_start = True
    lora_task_type = "SEQ_2_SEQ_LM"  # peft's TaskType
    params_key = "summarization"  # the model config's task_specific_params entry the run's settings go in

    def check_data(self, data: DataConfig, config: PretrainedConfig) -> None:  # noqa: ARG002 - CausalSpec's
        """ConfigError for the data settings only a decoder-only model reads."""
        for given, flag in ((data.packing, "--packing true"), (data.dataset_text_field, "--dataset_text_field")):
            if given:
                raise ConfigError(
                    f"{flag} is for decoder-only models (whole texts, packed blocks); an encoder-decoder reads a "
                    "source and writes its target: drop it, or train a decoder-only model (docs/causal.md)"
                )
        if data.eos_token:
            raise ConfigError(
                f"--eos_token {data.eos_token!r} names the text that ends a decoder-only model's turns; an "
                "encoder-decoder's target ends with its EOS token, where its generation stops: drop it"
            )

    def fitted_data(self, data: DataConfig, config: PretrainedConfig, resumed: bool) -> DataConfig:  # noqa: ARG002
        """`data` as the run reads it with this model: --max_seq_len (TRL's --max_length) is a decoder-only
        model's one length (CausalSpec.fitted_data), refused where given; a resumed run's record may hold the
        1024 every run recorded before it became NONE, which is dropped."""
        if data.max_seq_len is None:
            return data
        if resumed:
            return dataclasses.replace(data, max_seq_len=None)
        raise ConfigError(
            f"--max_seq_len {data.max_seq_len} (TRL's --max_length) is a decoder-only model's one length; an "
            "encoder-decoder's are two: --max_source_length (the source's tokens) and --max_target_length (the "
            "target's). Give those instead"
        )

    def input_embeddings(self, model: nn.Module) -> list[nn.Module]:
        """The modules whose outputs are the model's input embeddings (NEFTune noises them): the encoder's and
        the decoder's. transformers 5 gives T5's and BART's stacks embedding modules of their own, tied to the
        shared one, which is then never called: HF's hook on it adds nothing there; these add the noise its hook
        added when the stacks called the shared module."""
        stacks = (model.get_encoder().get_input_embeddings(), model.get_decoder().get_input_embeddings())
        return list({id(module): module for module in stacks}.values())  # one module where both stacks call it

    def completions(self, outputs: torch.Tensor, prompts: dict) -> torch.Tensor:  # noqa: ARG002 - CausalSpec's
        """What `generate` wrote for `prompts`: an encoder-decoder's outputs after the decoder's start token,
        which it was given (T5's is the padding token, BART's its EOS)."""
        return outputs[:, 1:]

    def loss_metrics(self, val_loss: float | None) -> dict:  # noqa: ARG002 - CausalSpec's reads it
        """What the records add to a validation loss: nothing here (a summary's loss is read as it is)."""
        return {}

    def token_losses(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cross-entropy (float32, 0 at padding) and the labels, for a batch already on the device
        (utils/loss.py: from the whole logits, or chunk by chunk in the head with --loss_chunk_tokens)."""
        labels = labels_for_loss(batch["target_ids"], batch["target_mask"])
        # The decoder inputs are passed rather than `labels`: given labels, T5 also computes its own mean loss,
        # whose log-softmax keeps a batch x target x vocabulary tensor alive for backward although the loss
        # here (a float32 sum, so ranks combine exactly) is the one trained on.
        inputs = {
            "input_ids": batch["source_ids"],
            "attention_mask": batch["source_mask"],
            "decoder_input_ids": shift_right(batch["target_ids"], model.config.decoder_start_token_id),
        }
        return token_cross_entropy(model, inputs, labels), labels

    def trained_tokens(self, batch: dict) -> torch.Tensor:
        """The tokens the loss is a mean over (the real target tokens), on the batch's device."""
        return batch["target_mask"].sum()

    def read_tokens(self, batch: dict) -> torch.Tensor:
        """The real tokens the model reads and writes (source and target): tokens_per_s counts these."""
        return batch["source_mask"].sum() + batch["target_mask"].sum()

    def batch_shape(self, batch: dict) -> tuple[int, int, int]:
        """(rows, source length, target length) of a padded batch: the memory account's shape."""
        return (*batch["source_ids"].shape, batch["target_ids"].shape[1])

    def flop_counter(self, config: PretrainedConfig, frozen_weights: bool) -> FlopCounter | None:
        """How a batch's training FLOPs are counted (None where this family's are not)."""
        return Seq2SeqFlops.from_config(config, frozen_weights=frozen_weights)

    def prompts(self, batch: dict) -> dict:
        """What generation reads of a batch (already on the device): the sources, as `generate`'s input_ids and
        attention_mask."""
        return {"input_ids": batch["source_ids"], "attention_mask": batch["source_mask"]}


class CausalSpec(ModelSpec):
    """A decoder-only model (Llama, Mistral, Qwen, GPT-2, ...) continuing a prompt: the source is the prompt and
    the target its completion, read as one sequence. Its batches hold input_ids / attention_mask (prompt then
    completion, right-padded), labels (IGNORED where no loss is taken: padding, and the prompt unless
    --completion_only_loss false) and prompt_ids / prompt_mask (the prompts alone, left-padded, for
    generation): causal_lm_dataset.py. The model predicts each token from the ones before it."""

    model_class = AutoModelForCausalLM
    model_mapping = MODEL_FOR_CAUSAL_LM_MAPPING
    data_format = causal_lm_dataset.FORMAT  # prompt and completion as one sequence
    pads_by_length = True
    reads_decoder_start = False
    lora_task_type = "CAUSAL_LM"
    params_key = "fsdp_fine_tune"  # the run's settings, beside the model's own task_specific_params entries

    def token_losses(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cross-entropy of each next token (float32, 0 where no loss is taken) and its labels: the
        logits at position t score the token at t + 1. `labels` are not passed to the model, for the reason
        Seq2SeqSpec.token_losses gives."""
        if "position_ids" in batch:
            # Packed blocks: given position ids and neither a padding mask nor a KV cache (with one, transformers
            # takes them for a continuation), attention keeps each row to itself.
            inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
        else:
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        labels = batch["labels"][:, 1:]
        # Each position's target is the next token; the last position predicts none.
        targets = F.pad(labels, (0, 1), value=IGNORED)
        return token_cross_entropy(model, inputs, targets)[:, :-1], labels

    def trained_tokens(self, batch: dict) -> torch.Tensor:
        """The tokens the loss is a mean over: every labelled token but the first of a row (nothing before it
        predicts it)."""
        return (batch["labels"][:, 1:] != IGNORED).sum()

    def read_tokens(self, batch: dict) -> torch.Tensor:
        """The real tokens of the sequences (prompt and completion)."""
        return batch["attention_mask"].sum()

    def batch_shape(self, batch: dict) -> tuple[int, int, int]:
        """(rows, sequence length, sequence length): the model reads and writes the one sequence."""
        rows, length = batch["input_ids"].shape
        return rows, length, length

    def flop_counter(self, config: PretrainedConfig, frozen_weights: bool) -> FlopCounter | None:
        return CausalFlops.from_config(config, frozen_weights=frozen_weights)

    def prompts(self, batch: dict) -> dict:
        """The prompts alone, left-padded, so that every row's completion starts at the same position."""
        return {"input_ids": batch["prompt_ids"], "attention_mask": batch["prompt_mask"]}

    def input_embeddings(self, model: nn.Module) -> list[nn.Module]:
        """The module whose output is the model's input embeddings (NEFTune noises it): get_input_embeddings()
        (a PEFT model's base model's: PEFT hands the call on), where HF's Trainer hooks it."""
        return [model.get_input_embeddings()]

    def check_data(self, data: DataConfig, config: PretrainedConfig) -> None:
        """ConfigError where --packing documents or bfd would let a block's rows attend to each other:
        transformers tells them apart by their position ids, which some models' forward does not take (BLOOM,
        MPT)."""
        forward = inspect.signature(self.model_mapping[type(config)].forward).parameters
        if data.packing and data.packing_strategy != "wrapped" and "position_ids" not in forward:
            raise ConfigError(
                f"--packing_strategy {data.packing_strategy} keeps a block's rows apart by their position ids, "
                f"and {self.architecture(config)} takes none: its rows would attend to the rows before them. "
                "Train it unpacked (--packing false), or with --packing_strategy wrapped (rows attending across, "
                "as the Llama 2 guide packed)"
            )

    def fitted_data(self, data: DataConfig, config: PretrainedConfig, resumed: bool) -> DataConfig:
        """`data` with --max_seq_len within the model's positions (its config's max_position_embeddings, GPT-2's
        n_positions): NONE becomes DEFAULT_MAX_SEQ_LEN, or the positions where the model has fewer (said); a value
        past them is refused where the model holds its positions in a table (learned: GPT-2, OPT, BART), which
        has no row for them, and warned where they are computed (rotary: Llama, Mistral, Qwen) without
        rope_scaling. A resume (`resumed`) keeps its run's value, checked when the run started (or taken then,
        before the check). Says once where --max_source_length or --max_target_length is set: they do not bound
        its rows."""
        positions = _positions(config)
        # GPT-2 calls it n_positions
        named = config.attribute_map.get("max_position_embeddings", "max_position_embeddings")
        field = f"{config.model_type}'s {named}"
        if data.max_seq_len is None:
            length = min(DEFAULT_MAX_SEQ_LEN, positions or DEFAULT_MAX_SEQ_LEN)
            if length < DEFAULT_MAX_SEQ_LEN and not resumed:
                get_logger().info(
                    "--max_seq_len %d: the model's positions (%s), fewer than the default %d", length, field,
                    DEFAULT_MAX_SEQ_LEN,
                )  # fmt: skip
            data = dataclasses.replace(data, max_seq_len=length)
        if resumed:
            return data
        self._say_unbounding_lengths(data)
        if positions is None or data.max_seq_len <= positions or _rope_scaled(config):
            return data
        if self._position_table(config, positions):
            raise ConfigError(
                f"--max_seq_len {data.max_seq_len} is past the model's {positions} positions ({field}), which it "
                f"holds in a table of learned embeddings: a token past them has no position. Give --max_seq_len "
                f"{positions} or less (or leave it out: {min(positions, DEFAULT_MAX_SEQ_LEN)})"
            )
        if is_rank0():
            get_logger().warning(
                "--max_seq_len %d is past the %d positions the model was trained on (%s; computed, as rotary "
                "positions are, without rope_scaling): its tokens past %d sit where it has never read. Set "
                "rope_scaling in its config.json to stretch them, or give --max_seq_len %d",
                data.max_seq_len, positions, field, positions, positions,
            )  # fmt: skip
        return data

    @staticmethod
    def _say_unbounding_lengths(data: DataConfig) -> None:
        """A line for each of --max_source_length and --max_target_length set to other than its default: they
        cut an encoder-decoder's source and target, not a decoder-only model's rows (--max_seq_len does)."""
        defaults = DataConfig()
        rows = f"its rows are bounded by --max_seq_len {data.max_seq_len}, prompt and completion together"
        if data.max_source_length != defaults.max_source_length:
            get_logger().info(
                "--max_source_length %d does not cut a decoder-only model's prompts: %s",
                data.max_source_length, rows,
            )  # fmt: skip
        if data.max_target_length != defaults.max_target_length:
            get_logger().info(
                "--max_target_length %d does not cut a decoder-only model's completions (%s): it is only the "
                "length generation writes, --max_new_tokens unset", data.max_target_length, rows,
            )  # fmt: skip

    def prompt_room(self, config: PretrainedConfig, max_new_tokens: int) -> int | None:
        """The most prompt tokens generation may read: where the positions are a table (GPT-2, OPT), prompt
        and written tokens must fit in it, and a row's prompt may fill --max_seq_len; rotary positions have no
        such end (None)."""
        positions = _positions(config)
        if positions is None or not self._position_table(config, positions):
            return None
        return max(positions - max_new_tokens, 1)

    def _position_table(self, config: PretrainedConfig, positions: int) -> bool:
        """Whether the model holds its positions in a table of embeddings (GPT-2's wpe, OPT's and BART's
        embed_positions, offset by 2): an embedding of `positions` rows or 2 more, other than the tokens', in its
        skeleton on the meta device (no memory, no weights read)."""
        with torch.device("meta"):
            model = self.model_class.from_config(config)
        tokens = model.get_input_embeddings()
        return any(
            isinstance(module, nn.Embedding) and module is not tokens
            and positions <= module.num_embeddings <= positions + 2
            for module in model.modules()
        )  # fmt: skip

    def completions(self, outputs: torch.Tensor, prompts: dict) -> torch.Tensor:
        """A decoder-only model's outputs begin with the prompt: the tokens after it."""
        return outputs[:, prompts["input_ids"].shape[1] :]

    def loss_metrics(self, val_loss: float | None) -> dict:
        """The validation perplexity, exp(val_loss): how a language model's loss is usually read."""
        if val_loss is None:
            return {}
        return {"val_perplexity": math.inf if val_loss > 700 else math.exp(val_loss)}  # exp overflows past 709


SEQ2SEQ = Seq2SeqSpec()
CAUSAL = CausalSpec()


def spec_for(config: PretrainedConfig, model_name: str = "") -> ModelSpec:
    """The spec of the model `config` describes (`model_name` names it in a refusal), checked to fit it: an
    encoder-decoder (config.is_encoder_decoder; BART and PEGASUS also register causal-LM classes) is SEQ2SEQ, a
    decoder-only model CAUSAL; an encoder-only model (BERT, RoBERTa: a masked-LM family that is no decoder) is
    refused."""
    name = model_name or config.model_type
    if config.is_encoder_decoder:
        SEQ2SEQ.check_model(name, config)
        return SEQ2SEQ
    if type(config) in MODEL_FOR_MASKED_LM_MAPPING and not config.is_decoder:
        raise ConfigError(
            f"model {name!r} is a {config.model_type} model, an encoder only: it writes no text. This package "
            "fine-tunes encoder-decoders (T5, BART, ...) and decoder-only models (Llama, Mistral, Qwen, GPT-2, "
            "...). Pick one of those for --model_name."
        )
    CAUSAL.check_model(name, config)
    return CAUSAL


def _positions(config: PretrainedConfig) -> int | None:
    """The model's positions (max_position_embeddings; GPT-2's n_positions), None where its config names none."""
    positions = getattr(config, "max_position_embeddings", None)
    return positions if isinstance(positions, int) and positions > 0 else None


def _rope_scaled(config: PretrainedConfig) -> bool:
    """Whether the model's rotary positions are stretched (rope_scaling: a rope_type other than the default, for
    some of its layers or all)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    per_layer_type = [value for value in parameters.values() if isinstance(value, dict)]
    return any(kind.get("rope_type", "default") != "default" for kind in per_layer_type or [parameters])


def labels_for_loss(target_ids: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """A copy of target_ids with IGNORED wherever target_mask is 0.

    Padding must never count in the loss, or the model learns to predict padding and the loss reads too
    low (docs/pitfalls.md #8). T5 shifts the labels right itself to make the decoder inputs.
    """
    return target_ids.long().masked_fill(target_mask == 0, IGNORED)


def shift_right(target_ids: torch.Tensor, start_token_id: int) -> torch.Tensor:
    """The decoder inputs: the start token, then the targets but the last. Padding positions of the targets
    hold the pad token already, which is what T5's own shift puts there."""
    start = target_ids.new_full((target_ids.shape[0], 1), start_token_id)
    return torch.cat([start, target_ids[:, :-1]], dim=1)
