"""The Dataset and collate of a decoder-only model (Llama, GPT-2, ...): each row's prompt and completion read as
one sequence, the model predicting every next token.

    dataset = CausalLMDataset(tokenizer, "train", num_samples, prompt_length, completion_length, data)

reads the same rows as the tutorial's Dataset (summarization_dataset.py: every source, from the data cache),
tokenised for a decoder-only model (utils/data/cache.py: the prompt as the tokenizer starts a text, the completion
ended by the EOS token, the two within --max_seq_len; `prompt_length` and `completion_length` bound each too, the
lengths(data) a run gives them being the row's). The source column is the prompt and the target column its
completion (TRL's prompt/completion format): end a prompt with its cue (`--source_prefix` goes before it) where the
data has none. The loss is on the completion's tokens alone (a conversation's: every assistant reply), as TRL's
SFTTrainer takes it, or on every token with --completion_only_loss false. Labels come from the lengths, never from
comparing ids with the padding token: a tokenizer without one pads with its EOS token (utils/model/loading.py), and
a completion's own EOS stays trained on.
"""

import bisect
from collections import defaultdict, deque
from collections.abc import Sequence

import numpy as np
import pyarrow.compute as pc
import torch
from torch.nn.utils.rnn import pad_sequence

from configs.data import DataConfig, seq_len
from summarization_dataset import SummarizationDataset
from utils.base.log import get_logger
from utils.data.cache import CAUSAL_ENCODING, KNOWN_ROLES, Encoding, SplitRows
from utils.data.loaders import IGNORED, DataFormat


class CausalLMDataset(SummarizationDataset):
    """One split as a decoder-only model trains on it: 1-D int64 input_ids (prompt then completion),
    attention_mask, labels (IGNORED on the prompt but a conversation's earlier replies unless
    --completion_only_loss false, and on padding), and
    prompt_ids (the prompt alone: generation's input). With --pad_to_max_length each sequence is padded to
    max_length. The rows, the texts and the lengths read as SummarizationDataset's."""

    encoding = CAUSAL_ENCODING  # prompt and completion tokenised as one sequence (utils/data/cache.py)

    @property
    def completion_only_loss(self) -> bool:
        return self.options.completion_only_loss

    @property
    def max_length(self) -> int:
        """--pad_to_max_length's width: a row's (--max_seq_len); with the encoding before rows were bounded, a
        whole text's (--max_seq_len), or a prompt's and a completion's."""
        if self.encoding.bounds_rows or self.options.dataset_text_field:
            return seq_len(self.options)
        return self.input_length + self.output_length

    @classmethod
    def lengths(cls, data: DataConfig, encoding: Encoding | None = None) -> tuple[int, int]:
        """The (prompt, completion) token lengths of `data` tokenised as `encoding` (by default the class's):
        neither is cut alone, the row being within --max_seq_len (utils/data/cache.py: _row_cuts); before rows
        were bounded, --max_source_length and --max_target_length, a --dataset_text_field text all completion,
        cut so that with a start token (its prompt) it is at most --max_seq_len."""
        if (encoding or cls.encoding).bounds_rows:
            return seq_len(data), seq_len(data)
        completion = seq_len(data) - 1 if data.dataset_text_field else data.max_target_length
        return data.max_source_length, completion

    def sequence(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(input_ids, labels, prompt length) of one row, unpadded."""
        if self.print_text:
            get_logger().info("Prompt: %s", self.source_prefix + self.clean_text(self.article(index)))
        prompt, completion = self._ids("source_ids", index), self._ids("target_ids", index)
        input_ids = torch.cat([prompt, completion])
        labels = input_ids.clone()
        if self.completion_only_loss:
            replies = self._replies_in_prompt(index)
            labels[: len(prompt)] = IGNORED if replies is None else torch.where(replies, prompt, IGNORED)
        return input_ids, labels, len(prompt)

    def _replies_in_prompt(self, index: int) -> torch.Tensor | None:
        """True on the prompt's tokens that are an earlier assistant reply of a conversation (trained on as the
        last reply is), False elsewhere; None for rows that are no conversation (none in their prompt)."""
        if "source_replies" not in self.token_ids.column_names:
            return None
        return self._ids("source_replies", index).bool()

    def cut_note(self) -> str:
        """What the start line says of the rows' cuts to --max_seq_len (utils/data/cache.py: _row_cuts): how many
        lost their prompt's start, their reply's end, and the share of their tokens dropped. Nothing for rows of
        the encoding before rows were bounded, which did not count them."""
        if "prompt_cut" not in self.token_ids.column_names:
            return ""
        column = self.token_ids.data.column

        def total(values) -> int:
            return pc.sum(values).as_py() or 0

        prompts, replies = (pc.greater(column(name), 0) for name in ("prompt_cut", "reply_cut"))
        cut = total(pc.or_(prompts, replies))
        dropped = total(column("prompt_cut")) + total(column("reply_cut"))
        kept = sum(total(pc.list_value_length(column(side))) for side in ("source_ids", "target_ids"))
        at = f", {total(prompts)} at the prompt's start and {total(replies)} at the reply's end" if cut else ""
        return (
            f"{cut} row{'s' if cut != 1 else ''} cut to {seq_len(self.options)} tokens{at}: "
            f"{100 * dropped / max(dropped + kept, 1):.1f}% of their tokens dropped"
        )

    def notes(self) -> list[str]:
        """What rank 0 says of the split's conversations: their messages of a role the package does not know,
        and the earlier assistant replies --completion_only_loss leaves untrained (utils/data/cache.py:
        _earlier_replies says when)."""
        return [note for note in (self._unknown_roles_note(), self._unmarked_replies_note()) if note]

    def _unknown_roles_note(self) -> str | None:
        if "unknown_roles" not in self.token_ids.column_names:
            return None
        roles = pc.value_counts(pc.list_flatten(self.token_ids.data.column("unknown_roles"))).to_pylist()
        if not roles:
            return None
        counted = ", ".join(f"{role['counts']} of role {role['values']!r}" for role in roles)
        return (
            f"messages of a role the package does not know: {counted} in the {self.split} conversations of "
            f"{self.source_description}. The chat template rendered them as it renders such a role, and the "
            "model reads them before the replies after them (and trains on them with --completion_only_loss "
            f"false); give a message one of the roles {', '.join(KNOWN_ROLES)} where it is to be read as one."
        )

    def _unmarked_replies_note(self) -> str | None:
        if not self.completion_only_loss or "replies_unmarked" not in self.token_ids.column_names:
            return None
        unmarked = pc.sum(self.token_ids.data.column("replies_unmarked")).as_py() or 0
        if not unmarked:
            return None
        return (
            f"earlier assistant replies not trained on: {unmarked} in the {self.split} conversations of "
            f"{self.source_description} (their conversations' last replies are). For each, one of: the chat "
            "template renders it differently once the conversation goes on, its content is not a text (a tool "
            "call), a token straddles its edges, or the tokenizer gives no character offsets (a slow one). "
            "--completion_only_loss false trains on every token."
        )

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        input_ids, labels, prompt_length = self.sequence(index)
        width = self.max_length if self.pad_to_max_length else len(input_ids)
        padding = width - len(input_ids)
        return {
            "input_ids": torch.cat([input_ids, input_ids.new_full((padding,), self.tokenizer.pad_token_id)]),
            "attention_mask": (torch.arange(width) < len(input_ids)).long(),
            "labels": torch.cat([labels, labels.new_full((padding,), IGNORED)]),
            "prompt_ids": input_ids[:prompt_length],
        }


class PackedCausalDataset(CausalLMDataset):
    """The rows of a split packed into blocks of --max_seq_len tokens (--packing), its items: input_ids,
    labels, position_ids and attention_mask (1 on real tokens). The blocks are a function of the cached token
    ids and the settings alone, so every rank and a resumed run see the same ones.

    documents: whole rows in their order, a block closed when the next row does not fit (a row longer than a
    block, read with an encoding from before --max_seq_len bounded rows, keeps its last --max_seq_len tokens).
    Position ids restart at every row; given them without an attention mask, transformers' attention keeps
    each row to itself (a block-causal mask; flash-attention and FlexAttention
    take the boundaries from the position ids), and a row's first token is not trained on as the previous
    row's continuation: each row's losses are those it has alone. The rest of a block is padding (collate).
    bfd: the same rows, blocks, masks and position ids, the rows placed by best-fit decreasing
    (best_fit_decreasing) instead of in order: fewer blocks, less padding.
    wrapped: every row's tokens one after the other, cut into full blocks, the last part dropped, attention
    and prediction across rows (the Llama 2 guide's packing: its ConstantLengthDataset)."""

    packed = True  # its items are blocks of rows (packing_note says what was made of them)

    def __init__(
        self,
        tokenizer,
        type_path: str,
        num_samples: int | None,
        input_length: int,
        output_length: int,
        options: DataConfig | None = None,
        *,
        rows: SplitRows | None = None,
    ) -> None:
        options = options or DataConfig(packing=True)
        super().__init__(tokenizer, type_path, num_samples, input_length, output_length, options, rows=rows)
        self.block_length, self.strategy = seq_len(options), options.packing_strategy
        lengths = np.add(self.source_lengths(), self.target_lengths(), dtype=np.int64)
        self.row_tokens = int(lengths.sum())
        if self.strategy == "wrapped":
            self.row_starts = np.concatenate([[0], np.cumsum(lengths)])
            self.num_blocks = self.row_tokens // self.block_length
            self.packed_tokens = self.num_blocks * self.block_length
        else:
            kept = np.minimum(lengths, self.block_length)  # a row longer than a block keeps its end
            if self.strategy == "bfd":
                blocks = best_fit_decreasing(kept.tolist(), self.block_length)
            else:
                blocks = rows_in_order(kept.tolist(), self.block_length)
            # Block b's rows are block_rows[block_starts[b]:block_starts[b + 1]] (rows_of).
            self.block_rows = np.array([row for block in blocks for row in block], dtype=np.int64)
            self.block_starts = np.cumsum([0, *map(len, blocks)])
            self.num_blocks = len(blocks)
            self.packed_tokens = int(kept.sum())

    def __len__(self) -> int:
        return self.num_blocks

    def rows_of(self, block: int) -> np.ndarray:
        """The rows of a documents or bfd block, in the order the block holds them."""
        return self.block_rows[self.block_starts[block] : self.block_starts[block + 1]]

    def packing_note(self) -> str:
        """What packing made of the rows: the blocks, and the share of the rows' tokens it dropped (wrapped:
        the last part; documents and bfd: what rows longer than a block lost) and of the blocks' that is
        padding."""
        dropped = 1 - self.packed_tokens / max(self.row_tokens, 1)
        padding = 1 - self.packed_tokens / max(self.num_blocks * self.block_length, 1)
        return (
            f"{len(self.dataset)} rows packed ({self.strategy}) into {self.num_blocks} blocks of "
            f"{self.block_length} tokens: {100 * dropped:.1f}% of their tokens dropped, {100 * padding:.1f}% of "
            "the blocks padding"
        )

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.strategy == "wrapped":
            return self._wrapped_block(index)
        parts = []
        for row in self.rows_of(index).tolist():
            input_ids, labels, _ = self.sequence(row)
            # A row longer than a block loses its start: the completion stays (cutting its end could leave a
            # row with no trained token), after the prompt's end, where its cue is.
            input_ids, labels = input_ids[-self.block_length :], labels[-self.block_length :].clone()
            labels[0] = IGNORED  # predicted from the row before it: no row is trained on as another's sequel
            parts.append((input_ids, labels, torch.arange(len(input_ids))))
        ids, labels, positions = (torch.cat(column) for column in zip(*parts, strict=True))
        padding = self.block_length - len(ids) if self.pad_to_max_length else 0  # fixed shapes, if asked for
        return {
            "input_ids": torch.cat([ids, ids.new_full((padding,), self.tokenizer.pad_token_id)]),
            "labels": torch.cat([labels, labels.new_full((padding,), IGNORED)]),
            "position_ids": torch.cat([positions, positions.new_zeros(padding)]),  # each its own sequence
            "attention_mask": (torch.arange(len(ids) + padding) < len(ids)).long(),
        }

    def _wrapped_block(self, index: int) -> dict[str, torch.Tensor]:
        start, end = index * self.block_length, (index + 1) * self.block_length
        row = int(np.searchsorted(self.row_starts, start, side="right")) - 1
        ids, labels = [], []
        while self.row_starts[row] < end:
            input_ids, row_labels, _ = self.sequence(row)
            first = max(start - int(self.row_starts[row]), 0)
            last = min(end - int(self.row_starts[row]), len(input_ids))
            ids.append(input_ids[first:last])
            labels.append(row_labels[first:last])
            row += 1
        ids = torch.cat(ids)
        return {
            "input_ids": ids,
            "labels": torch.cat(labels),
            "position_ids": torch.arange(len(ids)),
            "attention_mask": torch.ones_like(ids),
        }


def rows_in_order(lengths: list[int], capacity: int) -> list[list[int]]:
    """--packing_strategy documents: the rows in their order, a block closed when the next row does not fit in
    what is left of it (every length at most `capacity`)."""
    blocks, room = [], 0
    for row, length in enumerate(lengths):
        if not blocks or length > room:
            blocks.append([])
            room = capacity
        blocks[-1].append(row)
        room -= length
    return blocks


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """--packing_strategy bfd (TRL's default): the rows, longest first (equal lengths in row order), each put
    in the open block that it leaves the least room in (of those with as much room, the one opened first), or
    a new block where none has room; every length at most `capacity`. A function of the lengths alone: the same
    blocks on every rank, at a resume and on another number of ranks, whatever the seed (which orders the
    blocks: the sampler)."""
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])  # stable: ties keep the row order
    blocks: list[list[int]] = []
    rooms: list[int] = []  # the distinct room left in open blocks, ascending: the best fit is a bisection away
    with_room: dict[int, deque[int]] = defaultdict(deque)  # room left -> the open blocks with it, oldest first
    for row in order:
        length = lengths[row]
        fit = bisect.bisect_left(rooms, length)
        if fit < len(rooms):
            room = rooms[fit]
            block = with_room[room].popleft()
            if not with_room[room]:
                del rooms[fit]
        else:
            room, block = capacity, len(blocks)
            blocks.append([])
        blocks[block].append(row)
        room -= length
        if room > 0:  # a full block takes no more rows
            if not with_room[room]:
                bisect.insort(rooms, room)
            with_room[room].append(block)
    return blocks


# Each key's padding value; the prompts are padded on the left (generation continues them all from one position).
PADDING = {"attention_mask": 0, "labels": IGNORED, "position_ids": 0}


def causal_collate(items: Sequence[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad the sequences to the longest in the batch (ids with pad_token_id, the mask and position ids
    with 0, labels with IGNORED); left-pad the prompts (prompt_ids, and prompt_mask made here), so that
    generation continues every row from the same position. A padded position id of 0 starts a sequence of its
    own: a packed block's padding attends to nothing before it. A module-level function, so that its partial
    pickles into DataLoader workers."""
    if not items:
        raise ValueError("causal_collate got an empty batch.")
    batch = {}
    for key in items[0]:
        side = "left" if key == "prompt_ids" else "right"
        values = [item[key] for item in items]
        batch[key] = pad_sequence(
            values, batch_first=True, padding_value=PADDING.get(key, pad_token_id), padding_side=side
        )
    if "prompt_ids" in batch:
        masks = [torch.ones_like(item["prompt_ids"]) for item in items]
        batch["prompt_mask"] = pad_sequence(masks, batch_first=True, padding_value=0, padding_side="left")
    return batch


# What utils/data/loaders.py builds a decoder-only run's loaders with (T5_training.py hands it in): the rows
# one by one, and packed (--packing) for the training and validation losses.
FORMAT = DataFormat(dataset_type=CausalLMDataset, collate=causal_collate, packed_type=PackedCausalDataset)
