"""Summaries from the sharded model, on every rank at once, for either FSDP backend.

`generate` (T5's, BART's) calls the encoder directly, not the model's forward, so FSDP never gathers the root
unit's parameters (the shared embedding, the final norms, the tied lm_head) and generation fails on shards
(docs/pitfalls.md #18). The root unit is therefore gathered around the whole call (utils/fsdp/parallelism.py:
FSDP1 with `summon_full_params(recurse=False)`, FSDP2 by registering `generate` as a forward method at wrap
time).

Each layer unit (T5Block) is, by default where the whole model fits (--gather_for_generation, `keep_gathered`),
gathered at its first forward and kept until the evaluation ends (`gathered_for_generation`): one all-gather
per unit and evaluation. Otherwise it is gathered only while it runs and freed after, as in training: a rank
then holds at most the root unit and about one layer unit unsharded, never the whole model, at the price of
one all-gather per decoder unit and generated token.

Ranks that finish decoding early must keep joining the all-gathers of the others: `synced_gpus=True`
makes every rank step until all are done. The evaluation sampler gives every rank the same number of
batches (repeats padded in and ignored when scoring).
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from configs.errors import ConfigError
from utils.distributed.launcher import ranks_on_this_host
from utils.distributed.process_group import any_rank
from utils.fsdp.parallelism import Parallelism
from utils.observe.memory import available_memory


def generate(model: nn.Module, parallelism: Parallelism, prompts: dict, generation: dict) -> torch.Tensor:
    """Token ids of the outputs for one batch's `prompts` (the spec's prompts of a batch on the model's device,
    utils/spec.py), with `generation` (the spec's generation_kwargs) as generate's settings; `parallelism`
    gathers the root unit around the call. Collective: every rank calls it the same number of times."""
    kwargs = {
        **prompts,
        "synced_gpus": dist.get_world_size() > 1,
        "use_cache": True,  # the model is loaded with use_cache=False for training; decoding wants the cache
        **generation,
    }
    with torch.no_grad():
        return parallelism.generate(model, kwargs)


@dataclass(frozen=True)
class TurnEnd:
    """--eos_token as generation stops at it: the id of one of the tokenizer's own tokens, or a stop string."""

    ids: tuple[int, ...] = ()
    strings: tuple[str, ...] = ()  # generate's stop_strings, which it matches with its tokenizer= argument


NO_TURN_END = TurnEnd()  # no --eos_token: the EOS alone


def turn_end(tokenizer, eos_token: str, model_name: str = "") -> TurnEnd:
    """Where generation stops for --eos_token `eos_token` (empty: nowhere but the EOS): its id where it is a
    special or added token of the tokenizer (GPT-2's <|endoftext|>, a chat model's <|im_end|>), a single token
    whatever the text around it; else a stop string, which generate matches however the text is split (the
    Llama 2 guide's <|endoftext|> in Llama's vocabulary: several tokens). ConfigError where the tokenizer cannot
    write it (an <unk>, or a decoding that is another text): generation would never meet it."""
    if not eos_token:
        return NO_TURN_END
    own = tokenizer.get_added_vocab().get(eos_token)
    if own is not None:
        return TurnEnd(ids=(own,))
    ids = tokenizer(eos_token, add_special_tokens=False).input_ids
    unknown = tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids
    if not ids or unknown or tokenizer.decode(ids).strip() != eos_token.strip():
        tokens = " ".join(tokenizer.convert_ids_to_tokens(ids))
        raise ConfigError(
            f"--eos_token {eos_token!r} does not encode to tokens of the tokenizer of {model_name!r}: it reads "
            f"as {tokens or 'nothing'} ({tokenizer.decode(ids)!r}), so generation would never write it. Give "
            f"the text that ends a turn in the data as this tokenizer writes it: its EOS {tokenizer.eos_token!r}, "
            "another of its special tokens, or a text of its vocabulary"
        )
    return TurnEnd(strings=(eos_token,))


def generation_stops(model: nn.Module, parallelism: Parallelism, tokenizer, turn: TurnEnd) -> TurnEnd:
    """Everything generation ends a row at: the ids of the model's generation config's EOS (one, or several: a
    chat model's end of turn too), the tokenizer's and `turn`'s (--eos_token: turn_end), sorted; the stop
    strings of `turn` and of the model's generation config (an export's)."""
    generation_config = getattr(parallelism.inner(model), "generation_config", None)
    ids = sorted({*stops_of(generation_config, tokenizer), *turn.ids})
    strings = getattr(generation_config, "stop_strings", None) or []
    strings = [strings] if isinstance(strings, str) else strings
    return TurnEnd(tuple(ids), tuple(dict.fromkeys([*turn.strings, *strings])))


def cut_at_stop_strings(
    ids: torch.Tensor, texts: list[str], lengths: list[int], pad_id: int, strings: tuple[str, ...]
) -> tuple[list[str], list[int]]:
    """Each decoded output up to the first of the stop `strings` generate stopped at (the end of a turn is no
    more part of the output than the EOS), and its generated length: where it stopped at one, its tokens before
    the padding generate put after it (`lengths`, generated_lengths', would take that padding for an EOS where
    the two are one token: Llama's, GPT-2's)."""
    cut_texts, cut_lengths = [], []
    for row, (text, length) in enumerate(zip(texts, lengths, strict=True)):
        ends = [text.index(string) for string in strings if string in text]
        cut_texts.append(text[: min(ends)] if ends else text)
        cut_lengths.append(int((ids[row] != pad_id).sum()) if ends else length)
    return cut_texts, cut_lengths


def stops_of(generation_config, tokenizer) -> list[int]:
    """A generation config's EOS ids (none, one or several) and the tokenizer's (None: none), sorted."""
    ids = getattr(generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    own = getattr(tokenizer, "eos_token_id", None)
    return sorted({*ids, *([] if own is None else [own])})


def keep_gathered(
    model: nn.Module, parallelism: Parallelism, setting: str, compute_dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether generation keeps every unit gathered for the whole evaluation (--gather_for_generation): `setting`
    true or false, or auto: with more than one rank, where the whole model's parameters in `compute_dtype` take
    at most half of every rank's free device memory (the other half: the decoding cache, the activations; on
    CPU the host's, shared by its ranks). Collective: every rank must decide the same, or the ranks'
    all-gathers would no longer pair up."""
    if setting != "auto":
        return setting == "true"
    if dist.get_world_size() == 1:
        return False  # nothing is sharded: nothing to gather
    needed = parallelism.param_numel_whole(model) * compute_dtype.itemsize
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        available = available_memory()
        free = None if available is None else available // ranks_on_this_host(dist.get_world_size())
    return not any_rank(free is None or needed > free // 2, device)


def gathered_for_generation(model: nn.Module, parallelism: Parallelism, keep: bool):
    """Inside, with `keep`: each FSDP unit stays gathered from its first forward on; all are freed at the end."""
    return parallelism.kept_gathered(model) if keep else contextlib.nullcontext()
