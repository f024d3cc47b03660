"""Streaming stores: lmshm-server re-executes itself once with glibc's non-temporal threshold set
(lmshm/platform/memcopy.py). Real processes; the server's own environment is checked in
tests/v1/multiprocess/test_dataplane.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmshm.platform.memcopy import STREAMING_THRESHOLD, TUNABLE, _has_tunable, tunables_with_streaming

SETTING = f"{TUNABLE}={STREAMING_THRESHOLD:#x}"
PROBE = ("from lmshm.platform.memcopy import reexec_with_streaming_copies as r; r(); import os; "
         "print(os.environ.get('GLIBC_TUNABLES'), os.getpid(), flush=True)")


def test_the_threshold_is_added_to_other_tunables_and_never_over_an_operators_own():
    assert tunables_with_streaming("") == SETTING
    assert tunables_with_streaming("glibc.malloc.arena_max=2") == f"glibc.malloc.arena_max=2:{SETTING}"
    assert tunables_with_streaming(f"{TUNABLE}=0x4040:glibc.malloc.arena_max=2") is None


def _probe(**env: str) -> tuple[str, int, int]:
    proc = subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, text=True,
                            env={**{k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}, **env})
    out, _ = proc.communicate(timeout=60)
    tunables, pid = out.split()
    return tunables, int(pid), proc.pid


@pytest.mark.skipif(not _has_tunable(), reason="glibc on x86-64 only")
def test_the_process_executes_itself_once_with_the_threshold_and_keeps_its_pid():
    tunables, pid, started = _probe()
    assert tunables == SETTING and pid == started
    tunables, _, _ = _probe(GLIBC_TUNABLES="glibc.malloc.arena_max=2")
    assert tunables == f"glibc.malloc.arena_max=2:{SETTING}"


@pytest.mark.skipif(not _has_tunable(), reason="glibc on x86-64 only")
def test_an_operators_value_or_the_switch_leaves_the_environment_alone():
    assert _probe(GLIBC_TUNABLES=f"{TUNABLE}=0x20000")[0] == f"{TUNABLE}=0x20000"
    assert _probe(LMSHM_STREAMING_COPIES="0")[0] == "None"
