"""What only a GPU shows, checked in a few minutes: the process group's backends, host syncs in a training step
(with transformers' sdpa and with t5_flex), the bf16 choice, FSDP2 with CPU offload, t5_flex's FlexAttention
forward and backward against the stock attention, one rank without FSDP against FSDP1 (the loss, and the SDPA
kernels of each one's forward calls), a sharded save and load, and generation's all-gathers.

    torchrun --nproc_per_node 1 scripts/gpu_check.py --output gpu_check.json    # one GPU (or N)
    torchrun --nproc_per_node 2 scripts/gpu_check.py --device cpu               # tiny scale on CPU (the tests)

Each check prints one line, `ok`, `FAILED` or `skipped` with what it found, and --output writes them as JSON.
The model is the embedded tiny T5 (--model_name another folder or hub name, random weights of its shape
would do as well: only the code paths matter here). On one GPU the world size is 1: FSDP1 then runs NO_SHARD
and FSDP2 skips its collectives, so the sharded paths need several GPUs; the backend and offload checks still
exercise the backend lookup that fails with NCCL alone.
"""

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict  # noqa: E402
from transformers import AutoModelForSeq2SeqLM  # noqa: E402

from configs.fsdp import FSDPConfig  # noqa: E402
from configs.paths import EMBEDDED_MODEL_DIR  # noqa: E402
from policies.mixed_precision import Precision, resolve_precision  # noqa: E402
from policies.private_api import TorchDispatchMode  # noqa: E402
from utils.base.log import ProgressLines  # noqa: E402
from utils.distributed import process_group  # noqa: E402
from utils.eval.generation import gathered_for_generation, generate  # noqa: E402
from utils.fsdp.parallelism import FSDP2, parallelism_for  # noqa: E402
from utils.fsdp.shard import forward_warnings_ignored  # noqa: E402
from utils.model import t5_attention  # noqa: E402
from utils.model.loading import load_model_config  # noqa: E402
from utils.spec import SEQ2SEQ  # noqa: E402
from utils.train.step import GRAD_NORM, StepSettings, train_step, validate  # noqa: E402

FP32 = Precision("fp32_policy")
REPO_ROOT = Path(__file__).resolve().parents[1]


def random_batch(config, device: torch.device, rows: int = 4, seed: int = 0, lengths: tuple = (32, 8)) -> dict:
    """Token ids with right padding of different lengths (source, target), as the collate makes them."""
    gen = torch.Generator().manual_seed(seed)
    src, tgt = lengths
    source = torch.randint(2, config.vocab_size, (rows, src), generator=gen)
    target = torch.randint(2, config.vocab_size, (rows, tgt), generator=gen)
    source_mask = (torch.arange(src) < torch.randint(src // 4, src + 1, (rows, 1), generator=gen)).long()
    target_mask = (torch.arange(tgt) < torch.randint(2, tgt + 1, (rows, 1), generator=gen)).long()
    batch = {"source_ids": source * source_mask, "source_mask": source_mask, "target_ids": target * target_mask,
             "target_mask": target_mask}  # fmt: skip
    return {key: value.to(device) for key, value in batch.items()}


FSDP2_RUN = FSDP2(FSDPConfig(fsdp_version=2))  # what the FSDP2 checks' step and generation ask of the backend


def fresh_model(
    model_name: str, fsdp: FSDPConfig, precision: Precision, device: torch.device, kernel: str = "sdpa"
):
    torch.manual_seed(0)
    # checked, the KV cache off, as a run loads it
    config, _ = load_model_config(model_name, dropout_rate=0.0, attn_implementation=kernel)
    model = AutoModelForSeq2SeqLM.from_config(config)
    if kernel == t5_attention.NAME:
        t5_attention.fuse_norms(model)  # as a run loads it
    return parallelism_for(fsdp, dist.get_world_size()).wrap(model, precision=precision, device=device), config


def check_backends(device: torch.device) -> tuple[str, str]:
    """The default group's backend, and a CPU tensor and a device tensor all-reduced over it. On CUDA the
    control: a group of NCCL alone refuses the CPU tensor (pytorch#148532), which CPU offload's gradient norm
    would all-reduce."""
    found = [f"backend {dist.get_backend()}"]
    for where in dict.fromkeys((torch.device("cpu"), device)):  # in order, once each
        value = torch.ones(1, device=where)
        dist.all_reduce(value)
        found.append(f"{where.type} all-reduce {value.item():g}")
        if value.item() != dist.get_world_size():
            return "FAILED", ", ".join(found)
    if device.type == "cuda":
        nccl_alone = dist.new_group(backend="nccl")
        try:
            dist.all_reduce(torch.ones(1), group=nccl_alone)
            found.append("control: NCCL alone took a CPU tensor (the finding does not hold here)")
        except RuntimeError as err:
            found.append(f"control: NCCL alone refuses a CPU tensor ({str(err).splitlines()[0][:80]})")
    return "ok", ", ".join(found)


def check_cpu_offload(model_name: str, device: torch.device) -> tuple[str, str]:
    """FSDP2 with CPU offload: two steps with the gradient norm (clipping), on the combined backend."""
    if device.type != "cuda":
        return "skipped", "CPU offload needs a GPU"
    fsdp = FSDPConfig(fsdp_version=2, fsdp_cpu_offload=True, mixed_precision=False)
    model, config = fresh_model(model_name, fsdp, FP32, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = StepSettings(FSDP2_RUN, max_grad_norm=1.0, spec=SEQ2SEQ)
    norms = []
    for step in range(2):
        batch = random_batch(config, device, seed=step)
        stats = train_step(model, batch, optimizer, None, dist.get_world_size(), settings)
        norms.append(float(stats[GRAD_NORM]) * dist.get_world_size())
    finite = all(torch.isfinite(torch.tensor(norms)))
    return ("ok" if finite else "FAILED"), f"gradient norms {', '.join(f'{n:.3g}' for n in norms)}"


# Host syncs of three training steps and a validation pass of three batches, per kernel. transformers' sdpa is
# the control: its mask helper asks whether a padding mask is all ones, twice a forward (encoder,
# cross-attention), so at least 6 and 7 must be seen there (or the count sees nothing); t5_flex's mask never
# asks, so none in training, and a validation pass reads its sums once.
CONTROL_SYNCS = {"training": 3 * 2, "validation": 3 * 2 + 1}
T5_FLEX_SYNCS = {"training": 0, "validation": 1}


def check_syncs(model_name: str, device: torch.device, kernel: str) -> tuple[str, str]:
    """Host syncs in three training steps and a validation pass of three batches (FSDP2, bf16 where the GPU
    has it), counted by CUDA's sync debug mode, each named by where it happened (the library line, and the
    nearest line of this repository: none for one in the autograd engine's thread). The training batches are
    on the GPU before the count, as the loader's pinned copies are; tests/test_host_syncs.py counts the same on
    CPU. sdpa is the control (CONTROL_SYNCS)."""
    if device.type != "cuda":
        return "skipped", "CUDA's sync debug mode (tests/test_host_syncs.py counts them on CPU)"
    precision = resolve_precision(FSDPConfig(), device)
    model, config = fresh_model(model_name, FSDPConfig(fsdp_version=2), precision, device, kernel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    settings = StepSettings(FSDP2_RUN, max_grad_norm=1.0, skip_nonfinite=True, spec=SEQ2SEQ)
    lengths = (64, 24)  # t5_flex runs FlexAttention from 16 tokens on
    train_step(model, random_batch(config, device, lengths=lengths), optimizer, None, dist.get_world_size(),
               settings)  # fmt: skip  # warm-up (and FlexAttention's compile)
    training = [random_batch(config, device, seed=step + 1, lengths=lengths) for step in range(3)]
    validation = [random_batch(config, torch.device("cpu"), seed=10 + k, lengths=lengths) for k in range(3)]
    torch.cuda.synchronize()
    found = {}
    for phase in ("training", "validation"):
        with synced_places() as places:
            if phase == "training":
                for batch in training:
                    train_step(model, batch, optimizer, None, dist.get_world_size(), settings)
            else:
                progress = ProgressLines(3, "validation", "batch")
                validate(model, validation, device=device, num_real_samples=12, progress=progress,
                         stop_requested=lambda: False, spec=SEQ2SEQ)  # fmt: skip
        found[phase] = places
    if kernel == "sdpa":
        good = all(len(found[phase]) >= CONTROL_SYNCS[phase] for phase in found)
        wanted = {phase: f"at least {count}" for phase, count in CONTROL_SYNCS.items()}
    else:
        good = all(len(found[phase]) <= T5_FLEX_SYNCS[phase] for phase in found)
        wanted = {phase: f"at most {count}" for phase, count in T5_FLEX_SYNCS.items()}
    text = "; ".join(
        f"{phase}: {len(places)} syncs (expected {wanted[phase]}) at {sorted(set(places))}"
        for phase, places in found.items()
    )
    return ("ok" if good else "FAILED"), text


@contextlib.contextmanager
def synced_places():
    """CUDA's sync debug mode ("warn") for the block; yields the list it fills with each sync as "library line
    < this repository's nearest line" (the warning alone names the Python line that called into C++)."""
    places: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001
        if "synchroniz" not in str(message):
            return
        repo = str(REPO_ROOT)
        ours = [
            f for f in traceback.extract_stack() if f.filename.startswith(repo) and "gpu_check" not in f.filename
        ]
        where = f"{Path(filename).parent.name}/{Path(filename).name}:{lineno}"
        if ours:
            where += f" < {Path(ours[-1].filename).relative_to(repo)}:{ours[-1].lineno}"
        places.append(where)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield places
        finally:
            torch.cuda.set_sync_debug_mode("default")


def check_t5_flex(model_name: str, device: torch.device) -> tuple[str, str]:
    """t5_flex on the GPU (FlexAttention, compiled, forward and backward) against transformers' sdpa on padded
    batches of 64/24 tokens, FSDP2: in fp32 the loss within 1e-5 relative and every gradient within 1e-5 of the
    largest; in bf16 (FSDP mixed precision, the bias in bf16) the loss within 1e-2 relative and the position
    bias's gradient within 5e-2 of its largest. FlexAttention must have run (its calls are counted)."""
    if device.type != "cuda":
        return "skipped", "FlexAttention has no backward on CPU (tests/test_t5_attention.py checks its forward)"
    calls = []
    counted = t5_attention.flex_self_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return counted(*args, **kwargs)

    found, good = [], True
    t5_attention.flex_self_attention = counting
    try:
        for precision, (loss_tol, grad_tol) in ((FP32, (1e-5, 1e-5)), (resolve_precision(FSDPConfig(), device),
                                                                       (1e-2, 5e-2))):  # fmt: skip
            (stock_loss, stock_grads), (loss, grads) = (
                loss_and_grads(model_name, device, precision, kernel) for kernel in ("sdpa", t5_attention.NAME)
            )
            names = (
                grads.keys()
                if precision.name == FP32.name
                else [n for n in grads if "relative_attention_bias" in n]
            )
            largest = max(stock_grads[n].abs().max().item() for n in names)
            worst = max((grads[n] - stock_grads[n]).abs().max().item() for n in names)
            relative = abs(loss - stock_loss) / abs(stock_loss)
            good &= relative <= loss_tol and worst <= grad_tol * largest
            found.append(f"{precision.name}: loss {loss:.6f} vs sdpa {stock_loss:.6f} (relative {relative:.2g}), "
                         f"gradients {worst / largest:.2g} of the largest")  # fmt: skip
    finally:
        t5_attention.flex_self_attention = counted
    good &= bool(calls)
    return ("ok" if good else "FAILED"), "; ".join(found) + f"; FlexAttention calls: {len(calls)}"


def loss_and_grads(model_name: str, device: torch.device, precision: Precision, kernel: str):
    """The token-mean loss and every parameter's full gradient of one padded batch (FSDP2, dropout 0)."""
    fsdp = FSDPConfig(fsdp_version=2, mixed_precision=precision.name != FP32.name)
    model, config = fresh_model(model_name, fsdp, precision, device, kernel)
    loss = padded_batch_backward(model, config, device)
    return loss, {name: p.grad.full_tensor().float() for name, p in model.named_parameters()}


def padded_batch_backward(model, config, device: torch.device) -> float:
    """Forward and backward of one padded batch of 64/24 tokens (t5_flex's FlexAttention from 16 tokens on):
    its token-mean loss."""
    token_losses, labels = SEQ2SEQ.token_losses(model, random_batch(config, device, lengths=(64, 24)))
    loss = token_losses.sum() / (labels != -100).sum()
    loss.backward()
    return loss.item()


# The kernels behind scaled_dot_product_attention, as the profiler names them (the math one computes in fp32 for
# bf16 inputs: docs/pitfalls.md #47 found the stock step under autocast taking it for 48 of its 120 calls).
SDPA_KERNELS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def check_single_rank(model_name: str, device: torch.device) -> tuple[str, str]:
    """One rank without FSDP (--single_rank_fsdp false: autocast) against FSDP1 at world size 1 (its mixed
    precision), bf16 where the device has it, activation checkpointing on: one padded batch's forward and
    backward, the losses within 1e-2 relative, and the SDPA kernels of each one's forward calls, the backward's
    recomputation included (counted by torch's profiler)."""
    if dist.get_world_size() > 1:
        return "skipped", "one rank only: on several ranks FSDP wraps the model whatever the flag says"
    precision = resolve_precision(FSDPConfig(), device)
    losses, found = {}, []
    for name, fsdp in (("FSDP1", FSDPConfig()), ("no FSDP", FSDPConfig(single_rank_fsdp=False))):
        model, config = fresh_model(model_name, fsdp, precision, device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            losses[name] = padded_batch_backward(model, config, device)
        names = (event.name.removeprefix("aten::") for event in profile.events())
        kernels = Counter(kernel for kernel in names if kernel in SDPA_KERNELS)
        found.append(f"{name}: loss {losses[name]:.6f}, SDPA kernels {dict(kernels)}")
    relative = abs(losses["no FSDP"] - losses["FSDP1"]) / abs(losses["FSDP1"])
    return ("ok" if relative <= 1e-2 else "FAILED"), f"{precision.name}: " + "; ".join(found) + (
        f"; relative {relative:.2g}"
    )


def check_bf16(device: torch.device) -> tuple[str, str]:
    precision = resolve_precision(FSDPConfig(), device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else "-"
    said = precision.fallback or "bf16 computed natively"
    return "ok", f"capability {capability}: policy {precision.name} ({said})"


def check_sharded_save(model_name: str, device: torch.device, folder: str) -> tuple[str, str]:
    """FSDP2's sharded state dict saved with torch.distributed.checkpoint and loaded into a second model."""
    fsdp = FSDPConfig(fsdp_version=2, mixed_precision=False)
    model, config = fresh_model(model_name, fsdp, FP32, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = StepSettings(FSDP2_RUN, spec=SEQ2SEQ)
    train_step(model, random_batch(config, device), optimizer, None, dist.get_world_size(), settings)
    started = time.perf_counter()
    dcp.save(get_model_state_dict(model), checkpoint_id=folder)
    saved = time.perf_counter() - started
    torch.manual_seed(1)
    other, _ = fresh_model(model_name, fsdp, FP32, device)
    state = get_model_state_dict(other)
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(other, state)
    equal = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True)
    )
    return ("ok" if equal else "FAILED"), f"saved in {saved:.2f} s, loaded equal: {equal}"


class AllGatherCount(TorchDispatchMode):
    """How many all-gathers ran inside it: c10d's ops as every torch version dispatches them, whichever Python
    function (all_gather_into_tensor, all_gather_single) FSDP called."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        collective = func.namespace in ("c10d", "_c10d_functional")  # not FSDP2's own copy-in op
        self.count += collective and ("allgather" in name or "all_gather" in name)
        return func(*args, **(kwargs or {}))


def check_generation(model_name: str, device: torch.device) -> tuple[str, str]:
    """All-gathers of a greedy generation of 8 tokens under FULL_SHARD (FSDP2), gathered per token and kept
    gathered (--gather_for_generation), and whether both write the same tokens."""
    found = {}
    for keep in (False, True):
        model, config = fresh_model(model_name, FSDPConfig(fsdp_version=2, mixed_precision=False), FP32, device)
        model.eval()
        settings = {"num_beams": 1, "max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
        with AllGatherCount() as gathers, gathered_for_generation(model, FSDP2_RUN, keep):
            ids = generate(model, FSDP2_RUN, SEQ2SEQ.prompts(random_batch(config, device)), settings)
        found[keep] = (gathers.count, ids.tolist())
    same = found[False][1] == found[True][1]
    per_token, kept = found[False][0], found[True][0]
    return (
        "ok" if same else "FAILED"
    ), f"all-gathers for 8 tokens: {per_token}, kept gathered {kept}; same: {same}"


def run_checks(device: torch.device, model_name: str, folder: str) -> dict:
    """Every check on every rank (collective), each with its status, what it found and its seconds; rank 0
    prints one line per check. `folder`: a scratch folder every rank of a node sees."""
    checks = {
        "backends": lambda: check_backends(device),
        "bf16 choice": lambda: check_bf16(device),
        "CPU offload": lambda: check_cpu_offload(model_name, device),
        "host syncs, sdpa": lambda: check_syncs(model_name, device, "sdpa"),
        f"host syncs, {t5_attention.NAME}": lambda: check_syncs(model_name, device, t5_attention.NAME),
        f"{t5_attention.NAME} against sdpa": lambda: check_t5_flex(model_name, device),
        "one rank without FSDP": lambda: check_single_rank(model_name, device),
        "sharded save and load": lambda: check_sharded_save(model_name, device, folder),
        "generation's all-gathers": lambda: check_generation(model_name, device),
    }
    findings = {}
    for name, check in checks.items():
        started = time.perf_counter()
        try:
            with forward_warnings_ignored():  # FSDP2's note on the layers' outputs, as in a run
                status, found = check()
        except Exception as err:  # noqa: BLE001 - a check that breaks is a finding; the others still run
            status, found = "FAILED", f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        findings[name] = {"status": status, "found": found, "seconds": round(time.perf_counter() - started, 2)}
        if dist.get_rank() == 0:
            print(f"{name}: {status}: {found}", flush=True)
        dist.barrier()
    return findings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--model_name", default=str(EMBEDDED_MODEL_DIR))
    parser.add_argument("--output", help="write the findings here as JSON (rank 0)")
    args = parser.parse_args()
    info = process_group.describe_launch(args.device, cpu_offload=True)
    process_group.init_distributed(info, timeout_s=120)
    allocator = os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    findings = {"device": str(info.device), "world_size": info.world_size, "torch": torch.__version__,
                "allocator": allocator}  # fmt: skip
    if info.device.type == "cuda":
        findings["gpu"] = torch.cuda.get_device_name(info.device)
    with tempfile.TemporaryDirectory() as scratch:
        folder = [scratch]
        dist.broadcast_object_list(folder, src=0)  # rank 0's: one folder for the ranks of one node
        checks = run_checks(info.device, args.model_name, folder[0])
        dist.barrier()  # every rank is done with the folder before rank 0 removes it
    if info.is_main and args.output:
        Path(args.output).write_text(json.dumps({**findings, **checks}, indent=2), encoding="utf-8")
    dist.destroy_process_group()
    return 1 if any(check["status"] == "FAILED" for check in checks.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
