"""T5_training.py run from the folder RUN_CWD, as a SLURM job runs from the folder its script was submitted from,
not the repository's. Used by tests/test_run_inputs.py; the product has no test hooks.
"""

import os
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "T5_training.py"

os.chdir(os.environ["RUN_CWD"])
sys.argv[0] = str(SCRIPT)
runpy.run_path(str(SCRIPT), run_name="__main__")
