"""The README's main job, scripts/demo, end to end (its Python part: examples/demo.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[3] / "examples" / "demo.py"


def test_demo_registers_two_workers_proves_zero_copy_and_shuts_down_cleanly():
    proc = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "demo-worker-0" in out and "demo-worker-1" in out and "OWNER PID" in out
    assert out.count(" ok\n") == 4 and "MISMATCH" not in out
    assert "engine A: 0 of 3328 prompt tokens from lmshm" in out
    assert "engine B: 3072 of 3328 prompt tokens from lmshm (92% hit rate)" in out and "s saved" in out
    assert "bit-identical" in out and "/status " in out
    assert "exited with status 0 after SIGTERM" in out and "holds 0 registration(s), 0 mapping(s)" in out
