"""Segment names that say who made them, and the orphan sweep (``lmshm gc``), with real processes
in the real /dev/shm. Every entry a test makes is removed by the ``made`` fixture."""

from __future__ import annotations

import gc
import json
import os
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from lmshm.platform import shm_orphans
from lmshm.platform.cpu import empty_shared, segment_of
from lmshm.platform.cpu import segments as seg_mod
from lmshm.platform.shm_names import (
    SegmentOwner,
    own_pid_namespace,
    parse_segment_name,
    segment_name,
    valid_segment_name,
)
from lmshm.platform.shm_orphans import pid_alive, sweep_orphans

SHM = "/dev/shm"
REPO = Path(__file__).resolve().parents[3]
OWN_NS = own_pid_namespace()

# A worker: one segment, its name on stdout, then it waits to be killed (or for EOF on stdin).
CREATOR = (
    "import sys, torch, lmshm\n"
    "from lmshm.platform.cpu import segment_of\n"
    "t = lmshm.empty_shared((4096,), torch.uint8, kind='shm')\n"
    "t.fill_(7)\n"
    "print(segment_of(t).name, flush=True)\n"
    "sys.stdin.read()\n"
)


def _readline(stream, timeout_s: float = 120) -> str:
    ready, _, _ = select.select([stream], [], [], timeout_s)
    assert ready, "child said nothing in time"
    return stream.readline().strip()


def _gc(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmshm.cli", "gc", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=60, env={**os.environ, **(env or {})})


def _gc_json(*args: str) -> dict:
    out = _gc("--json", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    assert not pid_alive(p.pid)
    return p.pid


def removed_names(stdout: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in stdout.splitlines() if line.startswith("removed lmshm-")]


def _name(pid: int, ns: int = OWN_NS) -> str:
    return f"lmshm-{pid:x}-{ns:x}-{secrets.token_hex(8)}"


@pytest.fixture
def made():
    """Paths this test created; whatever is still there afterwards is removed."""
    paths: list[str] = []
    yield paths
    for p in paths:
        if os.path.lexists(p):
            os.unlink(p)


def _file(made: list[str], name: str, directory: str = SHM) -> str:
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    made.append(path)
    return path


# ---- the name format -------------------------------------------------------------------------

def test_names_carry_pid_and_pid_namespace():
    assert OWN_NS == os.stat("/proc/self/ns/pid").st_ino != 0
    name = segment_name()
    assert valid_segment_name(name)
    assert parse_segment_name(name) == SegmentOwner(pid=os.getpid(), pid_ns=OWN_NS)
    assert name == f"lmshm-{os.getpid():x}-{OWN_NS:x}-{name[-16:]}"
    assert seg_mod.parse_segment_name is parse_segment_name  # re-exported where segments are made


@pytest.mark.parametrize("isolated", [False, True], ids=["shm", "memfd"])
def test_real_segments_and_memfd_tokens_parse(isolated):
    pool = empty_shared((16,), torch.float32, isolated=isolated)
    seg = segment_of(pool)
    assert valid_segment_name(seg.name)
    assert parse_segment_name(seg.name) == SegmentOwner(os.getpid(), OWN_NS)
    del pool, seg
    gc.collect()


@pytest.mark.parametrize("name", [
    None, 42, b"lmshm-1-2-0123456789abcdef", "",
    "lmshm-foo",
    "lmshm-1a2b-0123456789abcdef",                    # the old format: no namespace
    "lmshm-0-effffffc-0123456789abcdef",               # pid 0
    "lmshm-01-effffffc-0123456789abcdef",              # leading zero
    "lmshm-1-0effffffc-0123456789abcdef",
    "lmshm-1A-effffffc-0123456789abcdef",              # uppercase
    "lmshm-1-effffffc-0123456789ABCDEF",
    "lmshm-1-effffffc-0123456789abcde",                # random too short / long
    "lmshm-1-effffffc-0123456789abcdef0",
    "lmshm-80000000-effffffc-0123456789abcdef",        # does not fit a pid_t
    "lmshm-123456789-effffffc-0123456789abcdef",       # 9 hex digits of pid
    "lmshm-1-12345678901234567-0123456789abcdef",      # 17 hex digits of namespace
    "lmshm-1-effffffc-0123456789abcdef-x",
    "xlmshm-1-effffffc-0123456789abcdef",
    "lmshm-1-effffffc-0123456789abcdef\n",
    "../lmshm-1-effffffc-0123456789abcdef",
    "lmshm--1-effffffc-0123456789abcdef",
])
def test_parse_is_exact(name):
    assert parse_segment_name(name) is None


def test_parse_edges():
    assert parse_segment_name("lmshm-7fffffff-0-0123456789abcdef") == SegmentOwner(2**31 - 1, 0)
    assert parse_segment_name("lmshm-1-ffffffffffffffff-0123456789abcdef") == SegmentOwner(1, 2**64 - 1)


def test_a_forked_child_names_segments_with_its_own_pid():
    segment_name()  # fill the cache in the parent
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, segment_name().encode())
        finally:
            os._exit(0)
    os.close(w)
    name = os.read(r, 200).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert parse_segment_name(name) == SegmentOwner(pid, OWN_NS)


# ---- lmshm gc with real processes --------------------------------------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_gc_removes_a_sigkilled_workers_segment_and_nothing_else(made, tmp_path):
    # A worker SIGKILLed after allocating, before registering: its name stays behind.
    child = subprocess.Popen([sys.executable, "-c", CREATOR], cwd=REPO, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        orphan = _readline(child.stdout)
        made.append(os.path.join(SHM, orphan))
        assert parse_segment_name(orphan) == SegmentOwner(child.pid, OWN_NS)
    finally:
        child.kill()
        child.wait(30)
        child.stdout.close()
        child.stdin.close()
    assert os.path.exists(os.path.join(SHM, orphan)), "SIGKILL unlinks nothing"

    # Kept: a live process's segment (this one), another uid's file, another PID namespace,
    # names that are not exactly the format, a symlink.
    live = empty_shared((64,), torch.uint8, kind="shm")
    live_name = segment_of(live).name
    dead = _dead_pid()
    foreign = _file(made, _name(dead))
    os.chown(foreign, 65534, 65534)
    other_ns = _file(made, _name(dead, OWN_NS + 1))
    unknown_ns = _file(made, _name(dead, 0))
    bad = _file(made, f"lmshm-foo-{secrets.token_hex(4)}")
    old_format = _file(made, f"lmshm-{dead:x}-{secrets.token_hex(8)}")
    target = tmp_path / "target"
    target.write_bytes(b"keep me")
    link = os.path.join(SHM, _name(dead))
    os.symlink(target, link)
    made.append(link)
    kept = [os.path.join(SHM, live_name), foreign, other_ns, unknown_ns, bad, old_format, link]

    # --dry-run lists the orphan and removes nothing.
    dry = _gc("--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"would remove {orphan}" in dry.stdout.splitlines()
    assert dry.stdout.splitlines()[-1].startswith("lmshm gc /dev/shm: would remove ")
    assert os.path.exists(os.path.join(SHM, orphan))
    dry_json = _gc_json("--dry-run")
    assert dry_json["dry_run"] is True and orphan in dry_json["removed"]
    assert os.path.exists(os.path.join(SHM, orphan))

    # The real sweep removes it and says so; everything else stays.
    res = _gc()
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert f"removed {orphan}" in lines
    summary = lines[-1]
    assert summary.startswith("lmshm gc /dev/shm: removed ") and "skipped " in summary
    for reason in ("owner-alive", "other-owner", "other-pid-ns", "bad-name", "not-regular"):
        assert reason in summary
    assert not os.path.exists(os.path.join(SHM, orphan))
    for path in kept:
        assert os.path.lexists(path), f"gc removed {path}"
    assert target.read_bytes() == b"keep me"
    assert os.readlink(link) == str(target)
    for name in removed_names(res.stdout):
        assert parse_segment_name(name) is not None

    # Counted by reason in JSON; a second sweep has nothing of ours to do.
    again = _gc_json()
    assert orphan not in again["removed"] and live_name not in again["removed"]
    skipped = again["skipped"]
    assert skipped["owner-alive"] >= 1 and skipped["other-owner"] >= 1 and skipped["not-regular"] >= 1
    assert skipped["other-pid-ns"] >= 2 and skipped["bad-name"] >= 2
    assert again["skipped_total"] == sum(skipped.values())
    del live
    gc.collect()


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="cannot create a PID namespace here (unshare)")
def test_names_from_another_pid_namespace_are_left_to_a_sweeper_there(made):
    # In a new PID namespace (like a container sharing /dev/shm): sh is pid 1, the worker pid 2
    # (SIGKILLs itself), then a gc runs there once we say so.
    creator = CREATOR.replace("sys.stdin.read()\n", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n")
    script = (f'{sys.executable} -c "$CREATOR"; read go; '
              f'{sys.executable} -m lmshm.cli gc --json')
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
                            cwd=REPO, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "CREATOR": creator})
    try:
        name = _readline(proc.stdout)
        made.append(os.path.join(SHM, name))
        owner = parse_segment_name(name)
        assert owner is not None and owner.pid_ns != OWN_NS and owner.pid == 2
        # Here its pid means nothing (pid 2 is someone else, or nobody): kept.
        res = sweep_orphans(SHM)
        assert name not in res.removed and res.skipped.get("other-pid-ns", 0) >= 1
        assert os.path.exists(os.path.join(SHM, name))
        # In its own namespace the creator is provably dead: removed there.
        out, _ = proc.communicate("go\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0
    inside = json.loads(out)
    assert inside["pid_ns"] == owner.pid_ns and name in inside["removed"]
    assert not os.path.exists(os.path.join(SHM, name))


def test_gc_imports_no_torch(tmp_path):
    code = ("import sys; from lmshm.cli import main; import lmshm.platform.shm_orphans; "
            f"rc = main(['gc', '--shm-dir', {str(tmp_path)!r}]); "
            "assert 'torch' not in sys.modules, 'gc imported torch'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"lmshm gc {tmp_path}: removed 0, skipped 0"


def test_gc_on_an_unusable_directory_exits_1(tmp_path):
    for bad in (tmp_path / "missing", tmp_path / "file"):
        if bad.name == "file":
            bad.write_text("")
        out = _gc("--shm-dir", str(bad))
        assert out.returncode == 1 and "lmshm gc: cannot sweep" in out.stderr and out.stdout == ""


def test_gc_defaults_to_LMSHM_SHM_DIR(tmp_path):
    orphan = tmp_path / _name(_dead_pid())
    orphan.write_bytes(b"")
    out = _gc(env={"LMSHM_SHM_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"removed {orphan.name}", f"lmshm gc {tmp_path}: removed 1, skipped 0"]
    assert not orphan.exists()


# ---- sweep_orphans in-process: races and errors are skipped, never raised ----------------------

@pytest.fixture
def shm_tmp():
    """A private directory on the real tmpfs, so counts are exact."""
    path = tempfile.mkdtemp(prefix="orphans-test-", dir=SHM)
    yield path
    shutil.rmtree(path)


def test_the_inode_is_checked_again_right_before_the_unlink(shm_tmp, made, monkeypatch):
    name = _name(_dead_pid())
    path = _file(made, name, shm_tmp)

    def swap_then_dead(pid, use_proc=None):  # someone replaces the file while we look
        os.unlink(path)
        _file(made, name, shm_tmp)
        return False

    monkeypatch.setattr(shm_orphans, "pid_alive", swap_then_dead)
    res = sweep_orphans(shm_tmp)
    assert res.removed == [] and res.skipped == {"changed": 1}
    assert os.path.exists(path)


def test_a_name_that_vanishes_or_cannot_be_removed_is_counted(shm_tmp, made, monkeypatch):
    gone = _file(made, _name(_dead_pid()), shm_tmp)
    stuck = _file(made, _name(_dead_pid()), shm_tmp)
    real_unlink = os.unlink

    def unlink(p, *, dir_fd=None):
        if p == os.path.basename(gone):
            real_unlink(p, dir_fd=dir_fd)  # someone else got there first
            raise FileNotFoundError(2, "No such file or directory", p)
        raise PermissionError(13, "Permission denied", p)

    monkeypatch.setattr(os, "unlink", unlink)
    res = sweep_orphans(shm_tmp)
    monkeypatch.undo()
    assert res.removed == [] and res.skipped == {"vanished": 1, "permission": 1}
    assert os.path.exists(stuck) and not os.path.exists(gone)


def test_min_age_keeps_fresh_names(shm_tmp, made):
    path = _file(made, _name(_dead_pid()), shm_tmp)
    assert sweep_orphans(shm_tmp, min_age_s=60).skipped == {"too-young": 1}
    os.utime(path, (time.time() - 120,) * 2)
    assert sweep_orphans(shm_tmp, min_age_s=60).removed == [os.path.basename(path)]


def test_uid_and_dry_run_parameters(shm_tmp, made):
    path = _file(made, _name(_dead_pid()), shm_tmp)
    assert sweep_orphans(shm_tmp, uid=os.geteuid() + 1).skipped == {"other-owner": 1}
    dry = sweep_orphans(shm_tmp, dry_run=True)
    assert dry.dry_run and dry.removed == [os.path.basename(path)] and os.path.exists(path)
    assert dry.as_dict() == {"shm_dir": shm_tmp, "dry_run": True, "pid_ns": OWN_NS,
                             "removed": [os.path.basename(path)], "skipped": {}, "skipped_total": 0}
    assert sweep_orphans(shm_tmp).removed == [os.path.basename(path)] and not os.path.exists(path)


def test_liveness_is_conservative():
    assert pid_alive(os.getpid()) and pid_alive(1)
    assert pid_alive(os.getpid(), use_proc=False)
    assert pid_alive(0) and pid_alive(-1)  # never a kill() on a process group
    dead = _dead_pid()
    assert not pid_alive(dead) and not pid_alive(dead, use_proc=False)
    zombie = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # exited, not yet reaped
        with open(f"/proc/{zombie.pid}/stat") as f:
            if f.read().split(") ", 1)[1].startswith("Z"):
                break
        time.sleep(0.01)
    assert pid_alive(zombie.pid), "a zombie keeps its names until reaped"
    zombie.wait()
    assert not pid_alive(zombie.pid)
