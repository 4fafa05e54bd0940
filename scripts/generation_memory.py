"""What a rank holds while it generates under FSDP: the unsharded parameter bytes alive at each block's
forward during a ROUGE evaluation, against the whole model (what gathering it onto every rank would hold).

    python scripts/generation_memory.py --model t5-small --nproc 2

Each rank shards a random-weight model of the published shape (scripts/make_random_t5.py) with FSDP1 in
fp32 and summarizes the same articles with `utils.eval.generation.generate`. A forward hook on every
T5Block adds up, at that moment, the storage of every FSDP unit's unsharded flat parameter (FSDP1 frees it
with resize_(0) when a unit reshards; a private attribute, read here only to measure). The maximum over the
run is what a rank ever holds unsharded; the control is the size of the whole model. RSS is no use for
this on CPU: the allocator keeps freed memory, so it reads the same either way.
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from transformers import T5ForConditionalGeneration, T5Tokenizer  # noqa: E402
from transformers.models.t5.modeling_t5 import T5Block  # noqa: E402

from configs.data import DataConfig  # noqa: E402
from configs.evaluation import EvalConfig  # noqa: E402
from configs.fsdp import FSDPConfig  # noqa: E402
from configs.training import TrainConfig  # noqa: E402
from policies.mixed_precision import Precision  # noqa: E402
from policies.private_api import fsdp1_unsharded_flat_parameter  # noqa: E402
from scripts.make_random_t5 import make  # noqa: E402
from summarization_dataset import FORMAT  # noqa: E402
from tests.dist_harness import run_ranks  # noqa: E402
from utils.data.loaders import build_eval_set, move_batch  # noqa: E402
from utils.distributed.process_group import DistInfo  # noqa: E402
from utils.eval.generation import generate  # noqa: E402
from utils.fsdp.parallelism import parallelism_for  # noqa: E402
from utils.spec import SEQ2SEQ  # noqa: E402

CPU = torch.device("cpu")


def unsharded_bytes(model: FSDP) -> int:
    """Bytes of unsharded flat-parameter storage alive right now, over every FSDP1 unit."""
    total = 0
    for unit in FSDP.fsdp_modules(model):
        padded = fsdp1_unsharded_flat_parameter(unit)
        total += padded.untyped_storage().nbytes() if padded is not None else 0
    return total


def measure(rank: int, world_size: int, model_dir: str, articles: int) -> dict:
    info = DistInfo(rank, rank, world_size, CPU, "gloo")
    data, train = DataConfig(max_source_length=256), TrainConfig(val_batch_size=4)
    evaluation = EvalConfig(eval_num_samples=articles, max_new_tokens=32)
    tokenizer = T5Tokenizer.from_pretrained(model_dir)
    eval_set = build_eval_set(tokenizer, FORMAT, data, train, evaluation, info, "validation")
    plain = T5ForConditionalGeneration.from_pretrained(model_dir, use_cache=False)
    whole = sum(p.numel() * p.element_size() for p in plain.parameters())
    fsdp_config = FSDPConfig(mixed_precision=False, fsdp_activation_checkpointing=False)
    parallelism = parallelism_for(fsdp_config, world_size)
    model = parallelism.wrap(plain, precision=Precision("fp32_policy"), device=CPU).eval()
    peak = [0]
    for block in (m for m in model.modules() if isinstance(m, T5Block)):
        block.register_forward_pre_hook(lambda *_: peak.__setitem__(0, max(peak[0], unsharded_bytes(model))))
    settings = SEQ2SEQ.generation_kwargs(evaluation, data.max_target_length)
    for batch in eval_set.loader:
        generate(model, parallelism, SEQ2SEQ.prompts(move_batch(batch, CPU)), settings)
    return {"peak_unsharded_bytes": peak[0], "whole_model_bytes": whole}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="t5-small", help="a published shape (scripts/make_random_t5.py)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--articles", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        folder = str(Path(work) / args.model)
        make(args.model, folder)
        results = run_ranks(measure, folder, args.articles, world_size=args.nproc, timeout_s=1200)
    for rank, result in enumerate(results):
        held, whole = result["peak_unsharded_bytes"], result["whole_model_bytes"]
        print(f"rank {rank}: at most {held / 2**20:.1f} MiB of parameters unsharded while generating; "
              f"the whole model (the control: gathered onto every rank) is {whole / 2**20:.1f} MiB "
              f"({held / whole:.1%})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
