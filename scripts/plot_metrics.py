"""Draw a run's metrics.jsonl as one PNG of three panels, one above the other.

    python scripts/plot_metrics.py outputs/run1                 # writes outputs/run1/metrics.png
    python scripts/plot_metrics.py outputs/run1 --output run1.png
    python scripts/plot_metrics.py outputs/run1 --title "t5-base, 8 GPUs"

The figure's title is --title, or else the run folder's name alone ("run1"): never a machine path, so a
committed picture does not show where it was made.

1. Loss against the global step: the train loss of every step (a step whose loss is null, non-finite or
   skipped, leaves a gap and a red vertical line), each epoch's mean train loss and validation loss at the
   epoch's last step, the mid-epoch validation losses of --eval_every_n_steps, and --eval_on_start's.
2. ROUGE-1/2/L/Lsum of every eval record against the step (one line style per split), with the lead-3
   baseline's ROUGE-L of the same articles as a dashed line.
3. Throughput per epoch: tokens/s (left axis) and MFU in percent (right axis) where the epoch records have it.

A panel with no data says so instead of failing. matplotlib (Agg backend, no display) is needed only here,
not by training: pip install matplotlib.
"""

import argparse
import json
import math
import sys
from pathlib import Path

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")
SCORE_COLORS = {"rouge1": "tab:blue", "rouge2": "tab:orange", "rougeL": "tab:green", "rougeLsum": "tab:purple",
                "accuracy": "tab:red"}  # fmt: skip
# rouge1, rougeL and rougeLsum are often equal on short summaries: each its own marker and size, so that one
# line drawn over another still shows.
SCORE_MARKERS = {
    "rouge1": ("o", 8),
    "rouge2": ("s", 6),
    "rougeL": ("^", 6),
    "rougeLsum": ("x", 7),
    "accuracy": ("o", 6),
}
SPLIT_STYLES = ("-", "--", ":", "-.")
NO_MATPLOTLIB = "scripts/plot_metrics.py needs matplotlib: pip install matplotlib"


class PlotError(Exception):
    """A one-line reason the plot cannot be made (missing folder or file, a line that is not JSON)."""


def load_records(run_dir: Path) -> list[dict]:
    """The JSON objects of run_dir/metrics.jsonl, in file order (blank lines skipped)."""
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir} is not a folder: give the output_dir of a T5_training.py run")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path} does not exist: is {str(run_dir)!r} an output_dir of T5_training.py?")
    records = []
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines) and not line.endswith("\n"):  # a running or crashed run's last line
                print(f"note: {path} line {number} is cut short (a run still writing?): left out", file=sys.stderr)
                continue
            raise PlotError(f"{path} line {number} is not JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise PlotError(f"{path} line {number} is not a JSON object")
        records.append(record)
    return records


def of_type(records: list[dict], kind: str, *keys: str) -> list[dict]:
    """The records of one type that have every key in `keys` (the value may be null)."""
    return [r for r in records if r.get("type") == kind and all(key in r for key in keys)]


def number(value) -> float:
    """A metric as a float; null (NaN or infinity in the run) becomes NaN, which matplotlib leaves out."""
    return math.nan if value is None else float(value)


def step_losses(records: list[dict]) -> tuple[list[int], list[float]]:
    """(steps, losses) of the step records, sorted by step; a later record of a step replaces an earlier."""
    losses = {r["step"]: number(r["loss"]) for r in of_type(records, "step", "step", "loss")}
    steps = sorted(losses)
    return steps, [losses[s] for s in steps]


def epoch_end_steps(records: list[dict]) -> dict[int, int]:
    """{epoch: its last global step}, from every record that names both an epoch and a step."""
    ends: dict[int, int] = {}
    for r in records:
        if r.get("epoch") is not None and r.get("step") is not None:
            ends[r["epoch"]] = max(ends.get(r["epoch"], r["step"]), r["step"])
    return ends


def epoch_points(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(epoch-end steps, values of `key`) of the epoch records whose epoch's last step is known."""
    ends = epoch_end_steps(records)
    epochs = [r for r in of_type(records, "epoch", "epoch", key) if r["epoch"] in ends]
    return [ends[r["epoch"]] for r in epochs], [number(r[key]) for r in epochs]


def say_empty(ax, message: str) -> None:
    """Write `message` in the middle of an empty panel."""
    ax.text(0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center", color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_some(ax, points: tuple[list, list], fmt: str, **style) -> None:
    """ax.plot(x, y, fmt, **style) when there is at least one point (an empty line would still get a legend
    entry)."""
    x, y = points
    if x:
        ax.plot(x, y, fmt, **style)


def draw_losses(ax, records: list[dict]) -> None:
    """Panel 1: per-step train loss, per-epoch train and validation loss, mid-epoch validation loss, and the
    validation loss before training (--eval_on_start)."""
    ax.set_title("loss")
    steps, losses = step_losses(records)
    validation = of_type(records, "validation", "step", "val_loss")
    if not steps and not validation and not of_type(records, "epoch", "train_loss"):
        say_empty(ax, "no step, validation or epoch losses in this run")
        return
    plot_some(ax, (steps, losses), "-", color="tab:blue", linewidth=1, alpha=0.7, label="train loss (step)")
    for i, step in enumerate(s for s, loss in zip(steps, losses, strict=True) if math.isnan(loss)):
        ax.axvline(step, color="tab:red", alpha=0.3, label="loss null (non-finite step)" if i == 0 else None)
    train, val = epoch_points(records, "train_loss"), epoch_points(records, "val_loss")
    plot_some(ax, train, "o-", color="tab:blue", label="train loss (epoch mean)")
    plot_some(ax, val, "s-", color="tab:orange", label="val loss (epoch end)")
    before = [r for r in validation if r["step"] == 0]  # --eval_on_start
    mid_epoch = [r for r in validation if r["step"] > 0]
    for chosen, fmt, label in (
        (mid_epoch, "^", "val loss (mid-epoch)"),
        (before, "D", "val loss (before training)"),
    ):
        points = [r["step"] for r in chosen], [number(r["val_loss"]) for r in chosen]
        plot_some(ax, points, fmt, color="tab:orange", label=label)
    ax.set_xlabel("global step")
    ax.xaxis.set_major_locator(whole_steps())
    ax.set_ylabel("cross-entropy per target token")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def draw_rouge(ax, records: list[dict]) -> None:
    """Panel 2: the scores of the eval records (ROUGE, or accuracy with --eval_metric accuracy) against the
    step, one line style per split; the lead-3 baseline of ROUGE."""
    evals = sorted(of_type(records, "eval", "step"), key=lambda r: r["step"])
    accuracy = bool(evals) and "accuracy" in evals[-1]
    ax.set_title("accuracy (%)" if accuracy else "ROUGE (F-measure x 100)")
    if not evals:
        say_empty(ax, "no ROUGE evaluations in this run")
        return
    splits = list(dict.fromkeys(r.get("split", "validation") for r in evals))
    scores = []
    for split, style in zip(splits, SPLIT_STYLES, strict=False):
        chosen = [r for r in evals if r.get("split", "validation") == split]
        for key in ("accuracy",) if accuracy else ROUGE_KEYS:
            label = key if len(splits) == 1 else f"{key} ({split})"
            y = [number(r.get(key)) for r in chosen]
            marker, size = SCORE_MARKERS[key]
            ax.plot([r["step"] for r in chosen], y, marker + style, markersize=size, fillstyle="none",
                    color=SCORE_COLORS[key], label=label)  # fmt: skip
            scores += y
    lead3 = evals[-1].get("baselines", {}).get("lead3", {}).get("rougeL")
    if lead3 is not None:
        ax.axhline(lead3, color="0.3", linestyle="--", linewidth=1, label="lead-3 baseline rougeL")
        scores.append(lead3)
    ax.set_xlabel("global step")
    ax.xaxis.set_major_locator(whole_steps())
    ax.set_ylabel("accuracy" if accuracy else "ROUGE")
    ax.set_ylim(0, top_limit(scores, 1.5))  # room above the lines for the legend
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2, loc="upper left")


def whole_steps():
    """A tick locator of whole steps only (a short run's axis would get 4.5, 5.5)."""
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def top_limit(values: list[float], headroom: float) -> float:
    """An axis top `headroom` times the largest finite value (1 when there is none or it is 0)."""
    return headroom * max((v for v in values if not math.isnan(v)), default=0) or 1


def draw_throughput(ax, records: list[dict]) -> None:
    """Panel 3: tokens/s of each epoch as bars (left axis), MFU in percent as a line (right axis) where
    recorded."""
    epochs = sorted(of_type(records, "epoch", "epoch", "tokens_per_s"), key=lambda r: r["epoch"])
    ax.set_title("throughput per epoch")
    if not epochs:
        say_empty(ax, "no epoch records with tokens/s in this run")
        return
    x = [r["epoch"] for r in epochs]
    tokens = [number(r["tokens_per_s"]) for r in epochs]
    ax.bar(x, tokens, width=0.6, color="tab:blue", alpha=0.6, label="tokens/s")
    ax.set(xlabel="epoch", xticks=x, ylim=(0, top_limit(tokens, 1.3)))  # room for the legend at the top
    ax.set_ylabel("tokens/s (non-padding, all ranks)", color="tab:blue")
    ax.grid(alpha=0.3, axis="y")
    mfu = [number(r.get("mfu")) * 100 for r in epochs]
    if all(math.isnan(m) for m in mfu):
        ax.set_title("throughput per epoch (no MFU recorded: unknown peak)")
        ax.legend(fontsize="small", loc="upper right")
        return
    right = ax.twinx()
    right.plot(x, mfu, "s-", color="tab:red", label="MFU (%)")
    right.set_ylabel("MFU (%)", color="tab:red")
    right.set_ylim(0, top_limit(mfu, 1.6))
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    right.legend(handles=handles, fontsize="small", loc="upper right")


def draw(records: list[dict], title: str = ""):
    """The three-panel matplotlib Figure of a run's records (not saved, not shown)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 12), layout="constrained")
    loss_ax, rouge_ax, throughput_ax = figure.subplots(3, 1)
    draw_losses(loss_ax, records)
    draw_rouge(rouge_ax, records)
    draw_throughput(throughput_ax, records)
    if title:
        figure.suptitle(title)
    return figure


def figure_title(run_dir: Path, title: str | None = None) -> str:
    """`title` when given, else the run folder's own name ("outputs/run1/" and "/abs/run1" give "run1")."""
    return title if title is not None else run_dir.resolve().name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", help="a T5_training.py output_dir (holds metrics.jsonl)")
    parser.add_argument("--output", help="the PNG to write (default: OUTPUT_DIR/metrics.png)")
    parser.add_argument("--title", help="the figure's title (default: the name of OUTPUT_DIR, without its path)")
    args = parser.parse_args(argv)
    run_dir = Path(args.output_dir)
    output = Path(args.output) if args.output else run_dir / "metrics.png"
    try:
        records = load_records(run_dir)
        if not output.parent.is_dir():
            raise PlotError(f"{output.parent} does not exist: cannot write {output}")
    except PlotError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        import matplotlib
    except ImportError:
        print(f"error: {NO_MATPLOTLIB}", file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    draw(records, title=figure_title(run_dir, args.title)).savefig(output, dpi=100)
    print(f"wrote {output} ({len(records)} records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
