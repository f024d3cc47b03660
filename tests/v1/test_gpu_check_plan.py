"""scripts/gpu-check cannot pass by skipping: its plan (``scripts/gpu-check.plan``) selects every
test of the GPU test files, and a required test that skipped or never ran fails the check.

The coverage check runs here, on the CPU (collection needs no GPU), so an area's ``-k`` that
stops selecting a test fails CI, not a rare GPU session. The verdict is driven with real pytest
runs and their real JUnit reports: a tiny test file in a temp folder, and the GPU ordering tests
themselves, which skip on a machine without a device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAN_TOOL = ROOT / "scripts" / "gpu_check_plan.py"
PLAN = ROOT / "scripts" / "gpu-check.plan"


def plan_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PLAN_TOOL), *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def pytest_junit(args: list[str], junit: Path, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args],
                   capture_output=True, text=True, timeout=120, cwd=cwd)


def test_every_test_of_the_gpu_checks_files_is_selected_by_an_area_and_every_required_one_exists():
    got = plan_tool("coverage")
    assert got.returncode == 0, got.stdout + got.stderr
    assert "coverage ok" in got.stdout


def test_an_area_whose_filter_misses_a_test_fails_the_coverage_and_names_it(tmp_path):
    text = PLAN.read_text()
    narrowed = text.replace('-k "ordered_by_events or without_the_ordering_signal"', '-k "ordered_by_events"')
    assert narrowed != text, "the plan's ordering area changed: update this test"
    plan = tmp_path / "plan"
    plan.write_text(narrowed)
    got = plan_tool("coverage", "--plan", str(plan))
    assert got.returncode == 1, got.stdout + got.stderr
    assert "test_gpu_without_the_ordering_signal_a_store_reads_stale_bytes[cuda-raw]" in got.stdout
    assert "(required, and no area selects it)" in got.stdout


def test_a_required_test_passes_the_verdict_only_when_it_ran_and_passed(tmp_path):
    (tmp_path / "test_mini.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_skips():\n    pytest.skip('no device here')\n"
        "@pytest.mark.parametrize('k', [1, 2])\n"
        "def test_params(k):\n    assert k == 1\n")
    out = tmp_path / "out"
    out.mkdir()
    pytest_junit(["test_mini.py"], out / "area-mini.xml", tmp_path)
    plan = tmp_path / "plan"

    def verdict(*required: str) -> subprocess.CompletedProcess:
        plan.write_text("area mini 10 test_mini.py\n" + "".join(f"require {r}\n" for r in required))
        return plan_tool("verdict", str(out), "--plan", str(plan))

    assert verdict("test_mini.py::test_ok").returncode == 0
    skipped = verdict("test_mini.py::test_ok", "test_mini.py::test_skips")
    assert skipped.returncode == 1 and "test_mini.py::test_skips: skipped: no device here" in skipped.stdout
    absent = verdict("test_mini.py::test_gone")
    assert absent.returncode == 1 and "test_mini.py::test_gone: not run" in absent.stdout
    params = verdict("test_mini.py::test_params")     # every parametrisation must pass
    assert params.returncode == 1 and "test_mini.py::test_params[2]: failure" in params.stdout


def test_the_gpu_ordering_tests_skipped_on_a_machine_without_a_device_fail_the_verdict(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the GPU tests would run, not skip (scripts/gpu-check runs them)")
    pytest_junit(["tests/v1/platform/cuda/test_cuda_server_e2e.py", "-k", "ordered_by_events"],
                 tmp_path / "area-ordering.xml", ROOT)
    got = plan_tool("verdict", str(tmp_path))
    assert got.returncode == 1, got.stdout
    assert "test_gpu_store_and_retrieve_are_ordered_by_events[cuda-torch]: skipped" in got.stdout
    assert "test_gpu_isolated_mode_works_with_a_private_dev_shm_per_worker: not run" in got.stdout
