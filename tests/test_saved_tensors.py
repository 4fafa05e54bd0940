"""utils/observe/memory.SavedTensorCounter: the bytes a forward keeps for backward, parameters left out,
against a hand count and against what activation checkpointing must save less of."""

import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration

from configs.paths import EMBEDDED_MODEL_DIR
from policies.activation_checkpointing_functions import apply_fsdp_checkpointing
from policies.wrapping import layer_classes
from tests.dist_workers import make_batch
from utils.observe.memory import SavedTensorCounter
from utils.spec import SEQ2SEQ


def test_hand_count_of_linear_relu_linear():
    """linear saves its input (the weight is a parameter, not counted); relu saves its output; the second
    linear saves that same output again (one storage, counted once)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    x = torch.randn(3, 5)
    with SavedTensorCounter() as counter:
        model(x).sum().backward()
    assert counter.bytes == 3 * 5 * 4 + 3 * 7 * 4


def test_activation_checkpointing_keeps_only_block_inputs_and_what_is_outside_the_blocks():
    config = T5Config.from_pretrained(EMBEDDED_MODEL_DIR, dropout_rate=0.0, use_cache=False)
    batch = make_batch(0, rows=4, src_len=32, tgt_len=8)
    measured = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(config)
        if checkpointing:
            apply_fsdp_checkpointing(model, layer_classes(model))
        with SavedTensorCounter() as counter:
            token_losses, _ = SEQ2SEQ.token_losses(model, batch)
        token_losses.sum().backward()  # the saved tensors were real: backward runs on them
        measured[checkpointing] = counter.bytes
    assert 0 < measured[True] < measured[False] / 2, measured


def test_decoder_inputs_are_t5s_own_shift_and_its_loss_is_not_kept():
    """The spec's token_losses passes decoder_input_ids (utils/spec.py: shift_right) instead of labels: the
    logits equal T5's own labels path exactly, and the bytes kept for backward are smaller by T5's unused
    loss, one batch x target x vocabulary log-softmax."""
    config = T5Config.from_pretrained(EMBEDDED_MODEL_DIR, dropout_rate=0.0, use_cache=False)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    batch = make_batch(0, rows=4, src_len=32, tgt_len=8)
    labels = batch["target_ids"].masked_fill(batch["target_mask"] == 0, -100)
    with SavedTensorCounter() as with_labels:  # the labels path, and the same float32 loss on its logits
        reference = model(input_ids=batch["source_ids"], attention_mask=batch["source_mask"], labels=labels)
        expected = torch.nn.functional.cross_entropy(
            reference.logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none"
        ).view_as(labels)
    with SavedTensorCounter() as ours:
        token_losses, _ = SEQ2SEQ.token_losses(model, batch)
    assert torch.equal(token_losses, expected)
    log_softmax = 4 * 8 * config.vocab_size * 4  # fp32, 4 x 8 target tokens
    assert 0 <= with_labels.bytes - ours.bytes - log_softmax <= 8  # and T5's loss scalar
