"""scripts/compare_step_losses.py: the acceptance check that runs train identically."""

import json

from scripts.compare_step_losses import main


def write_run(path, losses):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"type": "epoch", "epoch": 1}) + "\n")
        for step, loss in enumerate(losses, start=1):
            f.write(json.dumps({"type": "step", "epoch": 1, "step": step, "loss": loss}) + "\n")


def test_equal_runs_pass_and_different_runs_fail(tmp_path, capsys):
    write_run(tmp_path / "a", [3.0, 2.0, 1.0])
    write_run(tmp_path / "b", [3.0, 2.0, 1.00005])  # 5e-5 relative
    write_run(tmp_path / "c", [3.0, 2.0, 1.01])
    write_run(tmp_path / "short", [3.0, 2.0])
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--rtol", "1e-4"]) == 0
    assert main([str(tmp_path / "a"), str(tmp_path / "c"), "--rtol", "1e-4"]) == 1
    assert main([str(tmp_path / "a"), str(tmp_path / "short")]) == 1
    assert "steps differ" in capsys.readouterr().out
