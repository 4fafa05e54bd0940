"""Turn a training checkpoint (sharded or full) into a Hugging Face folder, in one process, no GPU.

    python scripts/convert_checkpoint_to_hf.py outputs/checkpoints/step_00000120 --output my_model

The folder loads with `T5ForConditionalGeneration.from_pretrained(my_model)` and
`AutoTokenizer.from_pretrained(my_model)`. A SHARDED_STATE_DICT checkpoint written by any number of ranks
is read whole by torch.distributed.checkpoint (no process group needed); the model config and tokenizer are
taken from the checkpoint itself. Needs about the model's size in host memory.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.errors import UserError  # noqa: E402
from utils.checkpoint.hf_export import convert_checkpoint  # noqa: E402
from utils.log import get_logger, setup_logging  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a folder such as output_dir/checkpoints/step_00000120")
    parser.add_argument("--output", required=True, help="the Hugging Face folder to write (replaced atomically)")
    args = parser.parse_args(argv)
    setup_logging(rank=0)
    try:
        get_logger().info("wrote %s", convert_checkpoint(args.checkpoint, args.output))
    except UserError as err:
        get_logger().error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
