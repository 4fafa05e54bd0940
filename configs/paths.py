"""Where the repository and its embedded assets are: the one definition every module, script and test uses."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
EMBEDDED_MODEL_DIR = REPO_ROOT / "data" / "tiny-t5"  # the offline default model (random init, own vocabulary)
EMBEDDED_DATA_DIR = REPO_ROOT / "data" / "sample"  # the offline default WikiHow-format sample
