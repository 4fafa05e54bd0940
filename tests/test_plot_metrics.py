"""scripts/plot_metrics.py: the PNG of a run's metrics.jsonl, the data its panels draw, and its errors."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from scripts.plot_metrics import NO_MATPLOTLIB, draw, load_records, main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LOSSES = [4.0, 3.5, 3.25, None, 2.75, 2.5]  # step 4 non-finite: written as null
EPOCHS = [  # (epoch, train_loss, val_loss, tokens_per_s, mfu); epoch 1 ends at step 3, epoch 2 at step 6
    (1, 3.6, 3.4, 1000.0, 0.25),
    (2, 2.6, 2.9, 1200.0, 0.3),
]
VALIDATION = [(1, 2, 3.7), (2, 5, 3.1)]  # (epoch, step, val_loss)
EVALS = [(1, 3, 10.0, 2.0, 8.0, 9.0), (2, 6, 20.0, 4.0, 16.0, 18.0)]  # (epoch, step, R1, R2, RL, RLsum)


def step(number: int) -> dict:
    epoch = 1 if number <= 3 else 2
    return {"type": "step", "epoch": epoch, "step": number, "loss": LOSSES[number - 1], "lr": 1e-3,
            "grad_norm": None, "seconds": 0.1, "model_tflops_per_s": 0.01, "mfu": 0.2}  # fmt: skip


def validation(epoch: int, number: int, val_loss: float) -> dict:
    return {"type": "validation", "epoch": epoch, "step": number, "val_loss": val_loss}


def evaluation(epoch: int, number: int, r1: float, r2: float, rl: float, rlsum: float) -> dict:
    return {"type": "eval", "epoch": epoch, "step": number, "split": "validation", "rouge1": r1, "rouge2": r2,
            "rougeL": rl, "rougeLsum": rlsum, "gen_len": 20.0, "num_samples": 4, "seconds": 1.0,
            "baselines": {"lead_steps": {"rougeL": 15.0}, "lead3": {"rougeL": 12.5}}}  # fmt: skip


def epoch_record(epoch: int, train: float, val: float, tokens: float, mfu: float | None) -> dict:
    return {"type": "epoch", "epoch": epoch, "train_loss": train, "val_loss": val, "epoch_seconds": 1.0,
            "tokens_per_s": tokens, "mfu": mfu}  # fmt: skip


def records(with_evals: bool = True, with_mfu: bool = True) -> list[dict]:
    """Two epochs of three steps, as T5_training.py writes them (memory, steps, validation, eval, epoch)."""
    evals = [evaluation(*e) for e in EVALS] if with_evals else [None, None]
    epochs = [epoch_record(*e[:4], e[4] if with_mfu else None) for e in EPOCHS]
    ordered = [{"type": "memory", "rank": 0, "peak_rss_bytes": 1}, step(1), step(2), validation(*VALIDATION[0])]
    ordered += [step(3), evals[0], epochs[0], step(4), step(5), validation(*VALIDATION[1]), step(6)]
    ordered += [evals[1], epochs[1]]
    return [record for record in ordered if record is not None]


def write_run(path, lines: list) -> str:
    path.mkdir()
    with open(path / "metrics.jsonl", "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


def line(ax, label: str):
    found = [artist for artist in ax.get_lines() if artist.get_label() == label]
    assert len(found) == 1, [artist.get_label() for artist in ax.get_lines()]
    return found[0]


def assert_is_png(path) -> None:
    image = pytest.importorskip("matplotlib.image")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 300 and pixels.shape[1] > 300
    assert pixels.std() > 0.05  # not a blank canvas


def test_writes_a_png_next_to_the_metrics_and_where_asked(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run", records())
    assert main([run]) == 0
    assert_is_png(tmp_path / "run" / "metrics.png")
    assert main([run, "--output", str(tmp_path / "elsewhere.png")]) == 0
    assert_is_png(tmp_path / "elsewhere.png")
    assert "elsewhere.png" in capsys.readouterr().out


def test_the_title_is_the_run_folders_name_or_the_one_given(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    titles = []

    def spy(records, title=""):
        figure = draw(records, title=title)
        titles.append(figure.get_suptitle())
        return figure

    monkeypatch.setattr("scripts.plot_metrics.draw", spy)
    run = write_run(tmp_path / "run", records())  # an absolute path: the picture must not show it
    assert main([run]) == 0
    assert main([run + "/", "--title", "offline demo, 2 ranks"]) == 0
    assert titles == ["run", "offline demo, 2 ranks"]
    assert "/" not in titles[0] and str(tmp_path) not in titles[0]


def test_the_panels_draw_the_records_values(tmp_path):
    pytest.importorskip("matplotlib")
    figure = draw(load_records(Path(write_run(tmp_path / "run", records()))))
    loss_ax, rouge_ax, throughput_ax, mfu_ax = figure.axes
    step_line = line(loss_ax, "train loss (step)")
    np.testing.assert_array_equal(step_line.get_xdata(), [1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(step_line.get_ydata(), [np.nan if v is None else v for v in LOSSES])
    assert list(line(loss_ax, "loss null (non-finite step)").get_xdata()) == [4, 4]
    for label, column in (("train loss (epoch mean)", 1), ("val loss (epoch end)", 2)):
        assert list(line(loss_ax, label).get_xdata()) == [3, 6]  # each epoch's last step
        assert list(line(loss_ax, label).get_ydata()) == [epoch[column] for epoch in EPOCHS]
    mid = line(loss_ax, "val loss (mid-epoch)")
    assert list(zip(mid.get_xdata(), mid.get_ydata(), strict=True)) == [(s, v) for _, s, v in VALIDATION]
    assert "val loss (before training)" not in [artist.get_label() for artist in loss_ax.get_lines()]
    started = draw(load_records(Path(write_run(tmp_path / "started", [validation(1, 0, 7.5), *records()]))))
    assert list(line(started.axes[0], "val loss (before training)").get_xdata()) == [0]  # --eval_on_start
    assert list(line(started.axes[0], "val loss (mid-epoch)").get_xdata()) == [s for _, s, _ in VALIDATION]
    for key, column in (("rouge1", 2), ("rouge2", 3), ("rougeL", 4), ("rougeLsum", 5)):
        assert list(line(rouge_ax, key).get_xdata()) == [3, 6]
        assert list(line(rouge_ax, key).get_ydata()) == [e[column] for e in EVALS]
    assert list(line(rouge_ax, "lead-3 baseline rougeL").get_ydata()) == [12.5, 12.5]
    assert [bar.get_height() for bar in throughput_ax.patches] == [epoch[3] for epoch in EPOCHS]
    np.testing.assert_allclose(line(mfu_ax, "MFU (%)").get_ydata(), [epoch[4] * 100 for epoch in EPOCHS])


def test_a_run_without_evaluations_or_mfu_still_plots(tmp_path):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run", records(with_evals=False, with_mfu=False))
    assert main([run]) == 0
    assert_is_png(tmp_path / "run" / "metrics.png")
    loss_ax, rouge_ax, throughput_ax = draw(load_records(tmp_path / "run")).axes
    assert [text.get_text() for text in rouge_ax.texts] == ["no ROUGE evaluations in this run"]
    assert "no MFU recorded" in throughput_ax.get_title()
    assert len(line(loss_ax, "train loss (step)").get_xdata()) == len(LOSSES)


def test_an_empty_file_plots_every_panel_as_empty(tmp_path):
    pytest.importorskip("matplotlib")
    assert main([write_run(tmp_path / "run", [])]) == 0
    assert_is_png(tmp_path / "run" / "metrics.png")
    texts = [text.get_text() for ax in draw([]).axes for text in ax.texts]
    assert texts == [
        "no step, validation or epoch losses in this run",
        "no ROUGE evaluations in this run",
        "no epoch records with tokens/s in this run",
    ]


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err  # one line, no traceback
    return err


def test_a_missing_folder_or_file_is_one_line_and_exit_code_2(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "nowhere is not a folder" in one_error(capsys)
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "metrics.jsonl does not exist" in one_error(capsys)
    run = write_run(tmp_path / "run", records())
    assert main([run, "--output", str(tmp_path / "no" / "such" / "dir.png")]) == 2
    assert "does not exist: cannot write" in one_error(capsys)


def test_a_line_that_is_not_json_is_named(tmp_path, capsys):
    run = write_run(tmp_path / "run", [*records()[:2], '{"type": "step", "ste', *records()[2:]])
    assert main([run]) == 2
    assert "metrics.jsonl line 3 is not JSON" in one_error(capsys)
    list_run = write_run(tmp_path / "list", [records()[0], "[1, 2]"])
    assert main([list_run]) == 2
    assert "line 2 is not a JSON object" in one_error(capsys)


def test_a_last_line_cut_short_by_a_running_or_crashed_run_is_left_out(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run", records())
    with open(tmp_path / "run" / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"type": "step", "epoch": 2, "ste')  # no newline: the writer was cut off here
    assert main([run]) == 0
    assert "cut short" in capsys.readouterr().err


def test_without_matplotlib_it_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    run = write_run(tmp_path / "run", records())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert main([run]) == 2
    assert one_error(capsys) == f"error: {NO_MATPLOTLIB}\n"
    assert NO_MATPLOTLIB == "scripts/plot_metrics.py needs matplotlib: pip install matplotlib"
    assert not (tmp_path / "run" / "metrics.png").exists()
