"""Write a small synthetic sample in the format of the Llama 2 guide's dataset, for seed 004's recipe offline.

    python scripts/make_chat_sample.py [--out data/code_chat]

The guide fine-tunes on smangrul/code-chat-assistant-v1 (LIMA and Guanaco conversations, coding-assistant
ones mixed in), whose `content` column holds each conversation as one text: a system line, then turns, each
opened by <|system|>, <|prompter|> or <|assistant|> and closed by <|endoftext|>. This sample has that format:
train.jsonl and validation.jsonl, one {"content": ...} per line, one to three exchanges each, from question
and answer templates about Python in which the answer follows from the question, so a small model can learn
it. It is seeded: a second run writes the same bytes (tests/test_causal.py checks the committed copy).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.paths import REPO_ROOT  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "data" / "code_chat"
ROWS = {"train": 240, "validation": 24}
SEED = 4
SYSTEM = "<|system|> You are a helpful coding assistant. Answer briefly and correctly.<|endoftext|>"
THINGS = ("list", "string", "dictionary", "tuple", "set", "file", "number")
TASKS = {
    "reverse a {thing}": "Use slicing: `x[::-1]` returns the {thing} reversed.",
    "count the items of a {thing}": "Call `len(x)` on the {thing}.",
    "copy a {thing}": "Use `copy.copy(x)` for a shallow copy of the {thing}.",
    "print a {thing}": "Pass the {thing} to `print(x)`.",
    "check if a {thing} is empty": "A {thing} is empty when `not x` is true.",
    "sort a {thing}": "Call `sorted(x)`: it returns a new list of the {thing}'s items in order.",
    "compare two {thing}s": "Use `a == b`: two {thing}s are equal when their items are.",
}
OPENERS = ("How do I", "What is the way to", "Can you show me how to", "In Python, how can I")
THANKS = ("Thanks! And", "Great. Also,", "That works. Next:")


def conversation(rng: random.Random) -> str:
    """One conversation of one to three exchanges, in the dataset's markers."""
    parts = [SYSTEM]
    for turn in range(rng.randint(1, 3)):
        task, answer = rng.choice(sorted(TASKS.items()))
        thing = rng.choice(THINGS)
        opener = rng.choice(OPENERS) if turn == 0 else f"{rng.choice(THANKS)} {rng.choice(OPENERS).lower()}"
        parts.append(f"<|prompter|> {opener} {task.format(thing=thing)}?<|endoftext|>")
        parts.append(f"<|assistant|> {answer.format(thing=thing)}<|endoftext|>")
    return " ".join(parts)


def write(out: Path) -> None:
    rng = random.Random(SEED)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in ROWS.items():
        with open(out / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for _ in range(rows):
                f.write(json.dumps({"content": conversation(rng)}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    write(Path(parser.parse_args().out))


if __name__ == "__main__":
    main()
