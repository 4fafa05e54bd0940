"""Turn a training checkpoint (sharded or full) into a Hugging Face folder, in one process, no GPU.

    python scripts/convert_checkpoint_to_hf.py outputs/checkpoints/step_00000120 --output my_model

The folder loads with `T5ForConditionalGeneration.from_pretrained(my_model)` and
`AutoTokenizer.from_pretrained(my_model)`. A SHARDED_STATE_DICT checkpoint written by any number of ranks
is read whole by torch.distributed.checkpoint (no process group needed); the model config and tokenizer are
taken from the checkpoint itself. Needs about the model's size in host memory.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from transformers import T5Config, T5ForConditionalGeneration, T5Tokenizer  # noqa: E402

from utils.errors import UserError  # noqa: E402
from utils.hf_export import write_hf_folder  # noqa: E402
from utils.logging_utils import get_logger, setup_logging  # noqa: E402
from utils.train_checkpoint import (  # noqa: E402
    FULL,
    LOAD_ERRORS,
    CheckpointError,
    SafeFileSystemReader,
    error_summary,
    read_train_state,
)


def load_checkpoint_weights(path: str, config: T5Config) -> dict:
    """The checkpoint's model state dict, as plain CPU tensors named like the unwrapped model's."""
    state = read_train_state(path)
    if state["checkpoint_type"] == FULL:
        return torch.load(os.path.join(path, "model.pt"), map_location="cpu", weights_only=True)
    # A template with the full shapes: DCP reads every rank's shards into it.
    template = {"model": T5ForConditionalGeneration(config).state_dict()}
    dcp.load(template, storage_reader=SafeFileSystemReader(path), no_dist=True)
    return template["model"]


def convert(checkpoint: str, output: str) -> str:
    if not os.path.isfile(os.path.join(checkpoint, "train_state.json")):
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint folder (no train_state.json)")
    config = T5Config.from_pretrained(checkpoint)
    tokenizer = T5Tokenizer.from_pretrained(os.path.join(checkpoint, "tokenizer"))
    try:
        weights = load_checkpoint_weights(checkpoint, config)
    except UserError:
        raise
    except LOAD_ERRORS as err:  # one message naming the checkpoint
        raise CheckpointError(f"cannot read the weights of {checkpoint}: {error_summary(err)}") from None
    write_hf_folder(weights, config, tokenizer, output)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a folder such as output_dir/checkpoints/step_00000120")
    parser.add_argument("--output", required=True, help="the Hugging Face folder to write (replaced atomically)")
    args = parser.parse_args(argv)
    setup_logging(rank=0)
    try:
        get_logger().info("wrote %s", convert(args.checkpoint, args.output))
    except UserError as err:
        get_logger().error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
