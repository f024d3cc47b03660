"""Wording of client-side errors that need no server."""

from __future__ import annotations

from lmshm.platform.cpu import CpuFdIPCWrapper
from lmshm.transport.client import MPClient


def _memfd_wrapper(token: str) -> CpuFdIPCWrapper:
    return CpuFdIPCWrapper(dtype="float16", shape=(4,), stride=(1,), storage_offset=0, device="cpu",
                           segment=token, segment_bytes=8, byte_offset=0)


def test_missing_fd_channel_names_the_kinds_and_says_what_to_change():
    msg = MPClient._fd_channel_message(
        [_memfd_wrapper("lmshm-1-aa"), _memfd_wrapper("lmshm-1-bb")],
        "this client has no fd-channel link to the server at tcp://127.0.0.1:5555")
    assert msg.startswith("2 wrapper(s) of kind cpu-memfd hand their memory over as file descriptors")
    assert "no fd-channel link to the server at tcp://127.0.0.1:5555" in msg
    assert "--fd-socket" in msg and "LMSHM_FD_SOCKET" in msg
    assert msg.count("CPU memory travels as sealed memfd") == 1, "one hint per kind, not per wrapper"
    assert "LMSHM_CPU_SEGMENTS=shm" in msg
