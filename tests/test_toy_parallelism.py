"""The parallelism is one object: a toy one, written in this file alone, trains a whole run through the builder.

`Replicated` keeps the whole model on every rank and averages the gradients once per step, as PyTorch's
DistributedDataParallel does (without its buckets); nothing else in the package names it. The entry point's
run (data, model, training, validation, the export) takes it through `fsdp_main(..., parallelism=...)`, and its
per-step losses are FSDP2's on the same run: sharding changes where the weights live, not the arithmetic.
"""

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForSeq2SeqLM

from tests.dist_harness import run_ranks
from tests.reference_run import read_records
from tests.run_configs import run_config
from utils.base.log import get_logger
from utils.distributed.process_group import DistInfo
from utils.fsdp.parallelism import Parallelism

CPU = torch.device("cpu")
STEPS = 4  # 16 rows, 2 ranks of 2 rows: 4 steps in the one epoch


class Replicated(Parallelism):
    """Every rank holds the whole model; the gradients are averaged over the ranks before the norm is taken."""

    averaged_steps = 0  # in this rank's process: the steps whose gradients it averaged

    def _wrap(self, model, layers, precision, device, weights_source, restores):  # noqa: ARG002 - the interface
        return model.to(device)

    def clip_grad_norm(self, model, limit):
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
        Replicated.averaged_steps += 1
        return super().clip_grad_norm(model, limit)

    def describe(self, model, precision):  # noqa: ARG002 - the interface
        get_logger().info("replicated: the whole model on each of %d ranks", dist.get_world_size())


def run_worker(rank: int, world_size: int, output_dir: str, toy: bool) -> int:
    """The entry point's run of the embedded model and sample, with the toy or with FSDP2; the steps the toy
    averaged."""
    import T5_training

    Replicated.averaged_steps = 0
    config = run_config(
        output_dir=output_dir, num_train_samples=16, num_val_samples=4, batch_size_training=2, epochs=1,
        eval_rouge=False, mixed_precision=False, dropout_rate=0.0, log_every_n_steps=1, fsdp_version=2,
        keep_last_n=0,
    )  # fmt: skip
    overrides = {"parallelism": Replicated(config.fsdp)} if toy else {}
    T5_training.fsdp_main(config, DistInfo(rank, rank, world_size, CPU, "gloo"), {}, **overrides)
    return Replicated.averaged_steps


@pytest.mark.slow  # two 2-rank runs of 4 steps, their validation and export: 20 to 30 s
def test_a_toy_parallelism_in_one_file_trains_through_the_builder_as_fsdp2_does(tmp_path):
    averaged = run_ranks(run_worker, str(tmp_path / "toy"), True)
    not_averaged = run_ranks(run_worker, str(tmp_path / "fsdp2"), False)  # the control: the package's FSDP2
    records = {name: read_records(tmp_path / name) for name in ("toy", "fsdp2")}
    losses = {name: [r["loss"] for r in rows if r["type"] == "step"] for name, rows in records.items()}
    assert len(losses["toy"]) == STEPS and losses["toy"] == pytest.approx(losses["fsdp2"], rel=1e-6)
    assert averaged == [STEPS, STEPS] and not_averaged == [0, 0]  # the toy, and only it, synced the gradients
    # The export is the toy's trained model: it loads, and differs from the control's only by rounding.
    toy, fsdp2 = (AutoModelForSeq2SeqLM.from_pretrained(tmp_path / name / "hf_model") for name in ("toy", "fsdp2"))
    fsdp2_state = fsdp2.state_dict()
    assert max((value - fsdp2_state[key]).abs().max().item() for key, value in toy.state_dict().items()) < 1e-5
