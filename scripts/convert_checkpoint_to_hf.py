"""Turn a training checkpoint (sharded or full) into a Hugging Face folder, in one process, no GPU.

    python scripts/convert_checkpoint_to_hf.py outputs/checkpoints/step_00000120 --output my_model

The folder loads with `AutoModelForSeq2SeqLM.from_pretrained(my_model)` and
`AutoTokenizer.from_pretrained(my_model)`. A SHARDED_STATE_DICT checkpoint written by any number of ranks
is read by torch.distributed.checkpoint (no process group needed), one output file's tensors at a time; a
FULL_STATE_DICT model.pt is memory-mapped. The folder is the one a run's end writes (utils/checkpoint/
hf_export.py): safetensors files of at most --max_file_gb, with model.safetensors.index.json when there are
several. The model config and tokenizer are taken from the checkpoint itself. Host memory: about one output
file (--max_file_gb), not the model.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.checkpointing import CheckpointConfig  # noqa: E402
from configs.errors import UserError  # noqa: E402
from utils.base.log import get_logger, setup_logging  # noqa: E402
from utils.checkpoint.hf_export import convert_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a folder such as output_dir/checkpoints/step_00000120")
    parser.add_argument("--output", required=True, help="the Hugging Face folder to write (replaced atomically)")
    parser.add_argument(
        "--max_file_gb",
        type=float,
        default=CheckpointConfig.export_max_file_gb,
        help="split the weights over safetensors files of at most this many GB (default: %(default)s, as a run's "
        "--export_max_file_gb)",
    )
    args = parser.parse_args(argv)
    if args.max_file_gb <= 0:
        parser.error(f"--max_file_gb must be > 0, got {args.max_file_gb}")
    setup_logging()
    try:
        convert_checkpoint(args.checkpoint, args.output, int(args.max_file_gb * 1e9))
    except UserError as err:
        get_logger().error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
