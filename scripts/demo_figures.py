"""Run the offline demo and write every demo figure the docs quote, from that run, in one go.

    python scripts/demo_figures.py            # run the demos (4-8 minutes on 2 cores), then write the docs
    python scripts/demo_figures.py --render   # only rewrite the docs' figures from docs/demo_figures.json
    python scripts/demo_figures.py --check    # exit 1 when a doc does not quote docs/demo_figures.json

It runs the README's demo (`torchrun --nproc_per_node 2 T5_training.py`, with --standalone for a free port)
and its longer variant (`--epochs 5 --gamma 0.9`), reads their metrics.jsonl and config.json into
docs/demo_figures.json, and from that file alone writes:

* the blocks between `<!-- demo-figures NAME -->` and `<!-- /demo-figures -->` in README.md (the quick
  start's figures), docs/evaluation.md (the ROUGE table) and docs/ecosystem.md (the picture's run);
* docs/demo_metrics.png, drawn from the demo's metrics.jsonl by scripts/plot_metrics.py (its sha256 is kept
  in docs/demo_figures.json).

So the docs and the picture cannot disagree: tests/test_demo_figures.py checks that every block is the
rendering of docs/demo_figures.json and that the picture is the one written with it, and (slow) that the
README's figures are those of a fresh demo run within a tolerance.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.paths import EMBEDDED_MODEL_DIR, REPO_ROOT  # noqa: E402
from scripts import plot_metrics  # noqa: E402

FIGURES_FILE = REPO_ROOT / "docs" / "demo_figures.json"
PICTURE = REPO_ROOT / "docs" / "demo_metrics.png"
# The runs, by name: the README's demo as it is, and the longer run docs/evaluation.md compares with it.
RUNS = {"demo": [], "five_epochs": ["--epochs", "5", "--gamma", "0.9"]}
# Which block each doc holds.
BLOCKS = {
    REPO_ROOT / "README.md": "readme",
    REPO_ROOT / "docs" / "evaluation.md": "evaluation",
    REPO_ROOT / "docs" / "ecosystem.md": "ecosystem",
}
ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")
WIDTH = 110  # the docs' line length


class FiguresError(Exception):
    """A run that failed, or a doc without its block."""


# ------------------------------------------------------------------------------------------ the runs


def run_demo(output_dir: Path, extra: list[str]) -> float:
    """Train the demo into `output_dir` (plus `extra` flags); its wall time in seconds, start-up included."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "T5_training.py", "--output_dir", str(output_dir), *extra]  # fmt: skip
    print("running:", " ".join(command[2:]), flush=True)
    start = time.monotonic()
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise FiguresError(
            f"the demo failed (exit {done.returncode}):\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
        )
    return time.monotonic() - start


def read_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def figures_of_run(run_dir: Path) -> dict:
    """What the docs quote of one run: each epoch's losses, throughput and end-of-epoch scores, the baselines,
    the first step's loss, and what the run ran on (from its config.json)."""
    records = read_records(run_dir)
    record = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    evals = {r["epoch"]: r for r in records if r["type"] == "eval"}  # an epoch's last eval is its end's
    epochs = []
    for r in sorted((r for r in records if r["type"] == "epoch"), key=lambda r: r["epoch"]):
        scores = evals[r["epoch"]]
        epochs.append({
            "epoch": r["epoch"], "train_loss": r["train_loss"], "val_loss": r["val_loss"],
            "seconds": r["epoch_seconds"], "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"],
            **{key: scores[key] for key in ROUGE_KEYS}, "gen_len": scores["gen_len"],
            "eval_seconds": scores["seconds"], "num_samples": scores["num_samples"],
        })  # fmt: skip
    first_step = min((r for r in records if r["type"] == "step"), key=lambda r: r["step"])
    last_eval = evals[max(evals)]
    return {
        "epochs": epochs,
        "baselines": {name: {key: of[key] for key in ROUGE_KEYS} for name, of in last_eval["baselines"].items()},
        "first_step_loss": first_step["loss"],
        "device": record["device"],
        "world_size": record["world_size"],
        "mixed_precision_policy": record["mixed_precision_policy"],
        "activation_checkpointing": record["fsdp_config"]["fsdp_activation_checkpointing"],
        "versions": record["versions"],
    }


def cpu_name() -> str:
    """The CPU's model name (Linux), or ""."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return ""
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found.group(1).strip() if found else ""


def machine() -> dict:
    """The machine's cores, CPU name and torch's CPU kernel level (AVX2, AVX512): CPUs whose bf16 kernels
    differ round differently, and the demo's figures with them."""
    import torch

    return {"cpus": os.cpu_count(), "cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def measure(work_dir: Path) -> dict:
    """Run every demo of RUNS in `work_dir`, draw the demo's picture, and return the figures of all."""
    figures = {"machine": machine(), "runs": {}}
    for name, extra in RUNS.items():
        run_dir = work_dir / name
        seconds = run_demo(run_dir, extra)
        # The times grow with whatever else runs: the 5-minute load average (its ranks included) says how much.
        load = os.getloadavg()[1]
        figures["runs"][name] = {"flags": extra, "wall_seconds": seconds, "load_average": load}
        figures["runs"][name].update(figures_of_run(run_dir))
    # The picture's title is its folder's name: "demo".
    if plot_metrics.main([str(work_dir / "demo"), "--output", str(PICTURE)]) != 0:
        raise FiguresError("scripts/plot_metrics.py could not draw the demo")
    figures["picture_sha256"] = sha256(PICTURE)
    return figures


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------- the texts


def duration(seconds: float) -> str:
    """'58 s' under two minutes, else '3 min 4 s'."""
    seconds = round(seconds)
    return f"{seconds} s" if seconds < 120 else f"{seconds // 60} min {seconds % 60} s"


def vocabulary_size() -> int:
    return json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text(encoding="utf-8"))["vocab_size"]


def losses_and_rouge(run: dict) -> str:
    """'validation loss 2.48 -> 1.74, ROUGE-L 15.4 -> 19.9 on 300 validation articles': first and last epoch."""
    first, last = run["epochs"][0], run["epochs"][-1]
    return (
        f"validation loss {first['val_loss']:.2f} -> {last['val_loss']:.2f}, ROUGE-L {first['rougeL']:.1f} -> "
        f"{last['rougeL']:.1f} on {last['num_samples']} validation articles"
    )


def precision_words(run: dict) -> str:
    """The demo asks for bf16, which a device without native bf16 replaces with fp32 (faster there)."""
    policy = run["mixed_precision_policy"]  # FSDP's policy, or (one rank without FSDP) autocast_bfloat16 or fp32
    if policy.startswith(("bf", "autocast_bfloat16")):
        return "bf16 mixed precision"
    return f"fp32: no native bf16 on this {run['device'].upper()}" if policy in ("fp32_policy", "fp32") else policy


def machine_words(figures: dict) -> str:
    """'2-core CPU machine' for a CPU run, else its devices ('2 x cuda')."""
    run = figures["runs"]["demo"]
    return (
        f"{figures['machine']['cpus']}-core CPU machine"
        if run["device"] == "cpu"
        else f"{run['world_size']} x {run['device']}"
    )


def load_words(run: dict) -> str:
    """How busy the machine was: the times grow with other work beside the demo's own ranks."""
    return (
        f"5-minute load average {run['load_average']:.1f} at the run's end, {run['world_size']} of it the demo's "
        "own ranks: the times grow with other work"
    )


def epochs_words(run: dict) -> str:
    """'both epochs', '5 epochs'."""
    return "both epochs" if len(run["epochs"]) == 2 else f"{len(run['epochs'])} epochs"


def readme_block(figures: dict) -> str:
    run = figures["runs"]["demo"]
    versions = run["versions"]
    checkpointing = "on" if run["activation_checkpointing"] else "off"
    cpu = ", ".join(filter(None, (figures["machine"]["cpu"], figures["machine"]["cpu_capability"])))
    cpu = f"{cpu}; " if run["device"] == "cpu" and cpu else ""
    epochs_seconds = sum(e["seconds"] for e in run["epochs"])
    text = (
        f"The demo writes to `outputs/`. Measured on this project's {machine_words(figures)} ({cpu}torch "
        f"{versions['torch']}, transformers {versions['transformers']}, {precision_words(run)}, activation "
        f"checkpointing {checkpointing}; {load_words(run)}): {duration(epochs_seconds)} for {epochs_words(run)} "
        f"({duration(run['wall_seconds'])} with start-up), {losses_and_rouge(run)} (the first step's loss is "
        f"{run['first_step_loss']:.1f}: a random model over a {vocabulary_size():,}-token vocabulary). "
        "[docs/ecosystem.md](docs/ecosystem.md#plotting-a-run-scriptsplot_metricspy) plots this run; "
        "`scripts/demo_figures.py` runs it again and writes these figures."
    )
    return fill(text)


def evaluation_block(figures: dict) -> str:
    demo, longer = figures["runs"]["demo"], figures["runs"]["five_epochs"]
    intro = (
        f"The offline demo on {demo['world_size']} {demo['device'].upper()} ranks, {precision_words(demo)}, "
        f"greedy, {demo['epochs'][-1]['num_samples']} validation articles; `eval seconds` is the evaluation's "
        "own cost (written by `scripts/demo_figures.py` from one run of each):"
    )
    rows = [
        "| run | epoch | ROUGE-1 | ROUGE-2 | ROUGE-L | ROUGE-Lsum | gen_len | eval seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, run in (
        (f"default (`--epochs {len(demo['epochs'])}`)", demo),
        (f"`{' '.join(longer['flags'])}`", longer),
    ):
        for i, epoch in enumerate(run["epochs"]):
            name = f"{label}, {duration(run['wall_seconds'])} in all" if i == 0 else ""
            scores = " | ".join(f"{epoch[key]:.2f}" for key in ROUGE_KEYS)
            rows.append(
                f"| {name} | {epoch['epoch']} | {scores} | {epoch['gen_len']:.1f} | {epoch['eval_seconds']:.1f} |"
            )
    baselines = demo["baselines"]
    for label, name in (("baseline lead-3", "lead3"), ("baseline first sentence of each step", "lead_steps")):
        rows.append(f"| {label} | | {' | '.join(f'{baselines[name][key]:.2f}' for key in ROUGE_KEYS)} | | |")
    lead3 = baselines["lead3"]["rougeL"]

    def against_lead3(run: dict) -> str:
        final = run["epochs"][-1]["rougeL"]
        verdict = "beats" if final > lead3 else "stays below"
        return f"{verdict} lead-3 (ROUGE-L {final:.1f} against {lead3:.1f})"

    summary = (
        f"The {len(demo['epochs'])}-epoch default {against_lead3(demo)}; after {len(longer['epochs'])} epochs "
        f"({duration(longer['wall_seconds'])} in all) the model {against_lead3(longer)}."
    )
    return "\n".join([fill(intro), "", *rows, "", fill(summary)])


def ecosystem_block(figures: dict) -> str:
    run = figures["runs"]["demo"]
    epochs = run["epochs"]
    tokens = sorted(e["tokens_per_s"] for e in epochs)
    mfu = sorted(100 * e["mfu"] for e in epochs)
    seconds = sorted(e["seconds"] for e in epochs)
    text = (
        f"This picture's run is the demo that the README and [evaluation.md](evaluation.md#the-demo-measured) "
        f"quote ({run['world_size']} {run['device'].upper()} ranks, {precision_words(run)}, torch "
        f"{run['versions']['torch']}; {load_words(run)}): {losses_and_rouge(run)}, {span(tokens, '{:,.0f}')} "
        f"tokens/s and {span(mfu, '{:.2g}')}% MFU against the CPU GEMM probe of the run's start "
        "([throughput.md](throughput.md#flops-and-mfu): measured once, so the MFU moves with how busy the "
        f"machine was then and while training); each epoch took {span(seconds, '{:.0f}')} s, evaluation included."
    )
    return fill(text)


def span(values: list[float], spec: str) -> str:
    """'9,100-9,800', or one value when the rounded ends are equal."""
    low, high = spec.format(values[0]), spec.format(values[-1])
    return low if low == high else f"{low}-{high}"


def fill(text: str) -> str:
    return textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False)


RENDERERS = {"readme": readme_block, "evaluation": evaluation_block, "ecosystem": ecosystem_block}


def render(figures: dict) -> dict[str, str]:
    """{block name: its text}, from the figures alone."""
    return {name: renderer(figures) for name, renderer in RENDERERS.items()}


# ---------------------------------------------------------------------------------------- the docs


def block_pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- demo-figures {name} -->\n)(.*?)(\n<!-- /demo-figures -->)", re.DOTALL)


def quoted_block(path: Path, name: str) -> str:
    """The text between a doc's markers of block `name`."""
    found = block_pattern(name).search(path.read_text(encoding="utf-8"))
    if not found:
        raise FiguresError(f"{path} has no <!-- demo-figures {name} --> ... <!-- /demo-figures --> block")
    return found.group(2)


def write_blocks(blocks: dict[str, str]) -> None:
    for path, name in BLOCKS.items():
        text = path.read_text(encoding="utf-8")
        quoted_block(path, name)  # the block must be there
        found = block_pattern(name).search(text)
        path.write_text(text[: found.start(2)] + blocks[name] + text[found.end(2) :], encoding="utf-8")
        print(f"wrote {path.relative_to(REPO_ROOT)}")


def stale_docs(figures: dict) -> list[str]:
    """The docs (and the picture) that do not quote `figures`."""
    blocks = render(figures)
    stale = [
        str(path.relative_to(REPO_ROOT))
        for path, name in BLOCKS.items()
        if quoted_block(path, name) != blocks[name]
    ]
    if sha256(PICTURE) != figures["picture_sha256"]:
        stale.append(str(PICTURE.relative_to(REPO_ROOT)))
    return stale


def load_figures() -> dict:
    return json.loads(FIGURES_FILE.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--render", action="store_true", help="rewrite the docs from docs/demo_figures.json")
    mode.add_argument("--check", action="store_true", help="exit 1 when a doc does not quote the figures file")
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_docs(load_figures())
            if stale:
                print(f"stale: {', '.join(stale)}: run python scripts/demo_figures.py", file=sys.stderr)
                return 1
            print("the docs quote docs/demo_figures.json")
            return 0
        if not args.render:
            with tempfile.TemporaryDirectory() as work_dir:
                figures = measure(Path(work_dir))
            FIGURES_FILE.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
            print(f"wrote {FIGURES_FILE.relative_to(REPO_ROOT)} and {PICTURE.relative_to(REPO_ROOT)}")
        write_blocks(render(load_figures()))
    except FiguresError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
