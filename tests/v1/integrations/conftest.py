import sys
from pathlib import Path

# The multiprocess tests' process helpers (ServerProcess, scratch_dir, wait_for).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multiprocess"))
