"""What ``scripts/gpu-check`` runs (``scripts/gpu-check.plan``), and whether a run proved it.

A GPU check that skips is not a GPU check. Two ways it could pass without proving anything, and
the command here that closes each:

- ``coverage``: a test in a GPU test file that no area selects (an area's ``-k`` that misses it)
  would never run. This collects every area's selection, as pytest makes it, and fails naming
  each test of the named files that no area selects. It needs no GPU (collection imports the
  test modules, never a device), so a CPU test in CI runs it too.
- ``verdict OUTDIR``: the areas write JUnit XML (``area-NAME.xml``); every ``require`` of the plan
  must be there and have passed. Skipped (no root for ``unshare``, say), deselected, or missing
  from every report is a failure, with the reason pytest gave.

    python scripts/gpu_check_plan.py coverage [--plan FILE]
    python scripts/gpu_check_plan.py verdict OUTDIR [--plan FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "scripts" / "gpu-check.plan"
#: Files of these folders that no area names run in the area "other" (gpu-check adds it).
OTHER_GLOB = "tests/v1/platform/cuda/test_*.py"


@dataclass
class Plan:
    areas: list[tuple[str, int, list[str]]] = field(default_factory=list)
    required: list[str] = field(default_factory=list)

    def named_files(self) -> list[str]:
        out: list[str] = []
        for _, _, args in self.areas:
            out += [a for a in args if a.endswith(".py") and a not in out]
        return out


def read_plan(path: Path = PLAN) -> Plan:
    plan = Plan()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] == "area" and len(words) >= 4 and words[2].isdigit():
            plan.areas.append((words[1], int(words[2]), words[3:]))
        elif words[0] == "require" and len(words) == 2 and "::" in words[1]:
            plan.required.append(words[1])
        else:
            raise SystemExit(f"{path}:{n}: expected 'area NAME LIMIT_S ARGS...' or 'require FILE::TEST', "
                             f"got {line.strip()[:80]!r}")
    return plan


def _collect(args: list[str]) -> set[str]:
    """The node ids pytest selects for ``args`` (after ``-k``/``-m`` deselection)."""
    import pytest

    class Keep:
        ids: set[str] = set()

        def pytest_collection_finish(self, session) -> None:
            self.ids = {item.nodeid for item in session.items}

    keep = Keep()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        rc = pytest.main([*args, "--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[keep])
    if rc not in (0, 5):            # 5: nothing collected, which coverage then reports
        raise SystemExit(f"collecting {shlex.join(args)} failed (pytest exit {int(rc)}): "
                         f"pytest --collect-only {shlex.join(args)} says why")
    return keep.ids


def coverage(plan: Plan) -> list[str]:
    """Tests of the files an area names that no area selects, in order."""
    selected: set[str] = set()
    for _, _, args in plan.areas:
        selected |= _collect(args)
    every = _collect(plan.named_files())
    missing = sorted(every - selected)
    for req in plan.required:
        if not any(i == req or i.startswith(req + "[") for i in selected):
            missing.append(f"{req} (required, and no area selects it)")
    return missing


def _outcomes(outdir: Path) -> dict[str, tuple[str, str]]:
    """node id -> (outcome, message) over every area's JUnit report."""
    out: dict[str, tuple[str, str]] = {}
    for path in sorted(outdir.glob("area-*.xml")):
        try:
            tree = ET.parse(path)
        except ET.ParseError as exc:
            print(f"gpu-check: {path.name} is not a JUnit report ({exc}): its area did not finish")
            continue
        for case in tree.iter("testcase"):
            # xunit2 (pytest's default) names a test by module as dotted path; module-level tests
            # only (the GPU tests have no classes)
            node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome, message = tag, (el.get("message") or el.text or "").strip().splitlines()[0:1]
                    message = message[0][:200] if message else ""
                    break
            out[node] = (outcome, message)
    return out


def verdict(plan: Plan, outdir: Path) -> list[str]:
    """One line per required test that did not run and pass."""
    outcomes = _outcomes(outdir)
    bad = []
    for req in plan.required:
        runs = {n: o for n, o in outcomes.items() if n == req or n.startswith(req + "[")}
        if not runs:
            bad.append(f"{req}: not run (in no area's report)")
        for node, (outcome, message) in sorted(runs.items()):
            if outcome != "passed":
                bad.append(f"{node}: {outcome}{': ' + message if message else ''}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("coverage", "verdict"))
    ap.add_argument("outdir", nargs="?", help="verdict: the folder with the areas' area-NAME.xml")
    ap.add_argument("--plan", type=Path, default=PLAN)
    a = ap.parse_args()
    os.chdir(ROOT)
    plan = read_plan(a.plan)
    if a.command == "coverage":
        missing = coverage(plan)
        for m in missing:
            print(f"gpu-check: selected by no area: {m}")
        print(f"gpu-check: coverage {'FAIL' if missing else 'ok'}: {len(missing)} test(s) selected by no area")
        return 1 if missing else 0
    if not a.outdir:
        ap.error("verdict needs OUTDIR")
    bad = verdict(plan, Path(a.outdir))
    for line in bad:
        print(f"gpu-check: required test not passed: {line}")
    print(f"gpu-check: required FAIL: {len(bad)} problem(s)" if bad else
          f"gpu-check: required ok: all {len(plan.required)} passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
